"""The one argument-validation path every subcommand (and server) goes through.

Each ``check_*`` takes the raw value and returns it normalised, or raises
:class:`~mmferry.errors.ArgumentError` naming the argument; :func:`validated` turns that into
a usage error (exit code 2) for click commands.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
import torch

from mmferry.errors import ArgumentError

__all__ = [
    "check_device",
    "check_model",
    "check_out",
    "check_positive",
    "check_weights",
    "validated",
]

T = TypeVar("T", bound=Callable[..., Any])


def check_model(name: str, argument: str = "--model") -> str:
    from mmferry import models

    known = models.names()
    if name not in known:
        raise ArgumentError(f"unknown model {name!r}; known: {', '.join(known)}", argument=argument)
    return name


def check_weights(path: str | Path | None) -> Path | None:
    if path is None:
        return None
    p = Path(path)
    if not p.is_dir():
        raise ArgumentError(f"{p} is not a directory", argument="--weights")
    if not (p / "config.json").is_file():
        raise ArgumentError(f"{p} has no config.json", argument="--weights")
    return p


def check_device(device: str) -> torch.device:
    from mmferry.transfer import parse_device

    return parse_device(device, argument="--device", types=("cpu", "cuda"))


def check_out(path: str | None, *, suffix: str = ".safetensors") -> Path | None:
    if path is None:
        return None
    p = Path(path)
    if p.suffix != suffix:
        raise ArgumentError(f"expected a {suffix} file, got {p.name}", argument="--out")
    if not p.parent.is_dir():
        raise ArgumentError(f"directory {p.parent} does not exist", argument="--out")
    return p


def check_positive(value: int | None, argument: str) -> int | None:
    if value is not None and value < 1:
        raise ArgumentError(f"must be a positive integer, got {value}", argument=argument)
    return value


def validated(command: T) -> T:
    """Run a click command body; an :class:`ArgumentError` becomes a usage error (exit 2)."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except ArgumentError as e:
            raise click.UsageError(str(e)) from None

    return wrapper  # type: ignore[return-value]
