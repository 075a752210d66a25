"""The reference encoder models, by name: :func:`names` and :func:`load`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmferry.errors import ArgumentError
from mmferry.models.checkpoint import CheckpointError, load_safetensors, read_json

__all__ = ["CheckpointError", "load", "names"]

_NAMES = ("qwen2-vl",)
SEED = 0


def names() -> list[str]:
    """The model names :func:`load` accepts."""
    return list(_NAMES)


def _dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ArgumentError(f"not a floating-point torch dtype: {dtype!r}", argument="dtype")
    return value


def _init_random(module: nn.Module, seed: int) -> None:
    """Deterministic weights: matrices ~ N(0, 0.02), vectors named ``weight`` (norm scales)
    one, everything else (biases) zero; drawn in name order from one seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.state_dict().items():
            if p.ndim >= 2:
                p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen))
            elif name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.zero_()


def _materialise(build: Callable[[], nn.Module], weights: Path | None,
                 prefixes: Mapping[str, str], dtype: torch.dtype) -> nn.Module:
    # Built on `meta` so no storage is allocated or initialised twice; then either the
    # checkpoint's tensors or seeded random ones fill it.
    with torch.device("meta"):
        model = build()
    model = model.to_empty(device="cpu").to(dtype)
    if weights is None:
        _init_random(model, SEED)
    else:
        load_safetensors(model, weights, prefixes)
    return model.eval().requires_grad_(False)


def load(name: str, weights: str | Path | None = None, config: str | Mapping[str, Any] = "tiny",
         *, dtype: torch.dtype | str | None = None) -> Any:
    """Build model ``name`` on the CPU, in eval mode, with ``dtype`` weights (float32 default).

    ``weights``: a local checkpoint folder; its ``config.json`` gives the architecture and
    its safetensors files (sharded or not) the weights, of which only the encoder's are read.
    ``config``: ``"tiny"`` (a small architecture built in code) or a checkpoint's
    ``config.json`` content as a dict, for a model of that size with random weights. Random
    weights are seeded, so two loads give the same model.

    Raises:
        ArgumentError: an unknown name (the message lists the known ones), a bad dtype, or
            both ``weights`` and a ``config`` dict.
        CheckpointError: a checkpoint that does not fit the model (names the parameter).
    """
    if name not in _NAMES:
        raise ArgumentError(f"unknown model {name!r}; available: {', '.join(_NAMES)}",
                            argument="model")
    folder = None if weights is None else Path(weights)
    if folder is not None:
        if not (isinstance(config, str) and config == "tiny"):
            raise ArgumentError("give weights (whose config.json is used) or config, not both",
                                argument="config")
        config = read_json(folder, "config.json")
    elif isinstance(config, str) and config != "tiny":
        raise ArgumentError(f"config must be 'tiny' or a config.json dict, got {config!r}",
                            argument="config")

    if name == "qwen2-vl":
        from mmferry.models import qwen2_vl

        vision = qwen2_vl.TINY if isinstance(config, str) else qwen2_vl.VisionConfig.from_dict(config)
        processor = qwen2_vl.ProcessorConfig()
        if folder is not None and (folder / "preprocessor_config.json").is_file():
            processor = qwen2_vl.ProcessorConfig.from_dict(
                read_json(folder, "preprocessor_config.json"))
        return _materialise(lambda: qwen2_vl.Qwen2VL(vision, processor), folder,
                            qwen2_vl.Qwen2VL.checkpoint_prefixes, _dtype(dtype))
    raise AssertionError(name)  # every name in _NAMES has a branch above
