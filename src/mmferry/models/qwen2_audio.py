"""Qwen2-Audio: its Whisper features, field contract and audio encoder.

The processor is transformers' ``Qwen2AudioProcessor`` feature path (``WhisperFeatureExtractor``
with 128 mel bins, every clip padded or truncated to 30 s, and its frame mask). The encoder
is ``Qwen2AudioEncoder`` (Whisper-large-v3's encoder with a 2x average pool) and the
projector into the language model, under the public checkpoint's names ``audio_tower.`` and
``multi_modal_projector.``.

Placement: vLLM 0.33 derives each clip's lengths from ``feature_attention_mask`` on the
device, indexes the device features with the resulting boolean mask (``nonzero``: a sync) and
splits by ``.tolist()`` of device lengths (another). Here each clip's valid mel-frame count
travels as its own host field, ``audio_feature_lengths`` (vLLM's name for the same number in
Qwen2.5-Omni); the encoder reads it as host ints, runs only the positions those lengths need,
and trims each clip with a plain slice. The one tensor derived from it that meets a kernel, the
attention key mask, is uploaded once. ``feature_attention_mask`` is kept for vLLM parity and
placed on the host: the encoder never reads it, so copying it to the device would be waste.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from mmferry.errors import ArgumentError, ContractError
from mmferry.fields import FieldSpec
from mmferry.media import load_audios
from mmferry.models.whisper import (
    AudioEncoder,
    EncoderConfig,
    FeatureConfig,
    check_features_fit,
    dummy_clip,
    encoder_lengths,
    features_from_folder,
    log_mel,
)
from mmferry.transfer import upload

__all__ = ["TINY", "Qwen2Audio", "Qwen2AudioConfig", "output_tokens"]

FEATURES = FeatureConfig(feature_size=128)
_FIELDS = ("input_features", "feature_attention_mask", "audio_feature_lengths")


def output_tokens(mel_frames: int) -> int:
    """Embeddings of a clip with ``mel_frames`` valid frames: the stride-2 convolution, then
    the 2x average pool (``(L - 1) // 2 + 1``, then ``(f - 2) // 2 + 1``)."""
    return (encoder_lengths(mel_frames) - 2) // 2 + 1


@dataclass(frozen=True, slots=True)
class Qwen2AudioConfig:
    """The encoder's part of a Qwen2-Audio ``config.json``; defaults are Qwen2-Audio-7B's."""

    audio: EncoderConfig = field(default_factory=EncoderConfig)
    text_hidden_size: int = 4096  # the projector's output, the language model's width

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> Qwen2AudioConfig:
        """Read a checkpoint's ``config.json`` content.

        Raises:
            ArgumentError: another model type, or a bad size (names the key).
        """
        if config.get("model_type", "qwen2_audio") != "qwen2_audio":
            raise ArgumentError(f"config is for model_type {config['model_type']!r}, not "
                                "'qwen2_audio'", argument="config")
        audio = config.get("audio_config")
        if not isinstance(audio, Mapping):
            raise ArgumentError("needs an audio_config mapping", argument="audio_config")
        hidden = (config.get("text_config") or {}).get("hidden_size", 4096)
        if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden <= 0:
            raise ArgumentError(f"must be a positive int, got {hidden!r}",
                                argument="text_config.hidden_size")
        return cls(EncoderConfig.from_dict(audio), hidden)


TINY = Qwen2AudioConfig(EncoderConfig(num_mel_bins=128, d_model=32, encoder_layers=2,
                                      encoder_attention_heads=2, encoder_ffn_dim=64), 48)


class Projector(nn.Module):
    def __init__(self, audio_hidden: int, text_hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(audio_hidden, text_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def _lengths(name: str, value: Any) -> list[int]:
    if isinstance(value, torch.Tensor | np.ndarray):
        if value.ndim > 1 or (isinstance(value, torch.Tensor) and value.is_floating_point()):
            raise ContractError(f"expected integer lengths, one per clip, got "
                                f"{list(value.shape)} {value.dtype}", field=name)
        return [int(v) for v in value.reshape(-1).tolist()]
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


class Qwen2Audio(nn.Module):
    """Qwen2-Audio's audio encoder as the runtime drives it (see
    :class:`mmferry.encoder.model.EncoderModel`). Build with :func:`mmferry.models.load`."""

    name = "qwen2-audio"
    modalities = ("audio",)
    precomputed_fields = frozenset()
    # The public layout, and the one transformers >= 5 uses in memory.
    checkpoint_prefixes: ClassVar[Mapping[str, str]] = MappingProxyType({
        "audio_tower.": "audio_tower.", "model.audio_tower.": "audio_tower.",
        "multi_modal_projector.": "multi_modal_projector.",
        "model.multi_modal_projector.": "multi_modal_projector.",
    })

    def __init__(self, config: Qwen2AudioConfig = TINY, features: FeatureConfig = FEATURES) -> None:
        super().__init__()
        check_features_fit(features, config.audio)
        self.config = config
        self.features = features
        self.hidden_size = config.text_hidden_size
        self.audio_tower = AudioEncoder(config.audio)
        self.multi_modal_projector = Projector(config.audio.d_model, config.text_hidden_size)

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None, folder: Path | None = None) -> Qwen2Audio:
        """The tiny encoder (``config=None``) or the one a ``config.json`` describes; a
        checkpoint folder's ``preprocessor_config.json`` sets the features."""
        cfg = TINY if config is None else Qwen2AudioConfig.from_dict(config)
        return cls(cfg, features_from_folder(folder, FEATURES))

    def processor(self, *, images: Any = None, videos: Any = None, audios: Any = None,
                  **kwargs: Any) -> dict[str, torch.Tensor]:
        """Clips to ``input_features`` float32 ``[n, mel bins, 3000]`` (each clip padded or
        truncated to 30 s), ``feature_attention_mask`` int32 ``[n, 3000]`` and
        ``audio_feature_lengths`` int64 ``[n]`` (valid frames per clip).

        ``audios``: one clip or a list, each anything :func:`mmferry.media.load_audio` takes
        (a path, bytes, a file object, a 1-D array at 16 kHz, an ``(array, rate)`` pair).

        Raises:
            MediaError: a clip that cannot be decoded, breaks a limit, or is too short to give
                one embedding; names the file or ``item N``.
            ArgumentError: images, videos, or any option.
        """
        if kwargs:
            raise ArgumentError(f"unknown processor option(s) {sorted(kwargs)}; qwen2-audio "
                                "takes none", argument=sorted(kwargs)[0])
        for arg, value in (("images", images), ("videos", videos)):
            if value is not None:
                raise ArgumentError("qwen2-audio takes audio only", argument=arg)
        # Three valid mel frames give the first embedding.
        clips = load_audios(audios, self.features.sampling_rate,
                            min_samples=2 * self.features.hop_length + 1)
        if not clips:
            return {}
        features, mask = log_mel(clips, self.features)
        lengths = mask.sum(-1, dtype=torch.int64)
        return {"input_features": features, "feature_attention_mask": mask,
                "audio_feature_lengths": lengths}

    def field_specs(self, outputs: Mapping[str, Any]) -> dict[str, FieldSpec]:
        """One row of each field per clip; only the features go to the device."""
        present = [k for k in _FIELDS if outputs.get(k) is not None]
        if present and "audio_feature_lengths" not in present:
            raise ContractError("audio_feature_lengths is needed to count each clip's tokens",
                                field="audio_feature_lengths")
        placements = {"input_features": "device", "feature_attention_mask": "host",
                      "audio_feature_lengths": "host"}
        return {k: FieldSpec.batched("audio", placement=placements[k]) for k in present}

    def check_item(self, item: Mapping[str, Any]) -> None:
        """Features ``[mel bins, 3000]`` floating point; a length in 1..3000 that gives at
        least one token; a mask (when present) of that many ones."""
        unknown = set(item) - set(_FIELDS)
        if unknown:
            raise ContractError("not a qwen2-audio field", field=sorted(unknown)[0])
        for name in ("input_features", "audio_feature_lengths"):
            if name not in item:
                raise ContractError("missing from the item", field=name)
        frames = self.features.nb_max_frames
        features = item["input_features"]
        if (not isinstance(features, torch.Tensor) or not features.is_floating_point()
                or tuple(features.shape) != (self.config.audio.num_mel_bins, frames)):
            raise ContractError(f"expected floating point [{self.config.audio.num_mel_bins}, {frames}]"
                                f", got {getattr(features, 'shape', type(features).__name__)}",
                                field="input_features")
        (length,) = _lengths("audio_feature_lengths", item["audio_feature_lengths"])
        if not 1 <= length <= frames or output_tokens(length) < 1:
            raise ContractError(f"{length} valid frames: expected 3..{frames}",
                                field="audio_feature_lengths")
        mask = item.get("feature_attention_mask")
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != (frames,)
                                 or int(mask.sum()) != length):
            raise ContractError(f"expected [{frames}] with {length} ones (audio_feature_lengths)",
                                field="feature_attention_mask")

    def tokens_per_item(self, item: Mapping[str, Any]) -> int:
        """``((L - 1) // 2 + 1 - 2) // 2 + 1`` for L valid mel frames (the host field)."""
        if "audio_feature_lengths" not in item:
            raise ContractError("an item needs audio_feature_lengths to count its tokens",
                                field="audio_feature_lengths")
        (length,) = _lengths("audio_feature_lengths", item["audio_feature_lengths"])
        return output_tokens(length)

    def encode(self, **batch: Any) -> torch.Tensor:
        """A batch of clips to ``[Σ tokens, hidden_size]``.

        Runs the positions the longest clip has (not always all 1500), masks each clip's
        keys past its own length as transformers' attention mask does, and keeps each clip's
        first ``tokens`` rows by slicing with host ints.
        """
        unknown = set(batch) - set(_FIELDS)
        if unknown:
            raise ContractError("not a qwen2-audio field", field=sorted(unknown)[0])
        for name in ("input_features", "audio_feature_lengths"):
            if name not in batch:
                raise ContractError("missing from the batch", field=name)
        features = batch["input_features"]
        lengths = _lengths("audio_feature_lengths", batch["audio_feature_lengths"])
        mels, frames = self.config.audio.num_mel_bins, 2 * self.config.audio.max_source_positions
        if features.ndim != 3 or tuple(features.shape[1:]) != (mels, frames) \
                or features.shape[0] != len(lengths):
            raise ContractError(f"expected [{len(lengths)}, {mels}, {frames}] (one row per "
                                f"length), got {list(features.shape)}", field="input_features")
        if any(not 1 <= n <= frames for n in lengths):
            raise ContractError(f"lengths {lengths} outside 1..{frames}", field="audio_feature_lengths")
        keys = [encoder_lengths(n) for n in lengths]
        tokens = [output_tokens(n) for n in lengths]
        # Every valid position is a key some kept token attends to, so the run covers the
        # longest clip's, rounded up to the pool's pairs; the rest are padding (as in the
        # reference's full 1500) that no key mask lets through.
        positions = -(-max(keys, default=0) // 2) * 2
        weight = self.multi_modal_projector.linear.weight
        if positions == 0:
            return torch.empty(0, self.hidden_size, dtype=weight.dtype, device=weight.device)
        key_mask = None
        if min(keys) < positions:
            visible = torch.arange(positions)[None, :] < torch.tensor(keys)[:, None]
            key_mask = upload(visible[:, None, None, :], features.device)
        hidden = self.audio_tower(features, positions, key_mask, pool=2)
        embeds = self.multi_modal_projector(hidden)
        return torch.cat([embeds[i, :n] for i, n in enumerate(tokens)])

    def dummy_inputs(self) -> dict[str, torch.Tensor]:
        """Processor output for two speech-like clips of different lengths (1.3 s, 2.9 s; the
        second with an odd number of encoder positions, so the padded pair is exercised)."""
        return self.processor(audios=[dummy_clip(1.3, 1), dummy_clip(2.9, 2)])
