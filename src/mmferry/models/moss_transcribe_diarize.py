"""MOSS-Transcribe-Diarize: its chunked Whisper features, field contract and audio encoder.

The processor is transformers' ``MossTranscribeDiarizeFeatureExtractor``: each clip is cut
into consecutive 30 s chunks, each chunk padded to 30 s and turned into a Whisper log-mel.
The fields are vLLM 0.33's: ``input_features`` (one row per chunk), ``audio_feature_lengths``
(per chunk, its merged-token count), ``audio_chunk_counts`` and ``audio_token_lengths`` (per
clip). The encoder is the Whisper-medium encoder run on every chunk in full (no attention
mask, as the model was trained), each chunk cut to its tokens × ``audio_merge_size`` frames,
groups of ``audio_merge_size`` frames concatenated, and the adaptor (Linear, SiLU, Linear,
LayerNorm) into the language model. Parameters are named as transformers >= 5 saves them;
the original layout (``model.whisper_encoder.``, ``model.vq_adaptor.layers.N.``) loads too.

Placement: the three length fields stay on the host. vLLM 0.33 uploads
``audio_feature_lengths`` with a blocking ``.to(device)`` and reads it back with ``.item()``
per chunk; here the encoder reads all three as host ints and uploads nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
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

__all__ = ["TINY", "MossConfig", "MossTranscribeDiarize", "chunk_tokens"]

FEATURES = FeatureConfig(feature_size=80)
_FIELDS = ("input_features", "audio_feature_lengths", "audio_chunk_counts", "audio_token_lengths")
_PER_CHUNK = ("input_features", "audio_feature_lengths")


def chunk_tokens(mel_frames: int, merge: int) -> int:
    """Tokens of a chunk with ``mel_frames`` valid frames: encoder positions rounded up to
    whole groups of ``merge``."""
    return -(-encoder_lengths(mel_frames) // merge)


@dataclass(frozen=True, slots=True)
class MossConfig:
    """The encoder's part of a MOSS-Transcribe-Diarize ``config.json``; defaults are the
    published model's (Whisper-medium encoder, Qwen3-0.6B width)."""

    audio: EncoderConfig = field(default_factory=lambda: EncoderConfig(
        num_mel_bins=80, d_model=1024, encoder_layers=24, encoder_attention_heads=16,
        encoder_ffn_dim=4096))
    audio_merge_size: int = 4
    text_hidden_size: int = 1024
    norm_eps: float = 1e-6  # the adaptor's LayerNorm takes the text model's rms_norm_eps
    projector_hidden_act: str = "silu"
    projector_bias: bool = True

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> MossConfig:
        """Read a checkpoint's ``config.json`` content.

        Raises:
            ArgumentError: another model type, or a bad value (names the key).
        """
        if config.get("model_type", "moss_transcribe_diarize") != "moss_transcribe_diarize":
            raise ArgumentError(f"config is for model_type {config['model_type']!r}, not "
                                "'moss_transcribe_diarize'", argument="config")
        audio = config.get("audio_config")
        if not isinstance(audio, Mapping):
            raise ArgumentError("needs an audio_config mapping", argument="audio_config")
        text = config.get("text_config") or {}
        base = cls()
        values = {"audio_merge_size": config.get("audio_merge_size", base.audio_merge_size),
                  "text_hidden_size": text.get("hidden_size", base.text_hidden_size)}
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ArgumentError(f"must be a positive int, got {value!r}",
                                    argument=key if key == "audio_merge_size" else "text_config.hidden_size")
        eps = text.get("rms_norm_eps", base.norm_eps)
        if isinstance(eps, bool) or not isinstance(eps, int | float) or eps <= 0:
            raise ArgumentError(f"must be a positive float, got {eps!r}",
                                argument="text_config.rms_norm_eps")
        act = config.get("projector_hidden_act", base.projector_hidden_act)
        if act not in _ACTIVATIONS:
            raise ArgumentError(f"unsupported {act!r}; supported: {sorted(_ACTIVATIONS)}",
                                argument="projector_hidden_act")
        bias = config.get("projector_bias", True)
        if not isinstance(bias, bool):
            raise ArgumentError(f"must be a bool, got {bias!r}", argument="projector_bias")
        encoder = EncoderConfig.from_dict({"num_mel_bins": 80, **audio})
        if encoder.max_source_positions % values["audio_merge_size"]:
            raise ArgumentError(f"max_source_positions {encoder.max_source_positions} is not a "
                                f"multiple of audio_merge_size", argument="audio_merge_size")
        return cls(encoder, values["audio_merge_size"], values["text_hidden_size"], float(eps),
                   act, bias)


TINY = MossConfig(EncoderConfig(num_mel_bins=80, d_model=32, encoder_layers=2,
                                encoder_attention_heads=2, encoder_ffn_dim=64), 4, 48)

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


