"""Load a module's parameters by name from a local safetensors checkpoint folder.

A folder holds ``config.json`` and either ``model.safetensors.index.json`` (sharded: its
``weight_map`` names each tensor's file) or one or more ``*.safetensors`` files. Only the
tensors under the given key prefixes are read (an encoder never touches the language model's
weights), lazily, one file at a time.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from mmferry.errors import ArgumentError, CheckpointError
from mmferry.files import FileRefused, read_regular

__all__ = ["CheckpointError", "config_values", "load_safetensors", "read_json"]

INDEX = "model.safetensors.index.json"
# config.json, preprocessor_config.json and shard indexes are kilobytes to a few megabytes.
MAX_JSON_BYTES = 64 << 20
# safetensors dtype names of floating-point tensors (cast to the parameter's dtype on load).
_FLOATING = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ",
                       "F8_E5M2FNUZ", "F8_E8M0"})


def read_json(folder: str | Path, name: str) -> dict[str, Any]:
    """``folder/name`` parsed; a missing or malformed file is a :class:`CheckpointError`."""
    path = Path(folder) / name
    try:
        data = json.loads(read_regular(path, MAX_JSON_BYTES))
    except FileRefused as e:
        raise CheckpointError(f"{path}: {e.reason}") from None
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: cannot read JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def config_values(cls: type, values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The entries of ``values`` that name fields of the dataclass ``cls``, each checked
    against the type of the field's default: ints are ints (not bools) and positive, floats
    are finite positive numbers, strings are strings, tuples of floats are lists of finite
    numbers. ``where`` prefixes the key in errors (``vision_config``).

    Raises:
        ArgumentError: naming ``where.key`` and the bad value (``argument="config"``).
    """
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        value, default, key = values[f.name], f.default, f"{where}.{f.name}" if where else f.name

        def bad(expected: str, value: Any = value, key: str = key) -> ArgumentError:
            return ArgumentError(f"{key} must be {expected}, got {value!r}", argument="config")

        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise bad("true or false")
        elif isinstance(default, int):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad("a positive integer")
        elif isinstance(default, float):
            if (not isinstance(value, int | float) or isinstance(value, bool)
                    or not math.isfinite(value) or value <= 0):
                raise bad("a positive number")
            value = float(value)
        elif isinstance(default, str):
            if not isinstance(value, str):
                raise bad("a string")
        elif isinstance(default, tuple):
            if not isinstance(value, list | tuple) or len(value) != len(default) or not all(
                    isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                    for v in value):
                raise bad(f"a list of {len(default)} numbers")
            value = tuple(float(v) for v in value)
        out[f.name] = value
    return out


def _key_files(folder: Path) -> dict[str, Path]:
    """Every tensor key in the checkpoint and the file that holds it.

    A key that two sources give is ambiguous, never last-one-wins: two ``*.safetensors``
    files holding the same key, or a file the index does not name that holds a key the
    index maps elsewhere (an index beside a stray single-file checkpoint), is a
    :class:`CheckpointError` naming both files.
    """
    files = sorted(folder.glob("*.safetensors"))
    out: dict[str, Path] = {}
    if (folder / INDEX).is_file():
        weight_map = read_json(folder, INDEX).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise CheckpointError(f"{folder / INDEX}: no weight_map of tensor name -> file name")
        for key, name in weight_map.items():
            file = folder / name
            if file.parent != folder:
                raise CheckpointError(f"{folder / INDEX}: {key!r} maps to {name!r}, outside "
                                      "the checkpoint folder")
            out[key] = file
        named = set(out.values())
        for file in files:
            if file in named:
                continue
            with _open(file) as f:
                both = sorted(k for k in f.keys() if k in out)  # noqa: SIM118 (not a dict)
            if both:
                raise CheckpointError(
                    f"{folder}: ambiguous checkpoint: {file.name} and {INDEX} (via "
                    f"{out[both[0]].name}) both give {_listing(both)}", parameter=both[0])
        return out
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files and no {INDEX}")
    for file in files:
        with _open(file) as f:
            for key in f.keys():  # noqa: SIM118 (not a dict)
                if key in out:
                    raise CheckpointError(
                        f"{folder}: ambiguous checkpoint: {out[key].name} and {file.name} both "
                        f"hold {key!r}", parameter=key)
                out[key] = file
    return out


def _open(file: Path) -> Any:
    try:
        return safe_open(file, framework="pt")
    except Exception as e:  # safetensors raises its own error types and OSError
        raise CheckpointError(f"{file}: cannot open as safetensors ({e})") from None


def _listing(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def load_safetensors(module: nn.Module, folder: str | Path,
                     prefixes: Mapping[str, str | None]) -> None:
    """Copy the checkpoint's tensors into ``module``'s parameters and buffers by name.

    ``prefixes`` maps a checkpoint key prefix to the module's name prefix (e.g.
    ``{"model.visual.": "visual."}``); keys under no prefix are not read, nor are keys whose
    longest matching prefix maps to ``None`` (tensors a checkpoint may carry that the module
    recomputes, such as a saved positional table). Every check runs before any tensor is
    copied. Floating-point values are cast to each parameter's dtype; a non-floating tensor
    for a floating-point parameter is an error, not a cast.

    Raises:
        CheckpointError: a parameter the checkpoint lacks, a tensor whose shape differs from
            its parameter's, a checkpoint tensor under the prefixes that the module has no
            parameter for, or an unreadable folder; the message names the parameters.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a checkpoint folder")
    wanted: dict[str, tuple[str, Path]] = {}
    for key, file in _key_files(folder).items():
        for prefix in sorted(prefixes, key=len, reverse=True):
            if key.startswith(prefix):
                if prefixes[prefix] is None:
                    break
                name = prefixes[prefix] + key[len(prefix):]
                if name in wanted:
                    raise CheckpointError(
                        f"{folder}: both {wanted[name][0]!r} and {key!r} give {name!r}",
                        parameter=name)
                wanted[name] = (key, file)
                break
    params = module.state_dict()
    missing = [n for n in params if n not in wanted]
    unexpected = sorted(n for n in wanted if n not in params)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {_listing(missing)}")
        if unexpected:
            parts.append(f"unexpected {_listing([wanted[n][0] for n in unexpected])}")
        raise CheckpointError(f"{folder}: " + "; ".join(parts),
                              parameter=(missing or unexpected)[0])

    by_file: dict[Path, list[str]] = {}
    for name, (_, file) in wanted.items():
        by_file.setdefault(file, []).append(name)
    with ExitStack() as stack:
        handles = {}
        for file, names in by_file.items():
            if not file.is_file():
                raise CheckpointError(f"{file}: no such file (named by {INDEX})",
                                      parameter=names[0])
            handles[file] = f = stack.enter_context(_open(file))
            for name in names:
                key = wanted[name][0]
                tensor = f.get_slice(key)
                shape = tuple(tensor.get_shape())
                if shape != tuple(params[name].shape):
                    raise CheckpointError(
                        f"{folder}: {key!r} has shape {list(shape)} but parameter {name!r} "
                        f"has {list(params[name].shape)}", parameter=name)
                stored = tensor.get_dtype()
                if params[name].is_floating_point() and stored not in _FLOATING:
                    # Casting integers or booleans to weights would load garbage silently.
                    raise CheckpointError(
                        f"{file}: {key!r} is stored as {stored}, not floating point, but "
                        f"parameter {name!r} is {params[name].dtype}", parameter=name)
        with torch.no_grad():
            for file, names in by_file.items():
                for name in names:
                    params[name].copy_(handles[file].get_tensor(wanted[name][0]))
