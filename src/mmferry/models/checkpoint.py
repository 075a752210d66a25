"""Load a module's parameters by name from a local safetensors checkpoint folder.

A folder holds ``config.json`` and either ``model.safetensors.index.json`` (sharded: its
``weight_map`` names each tensor's file) or one or more ``*.safetensors`` files. Only the
tensors under the given key prefixes are read (an encoder never touches the language model's
weights), lazily, one file at a time.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from mmferry.errors import CheckpointError

__all__ = ["CheckpointError", "load_safetensors", "read_json"]

INDEX = "model.safetensors.index.json"


def read_json(folder: str | Path, name: str) -> dict[str, Any]:
    """``folder/name`` parsed; a missing or malformed file is a :class:`CheckpointError`."""
    path = Path(folder) / name
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read JSON ({e})") from None


def _key_files(folder: Path) -> dict[str, Path]:
    """Every tensor key in the checkpoint and the file that holds it."""
    if (folder / INDEX).is_file():
        weight_map = read_json(folder, INDEX).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{folder / INDEX}: no weight_map")
        return {key: folder / file for key, file in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files and no {INDEX}")
    out: dict[str, Path] = {}
    for file in files:
        with _open(file) as f:
            out.update(dict.fromkeys(f.keys(), file))
    return out


def _open(file: Path) -> Any:
    try:
        return safe_open(file, framework="pt")
    except Exception as e:  # safetensors raises its own error types and OSError
        raise CheckpointError(f"{file}: cannot open as safetensors ({e})") from None


def _listing(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def load_safetensors(module: nn.Module, folder: str | Path, prefixes: Mapping[str, str],
                     ignore: Collection[str] = ()) -> None:
    """Copy the checkpoint's tensors into ``module``'s parameters and buffers by name.

    ``prefixes`` maps a checkpoint key prefix to the module's name prefix (e.g.
    ``{"model.visual.": "visual."}``); keys under no prefix are not read, nor are keys
    under an ``ignore`` prefix (tensors a checkpoint may carry that the module recomputes,
    such as a saved positional table). Every check runs before any tensor is copied.
    Values are cast to each parameter's dtype.

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
        if any(key.startswith(p) for p in ignore):
            continue
        for prefix in sorted(prefixes, key=len, reverse=True):
            if key.startswith(prefix):
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
                shape = tuple(f.get_slice(key).get_shape())
                if shape != tuple(params[name].shape):
                    raise CheckpointError(
                        f"{folder}: {key!r} has shape {list(shape)} but parameter {name!r} "
                        f"has {list(params[name].shape)}", parameter=name)
        with torch.no_grad():
            for file, names in by_file.items():
                for name in names:
                    params[name].copy_(handles[file].get_tensor(wanted[name][0]))