class Projector(nn.Module):
    """The adaptor: merged frames → Linear → activation → Linear → LayerNorm."""

    def __init__(self, cfg: MossConfig) -> None:
        super().__init__()
        merged = cfg.audio.d_model * cfg.audio_merge_size
        self.linear_1 = nn.Linear(merged, cfg.text_hidden_size, bias=cfg.projector_bias)
        self.linear_2 = nn.Linear(cfg.text_hidden_size, cfg.text_hidden_size, bias=cfg.projector_bias)
        self.norm = nn.LayerNorm(cfg.text_hidden_size, eps=cfg.norm_eps)
        self.act = _ACTIVATIONS[cfg.projector_hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear_2(self.act(self.linear_1(x))))


def _ints(name: str, value: Any) -> list[int]:
    if isinstance(value, torch.Tensor | np.ndarray):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            raise ContractError(f"expected integers, got {value.dtype}", field=name)
        return [int(v) for v in value.reshape(-1).tolist()]
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


class MossTranscribeDiarize(nn.Module):
    """MOSS-Transcribe-Diarize's audio encoder as the runtime drives it (see
    :class:`mmferry.encoder.model.EncoderModel`). Build with :func:`mmferry.models.load`."""

    name = "moss-transcribe-diarize"
    modalities = ("audio",)
    precomputed_fields = frozenset()
    # transformers >= 5's layout, and the original one vLLM reads (its adaptor is a
    # Sequential: 0 Linear, 1 SiLU, 2 Linear, 3 LayerNorm).
    checkpoint_prefixes: ClassVar[Mapping[str, str]] = MappingProxyType({
        "model.audio_tower.": "audio_tower.",
        "model.multi_modal_projector.": "multi_modal_projector.",
        "model.whisper_encoder.": "audio_tower.",
        "model.vq_adaptor.layers.0.": "multi_modal_projector.linear_1.",
        "model.vq_adaptor.layers.2.": "multi_modal_projector.linear_2.",
        "model.vq_adaptor.layers.3.": "multi_modal_projector.norm.",
    })

    def __init__(self, config: MossConfig = TINY, features: FeatureConfig = FEATURES) -> None:
        super().__init__()
        check_features_fit(features, config.audio)
        self.config = config
        self.features = features
        self.hidden_size = config.text_hidden_size
        self.audio_tower = AudioEncoder(config.audio)
        self.multi_modal_projector = Projector(config)

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None,
                    folder: Path | None = None) -> MossTranscribeDiarize:
        """The tiny encoder (``config=None``) or the one a ``config.json`` describes; a
        checkpoint folder's ``preprocessor_config.json`` sets the features and the chunk."""
        cfg = TINY if config is None else MossConfig.from_dict(config)
        return cls(cfg, features_from_folder(folder, FEATURES))

    @property
    def _max_chunk_tokens(self) -> int:
        return self.config.audio.max_source_positions // self.config.audio_merge_size

    def processor(self, *, images: Any = None, videos: Any = None, audios: Any = None,
                  **kwargs: Any) -> dict[str, torch.Tensor]:
        """Clips to ``input_features`` float32 ``[chunks, mel bins, 3000]`` (30 s chunks),
        ``audio_feature_lengths`` int64 ``[chunks]`` (each chunk's tokens),
        ``audio_chunk_counts`` and ``audio_token_lengths`` int64 ``[clips]``.

        ``audios``: one clip or a list, each anything :func:`mmferry.media.load_audio` takes.

        Raises:
            MediaError: a clip that cannot be decoded or breaks a limit; names the file or
                ``item N``.
            ArgumentError: images, videos, or any option.
        """
        if kwargs:
            raise ArgumentError(f"unknown processor option(s) {sorted(kwargs)}; "
                                "moss-transcribe-diarize takes none", argument=sorted(kwargs)[0])
        for arg, value in (("images", images), ("videos", videos)):
            if value is not None:
                raise ArgumentError("moss-transcribe-diarize takes audio only", argument=arg)
        clips = load_audios(audios, self.features.sampling_rate)
        if not clips:
            return {}
        window = self.features.n_samples
        chunks: list[np.ndarray] = []
        counts = []
        for clip in clips:
            starts = range(0, len(clip), window)
            chunks.extend(clip[s:s + window] for s in starts)
            counts.append(len(starts))
        features, mask = log_mel(chunks, self.features)
        merge = self.config.audio_merge_size
        tokens = torch.tensor([chunk_tokens(n, merge) for n in mask.sum(-1).tolist()])
        per_clip = torch.split(tokens, counts)
        return {"input_features": features, "audio_feature_lengths": tokens,
                "audio_chunk_counts": torch.tensor(counts),
                "audio_token_lengths": torch.stack([t.sum() for t in per_clip])}

    def field_specs(self, outputs: Mapping[str, Any]) -> dict[str, FieldSpec]:
        """Chunk fields split by ``audio_chunk_counts``; all but the features on the host."""
        present = [k for k in _FIELDS if outputs.get(k) is not None]
        if not present:
            return {}
        if "audio_chunk_counts" not in present:
            raise ContractError("audio_chunk_counts is needed to split the chunks",
                                field="audio_chunk_counts")
        counts = outputs["audio_chunk_counts"]
        specs = {}
        for k in present:
            placement = "device" if k == "input_features" else "host"
            specs[k] = (FieldSpec.flat_from_sizes("audio", counts, placement=placement)
                        if k in _PER_CHUNK else FieldSpec.batched("audio", placement=placement))
        return specs

    def check_item(self, item: Mapping[str, Any]) -> None:
        """``audio_chunk_counts`` chunks of features ``[mel bins, 3000]`` and of token counts
        in 1..375; ``audio_token_lengths`` their sum."""
        unknown = set(item) - set(_FIELDS)
        if unknown:
            raise ContractError("not a moss-transcribe-diarize field", field=sorted(unknown)[0])
        for name in _FIELDS:
            if name not in item:
                raise ContractError("missing from the item", field=name)
        (count,) = _ints("audio_chunk_counts", item["audio_chunk_counts"])
        lengths = _ints("audio_feature_lengths", item["audio_feature_lengths"])
        features = item["input_features"]
        shape = (count, self.config.audio.num_mel_bins, self.features.nb_max_frames)
        if (not isinstance(features, torch.Tensor) or not features.is_floating_point()
                or tuple(features.shape) != shape):
            raise ContractError(f"expected floating point {list(shape)} from audio_chunk_counts, "
                                f"got {getattr(features, 'shape', type(features).__name__)}",
                                field="input_features")
        if len(lengths) != count or not all(1 <= n <= self._max_chunk_tokens for n in lengths):
            raise ContractError(f"expected {count} chunk token counts in 1..{self._max_chunk_tokens}"
                                f", got {lengths}", field="audio_feature_lengths")
        (total,) = _ints("audio_token_lengths", item["audio_token_lengths"])
        if total != sum(lengths):
            raise ContractError(f"{total} is not the sum of the chunks' {lengths}",
                                field="audio_token_lengths")

    def tokens_per_item(self, item: Mapping[str, Any]) -> int:
        """The clip's ``audio_token_lengths`` (host): Σ over its chunks of
        ⌈((L - 1) // 2 + 1) / merge⌉."""
        if "audio_token_lengths" not in item:
            raise ContractError("an item needs audio_token_lengths to count its tokens",
                                field="audio_token_lengths")
        (total,) = _ints("audio_token_lengths", item["audio_token_lengths"])
        return total

    def encode(self, **batch: Any) -> torch.Tensor:
        """A batch of clips (their chunks) to ``[Σ tokens, hidden_size]``. Every chunk runs the
        full 1500 positions; the three length fields are read on the host."""
        unknown = set(batch) - set(_FIELDS)
        if unknown:
            raise ContractError("not a moss-transcribe-diarize field", field=sorted(unknown)[0])
        for name in _FIELDS:
            if name not in batch:
                raise ContractError("missing from the batch", field=name)
        features = batch["input_features"]
        lengths = _ints("audio_feature_lengths", batch["audio_feature_lengths"])
        counts = _ints("audio_chunk_counts", batch["audio_chunk_counts"])
        totals = _ints("audio_token_lengths", batch["audio_token_lengths"])
        audio = self.config.audio
        shape = (sum(counts), audio.num_mel_bins, 2 * audio.max_source_positions)
        if tuple(features.shape) != shape or len(lengths) != shape[0]:
            raise ContractError(f"expected {list(shape)} from audio_chunk_counts {counts} and one "
                                f"token count per chunk ({len(lengths)}), got "
                                f"{list(features.shape)}", field="input_features")
        if any(not 1 <= n <= self._max_chunk_tokens for n in lengths):
            raise ContractError(f"chunk token counts {lengths} outside 1..{self._max_chunk_tokens}",
                                field="audio_feature_lengths")
        bounds = np.cumsum([0, *counts]).tolist()
        if totals != [sum(lengths[a:b]) for a, b in pairwise(bounds)]:
            raise ContractError(f"{totals} are not the per-clip sums of {lengths}",
                                field="audio_token_lengths")
        merge = self.config.audio_merge_size
        weight = self.multi_modal_projector.linear_1.weight
        if not lengths:
            return torch.empty(0, self.hidden_size, dtype=weight.dtype, device=weight.device)
        kept = self.audio_tower.first_rows(features, [n * merge for n in lengths])
        return self.multi_modal_projector(kept.reshape(-1, merge * audio.d_model))

    def dummy_inputs(self) -> dict[str, torch.Tensor]:
        """Processor output for two speech-like clips: 2.1 s, and one a little over a chunk
        (so one clip has two chunks, the second short)."""
        chunk = self.features.chunk_length
        return self.processor(audios=[dummy_clip(2.1, 3), dummy_clip(chunk + 1.7, 4)])
