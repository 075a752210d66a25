"""The reference encoder models, by name: :func:`names`, :func:`load`, :func:`model_class`.

A model is one module of this package; registering it is one line of ``_REGISTRY``
(name -> ``module:Class``). The class follows :class:`mmferry.encoder.model.ModelClass` (how
to build it) and its instances :class:`mmferry.encoder.model.EncoderModel`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmferry.encoder.model import EncoderModel, ModelClass
from mmferry.errors import ArgumentError, CheckpointError
from mmferry.models.checkpoint import load_safetensors, read_json

__all__ = ["CheckpointError", "load", "model_class", "names"]

_REGISTRY: dict[str, str] = {
    "qwen2-vl": "mmferry.models.qwen2_vl:Qwen2VL",
    "minicpm-v-4.6": "mmferry.models.minicpm_v4_6:MiniCPMV46",
    "llava-onevision2": "mmferry.models.llava_onevision2:LlavaOnevision2",
    "ernie4.5-vl": "mmferry.models.ernie4_5_vl:Ernie45VL",
    "isaac": "mmferry.models.isaac:IsaacModel",
    "qwen2-audio": "mmferry.models.qwen2_audio:Qwen2Audio",
    "firered-lid": "mmferry.models.firered_lid:FireRedLID",
    "moss-transcribe-diarize": "mmferry.models.moss_transcribe_diarize:MossTranscribeDiarize",
}
SEED = 0


def names() -> list[str]:
    """The model names :func:`load` accepts."""
    return list(_REGISTRY)


def model_class(name: str) -> ModelClass:
    """The class behind model ``name`` (imported on first use).

    Raises:
        ArgumentError: an unknown name; the message lists the known ones.
    """
    target = _REGISTRY.get(name)
    if target is None:
        raise ArgumentError(f"unknown model {name!r}; available: {', '.join(_REGISTRY)}",
                            argument="model")
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def _dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ArgumentError(f"not a floating-point torch dtype: {dtype!r}", argument="dtype")
    return value


def init_random(module: nn.Module, seed: int = SEED) -> None:
    """Deterministic weights: matrices ~ N(0, 0.02), vectors named ``weight`` (norm scales)
    one, everything else (biases) zero; drawn in name order from one seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.state_dict().items():
            if not p.is_floating_point():
                continue
            if p.ndim >= 2:
                p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen))
            elif name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.zero_()


def load(name: str, weights: str | Path | None = None, config: str | Mapping[str, Any] = "tiny",
         *, dtype: torch.dtype | str | None = None, materialize: bool = True) -> EncoderModel:
    """Build model ``name`` on the CPU, in eval mode, with ``dtype`` weights (float32 default).

    ``weights``: a local checkpoint folder; its ``config.json`` gives the architecture, its
    processor files (``preprocessor_config.json``) the processor, and its safetensors files
    (sharded or not) the weights, of which only the encoder's are read. ``config``:
    ``"tiny"`` (a small architecture built in code) or a checkpoint's ``config.json`` content
    as a dict, for a model of that size with random weights. Random weights are seeded, so
    two loads give the same model. ``materialize=False`` leaves the parameters on ``meta``
    and reads no weights: the processor, ``field_specs`` and ``tokens_per_item`` work, the
    encoder does not (what a render server needs).

    Raises:
        ArgumentError: an unknown name (the message lists the known ones), a bad dtype, a
            bad config value (naming the key), or both ``weights`` and a ``config`` dict.
        CheckpointError: a checkpoint that does not fit the model (names the parameter).
    """
    cls = model_class(name)
    folder = None if weights is None else Path(weights)
    if folder is not None:
        if not (isinstance(config, str) and config == "tiny"):
            raise ArgumentError("give weights (whose config.json is used) or config, not both",
                                argument="config")
        config = read_json(folder, "config.json")
    elif isinstance(config, str) and config != "tiny":
        raise ArgumentError(f"config must be 'tiny' or a config.json dict, got {config!r}",
                            argument="config")
    elif not isinstance(config, str | Mapping):
        raise ArgumentError(f"config must be 'tiny' or a config.json dict, got "
                            f"{type(config).__name__}", argument="config")
    torch_dtype = _dtype(dtype)
    # Built on `meta` so no storage is allocated or initialised twice; then either the
    # checkpoint's tensors or seeded random ones fill it.
    with torch.device("meta"):
        model = cls.from_config(None if isinstance(config, str) else config, folder)
    if not materialize:
        return model.eval().requires_grad_(False)
    model = model.to_empty(device="cpu").to(torch_dtype)
    if folder is None:
        init_random(model)
    else:
        load_safetensors(model, folder, cls.checkpoint_prefixes)
    return model.eval().requires_grad_(False)
