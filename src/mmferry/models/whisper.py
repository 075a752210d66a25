"""Whisper building blocks shared by the audio models (not a registered model itself).

* :class:`FeatureConfig` and :func:`log_mel`: the log-mel spectrogram of transformers'
  ``WhisperFeatureExtractor`` (its ``padding="max_length"``, truncating, per-clip
  normalisation, and its frame-level attention mask), computed faster.
* :class:`EncoderConfig`, :class:`EncoderLayer`, :class:`AudioEncoder`: the Whisper encoder
  (two convolutions, learned positions, pre-norm layers, final LayerNorm) under the parameter
  names of transformers' Whisper-style encoders (``conv1``, ``layers.N.self_attn.q_proj``, ...).

How the log-mel is fast, in torch rather than numpy (numpy's FFT was 4x slower here on
400-point frames, and torch's runs on the same thread pool as the rest): the STFT is what
``torch.stft`` computes (windowed frames, real FFT) written into per-thread buffers reused
across calls, so a 30 s clip does not fault in ~10 MB of fresh pages each time; the power
spectrum is ``re² + im²`` squared in place on the complex output (``abs() ** 2`` takes a
square root first and is ~40x slower); the mel projection multiplies only the band of FFT
bins each block of 16 filters covers (the filters are triangles a few bins wide, so the dense
``[mels, 201]`` product is mostly zeros); and frames that see only a clip's padding are not
transformed at all: they are the constant log of the floor.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mmferry.errors import ArgumentError
from mmferry.media import samples
from mmferry.models.checkpoint import read_json

__all__ = [
    "AudioEncoder",
    "EncoderConfig",
    "EncoderLayer",
    "FeatureConfig",
    "check_features_fit",
    "dummy_clip",
    "features_from_folder",
    "log_mel",
    "mel_filters",
]

# -- features ----------------------------------------------------------------------------

# transformers builds every Whisper filter bank up to 8 kHz, whatever the sampling rate.
_MEL_MAX_HZ = 8000.0
_LOG_FLOOR = 1e-10


@dataclass(frozen=True, slots=True)
class FeatureConfig:
    """A Whisper feature extractor's settings (``preprocessor_config.json``); defaults are
    transformers' ``WhisperFeatureExtractor``'s."""

    feature_size: int = 80  # mel bins
    sampling_rate: int = 16000
    hop_length: int = 160
    chunk_length: int = 30  # seconds every clip is padded / truncated (or chunked) to
    n_fft: int = 400
    padding_value: float = 0.0

    @property
    def n_samples(self) -> int:
        return self.chunk_length * self.sampling_rate

    @property
    def nb_max_frames(self) -> int:
        return self.n_samples // self.hop_length

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], base: FeatureConfig | None = None) -> FeatureConfig:
        """Read a ``preprocessor_config.json`` (or a processor config holding one under
        ``feature_extractor``); keys it lacks keep ``base``'s values.

        Raises:
            ArgumentError: a value of the wrong type or range, or a nonzero ``dither``
                (random, so not reproducible); names the key.
        """
        config = config.get("feature_extractor", config)
        out = base or cls()
        values = {}
        for f in fields(cls):
            if f.name not in config:
                continue
            value = config[f.name]
            want = float if f.name == "padding_value" else int
            if isinstance(value, bool) or not isinstance(value, int | float) or (
                    want is int and value != int(value)):
                raise ArgumentError(f"must be {want.__name__}, got {value!r}", argument=f.name)
            values[f.name] = want(value)
        out = replace(out, **values)
        for name in ("feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft"):
            if getattr(out, name) <= 0:
                raise ArgumentError(f"must be positive, got {getattr(out, name)}", argument=name)
        if out.n_fft // 2 >= out.n_samples:
            raise ArgumentError(f"n_fft {out.n_fft} is longer than a chunk", argument="n_fft")
        if config.get("dither", 0.0) not in (0, 0.0, None):
            raise ArgumentError("dithering adds random noise; only 0.0 is supported",
                                argument="dither")
        return out


def features_from_folder(folder: Path | None, base: FeatureConfig) -> FeatureConfig:
    """The features a checkpoint folder's processor files set, as ``from_pretrained`` reads
    them: ``preprocessor_config.json``, else the ``feature_extractor`` entry of a combined
    ``processor_config.json``; ``base`` where the folder has neither (or for ``None``)."""
    if folder is None:
        return base
    for name in ("preprocessor_config.json", "processor_config.json"):
        if (folder / name).is_file():
            config = read_json(folder, name)
            if name == "preprocessor_config.json" or "feature_extractor" in config:
                return FeatureConfig.from_dict(config, base)
    return base


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    # Slaney's scale: linear to 1 kHz, logarithmic above.
    mel = 3.0 * hz / 200.0
    log = hz >= 1000.0
    return np.where(log, 15.0 + np.log(np.maximum(hz, 1e-12) / 1000.0) * (27.0 / np.log(6.4)), mel)


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    hz = 200.0 * mel / 3.0
    return np.where(mel >= 15.0, 1000.0 * np.exp((np.log(6.4) / 27.0) * (mel - 15.0)), hz)


@lru_cache(maxsize=16)
def mel_filters(n_mels: int, n_fft: int, sampling_rate: int) -> np.ndarray:
    """Slaney-scale, Slaney-normalised triangular filters from 0 to 8 kHz over the
    ``n_fft // 2 + 1`` FFT bins: float64 ``[bins, n_mels]``, as librosa / transformers."""
    bins = n_fft // 2 + 1
    edges = _mel_to_hz(np.linspace(_hz_to_mel(np.array(0.0)), _hz_to_mel(np.array(_MEL_MAX_HZ)),
                                   n_mels + 2))
    freqs = np.linspace(0, sampling_rate // 2, bins)
    offsets = edges[None, :] - freqs[:, None]
    widths = np.diff(edges)
    rising = -offsets[:, :-2] / widths[:-1]
    falling = offsets[:, 2:] / widths[1:]
    filters = np.maximum(0.0, np.minimum(rising, falling))
    filters *= 2.0 / (edges[2:] - edges[:-2])[None, :]
    filters.setflags(write=False)
    return filters


@dataclass(frozen=True, slots=True)
class _Band:
    """Mel filters ``[first, last)`` read only the interleaved (re, im) columns ``[lo, hi)``."""

    first: int
    last: int
    lo: int
    hi: int
    weight: torch.Tensor  # float32 [last - first, hi - lo]: each bin's weight for re² and im²


@lru_cache(maxsize=16)
def _bands(n_mels: int, n_fft: int, sampling_rate: int, per_band: int = 16) -> tuple[_Band, ...]:
    # The filters are triangles a few bins wide: blocks of `per_band` filters multiply only
    # the bins they cover (a sixth of the dense product for 128 mels).
    filters = mel_filters(n_mels, n_fft, sampling_rate).astype(np.float32)
    interleaved = np.repeat(filters, 2, axis=0)
    out = []
    for first in range(0, n_mels, per_band):
        last = min(n_mels, first + per_band)
        rows = np.flatnonzero(interleaved[:, first:last].any(axis=1))
        lo, hi = (int(rows[0]), int(rows[-1]) + 1) if len(rows) else (0, 1)
        weight = np.ascontiguousarray(interleaved[lo:hi, first:last].T)
        out.append(_Band(first, last, lo, hi, torch.from_numpy(weight)))
    return tuple(out)


@lru_cache(maxsize=4)
def _window(n_fft: int) -> torch.Tensor:
    return torch.hann_window(n_fft)


def _frames_to_compute(length: int, cfg: FeatureConfig) -> int:
    """Frames of a clip of ``length`` samples (padded with zeros to the chunk) that hold any
    signal; the rest see only zeros, so their power is exactly zero."""
    if cfg.padding_value != 0.0:
        return cfg.nb_max_frames
    return min(cfg.nb_max_frames, -(-(length + cfg.n_fft // 2) // cfg.hop_length))


class _Workspace(threading.local):
    """Per-thread scratch tensors for one clip's STFT, reused across calls.

    A 30 s clip's padded signal, windowed frames and mel power are ~7 MB; fresh tensors of
    that size are fresh pages, and on a busy machine their page faults cost as much as the
    FFT. Reuse bounds the memory to one clip's worth per thread (clips are transformed one at
    a time)."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        size = math.prod(shape)
        buf = self.buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < size:
            buf = self.buffers[name] = torch.empty(size, dtype=dtype)
        return buf[:size].view(shape)


_WORK = _Workspace()


def log_mel(waveforms: Sequence[np.ndarray], cfg: FeatureConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Whisper log-mel features of each clip, padded or truncated to one chunk.

    Equals ``WhisperFeatureExtractor(**cfg)(waveforms, sampling_rate=cfg.sampling_rate,
    padding="max_length", truncation=True, return_attention_mask=True)``: returns
    ``input_features`` float32 ``[clips, feature_size, nb_max_frames]`` and the frame-level
    ``attention_mask`` int32 ``[clips, nb_max_frames]`` (1 for frames whose first sample is
    inside the clip).
    """
    n, hop, n_fft, frames = cfg.n_samples, cfg.hop_length, cfg.n_fft, cfg.nb_max_frames
    half, bins = n_fft // 2, n_fft // 2 + 1
    window = _window(n_fft)
    bands = _bands(cfg.feature_size, n_fft, cfg.sampling_rate)
    floor = float(torch.tensor(_LOG_FLOOR, dtype=torch.float32).log10())
    log_spec = torch.empty(len(waveforms), cfg.feature_size, frames)
    mask = torch.zeros(len(waveforms), frames, dtype=torch.int32)
    for row, wave in enumerate(waveforms):
        length = min(len(wave), n)
        todo = _frames_to_compute(length, cfg)
        span = (todo - 1) * hop + n_fft
        # The clip padded to a chunk and reflect-padded as torch.stft(center=True) does, as
        # far as the frames that see the clip reach.
        end = max(span, 2 * half + 1)  # the left reflection reads sample `half`
        signal = _WORK.get("signal", (end,), torch.float32)
        padded = signal.numpy()
        inside = min(length, end - half)  # the last frames may stop short of the chunk
        padded[half:half + inside] = wave[:inside]
        padded[half + inside:min(end, half + n)] = cfg.padding_value
        padded[:half] = padded[2 * half:half:-1]
        if end > half + n:
            right = end - half - n
            padded[half + n:end] = padded[half + n - 2:half + n - 2 - right:-1]
        framed = _WORK.get("frames", (todo, n_fft), torch.float32)
        torch.mul(signal[:span].unfold(0, n_fft, hop), window, out=framed)
        # rfft's own output: with out= it computes into a temporary and copies (30% slower).
        spec = torch.fft.rfft(framed, dim=-1)
        # Per frame, (re, im) of each bin; squared in place, a filter bank holding each weight
        # twice (for re² and im²) gives the mel power with no |.| and no new tensor.
        squares = torch.view_as_real(spec).view(todo, 2 * bins).square_()
        mel = _WORK.get("mel", (cfg.feature_size, todo), torch.float32)
        for band in bands:
            torch.matmul(band.weight, squares[:, band.lo:band.hi].T, out=mel[band.first:band.last])
        out = log_spec[row]
        torch.log10(mel.clamp_(min=_LOG_FLOOR), out=out[:, :todo])
        out[:, todo:] = floor
        out.clamp_(min=out.max() - 8.0)
        mask[row, :-(-length // hop)] = 1
    log_spec.add_(4.0).div_(4.0)
    return log_spec, mask


# -- synthetic speech --------------------------------------------------------------------


@lru_cache(maxsize=8)
def _cached_speech(seconds: float, seed: int) -> np.ndarray:
    clip = samples.speech_like(seconds, 16000, seed)
    clip.setflags(write=False)
    return clip


def dummy_clip(seconds: float, seed: int) -> tuple[np.ndarray, int]:
    """``(speech_like(seconds, 16000, seed), 16000)``, generated once per process: a model's
    ``dummy_inputs`` is called often and the synthesis is the slow part."""
    return _cached_speech(seconds, seed), 16000


# -- encoder -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EncoderConfig:
    """A Whisper-style encoder's size; defaults are Whisper-large's (Qwen2-Audio's)."""

    num_mel_bins: int = 128
    d_model: int = 1280
    encoder_layers: int = 32
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    max_source_positions: int = 1500
    activation_function: str = "gelu"

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], prefix: str = "audio_config") -> EncoderConfig:
        """Read an ``audio_config``: Whisper's names (``d_model``, ``encoder_layers``, ...) or
        the newer ones (``hidden_size``, ``num_hidden_layers``, ...)."""
        aliases = {"hidden_size": "d_model", "num_hidden_layers": "encoder_layers",
                   "num_attention_heads": "encoder_attention_heads",
                   "intermediate_size": "encoder_ffn_dim"}
        values: dict[str, Any] = {}
        for key, value in config.items():
            name = aliases.get(key, key)
            if name in cls.__dataclass_fields__ and (key == name or name not in config):
                values[name] = value
        for name, value in values.items():
            if name == "activation_function":
                if value not in _ACTIVATIONS:
                    raise ArgumentError(f"unsupported activation {value!r}; supported: "
                                        f"{sorted(_ACTIVATIONS)}", argument=f"{prefix}.{name}")
            elif isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ArgumentError(f"must be a positive int, got {value!r}",
                                    argument=f"{prefix}.{name}")
        out = cls(**values)
        if out.d_model % out.encoder_attention_heads:
            raise ArgumentError(f"d_model {out.d_model} does not split into "
                                f"{out.encoder_attention_heads} heads",
                                argument=f"{prefix}.encoder_attention_heads")
        return out


_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu,
                "gelu_new": lambda x: F.gelu(x, approximate="tanh")}


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.scaling = (dim // heads) ** -0.5
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None,
                queries: int | None = None) -> torch.Tensor:
        """Every row of ``x`` is a key; the first ``queries`` rows (all when None) query."""
        b, n, _ = x.shape
        m = n if queries is None else queries
        # The query is scaled before the product, as Whisper does (and its checkpoints expect
        # to the last bit). Heads are made contiguous: the CPU attention kernel runs ~15%
        # faster on them than on strided views, for a copy of a few percent of its time.
        q = (self.q_proj(x[:, :m]) * self.scaling).view(b, m, self.heads, -1).transpose(1, 2).contiguous()
        k = self.k_proj(x).view(b, n, self.heads, -1).transpose(1, 2).contiguous()
        v = self.v_proj(x).view(b, n, self.heads, -1).transpose(1, 2).contiguous()
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, scale=1.0)
        return self.out_proj(o.transpose(1, 2).reshape(b, m, -1))


class EncoderLayer(nn.Module):
    """One pre-norm Whisper encoder layer."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg.d_model, cfg.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, cfg.d_model)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)
        self.act = _ACTIVATIONS[cfg.activation_function]

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None,
                rows: int | None = None) -> torch.Tensor:
        """``rows``: only the first ``rows`` outputs are wanted (all positions stay keys)."""
        attended = self.self_attn(self.self_attn_layer_norm(x), key_mask, rows)
        x = (x if rows is None else x[:, :rows]) + attended
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    """The Whisper encoder: conv (k3) → GELU → conv (k3, stride 2) → GELU → + learned
    positions → layers → final LayerNorm. ``forward`` runs the first ``positions`` output
    positions only: the caller says how many it needs and which keys each row may see."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, cfg.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(cfg.d_model, cfg.d_model, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(cfg.max_source_positions, cfg.d_model)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.layer_norm = nn.LayerNorm(cfg.d_model)

    def embed(self, features: torch.Tensor, positions: int) -> torch.Tensor:
        """``features`` ``[b, mels, frames]`` → ``[b, positions, d]`` before the layers.

        Output position p reads mel frames up to 2p + 2, so the features are cut to the
        frames the first ``positions`` outputs see; the cut keeps the next frame, so the
        convolutions' edges see real frames, not their zero padding, exactly as on the
        whole input.
        """
        frames = features.shape[-1]
        cut = min(frames, 2 * positions + 1)
        x = features[:, :, :cut].to(self.conv1.weight.dtype)
        x = F.gelu(self.conv1(x))
        x = F.gelu(self.conv2(x))[:, :, :positions]
        return x.transpose(1, 2) + self.embed_positions.weight[:positions]

    def forward(self, features: torch.Tensor, positions: int, key_mask: torch.Tensor | None = None,
                pool: int = 1) -> torch.Tensor:
        """``[b, positions // pool, d]``. ``key_mask``: bool ``[b, 1, 1, positions]`` (True:
        attend) or None (every key). ``pool``: average each run of ``pool`` positions before
        the final LayerNorm (Qwen2-Audio's ``AvgPool1d(2, 2)``); ``positions`` a multiple."""
        x = self.embed(features, positions)
        for layer in self.layers:
            x = layer(x, key_mask)
        if pool > 1:
            x = x.unflatten(1, (positions // pool, pool)).mean(dim=2)
        return self.layer_norm(x)


    def first_rows(self, features: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """Every position of each ``[mels, frames]`` row of ``features`` runs through the
        layers with full attention (Whisper's own use: no mask), and the first ``rows[i]``
        outputs of row i come back, concatenated: ``[Σ rows, d]``. The last layer computes
        only the rows wanted (its keys still cover every position): the same numbers as the
        full run, with less of the last layer's work for a chunk that is mostly padding."""
        positions = self.cfg.max_source_positions
        x = self.embed(features, positions)
        *layers, last = self.layers
        for layer in layers:
            x = layer(x)
        if all(n == positions for n in rows):
            x = last(x).flatten(0, 1)
        else:
            x = torch.cat([last(x[i:i + 1], rows=n)[0] for i, n in enumerate(rows)])
        return self.layer_norm(x)


def check_features_fit(features: FeatureConfig, encoder: EncoderConfig) -> None:
    """The features a processor makes must be what the encoder takes: as many mel bins, and
    a chunk of exactly its input length (twice its positions).

    Raises:
        ArgumentError: naming the feature option that does not fit.
    """
    if features.feature_size != encoder.num_mel_bins:
        raise ArgumentError(f"the features have {features.feature_size} mel bins but the "
                            f"encoder takes {encoder.num_mel_bins}", argument="feature_size")
    if features.nb_max_frames != 2 * encoder.max_source_positions:
        raise ArgumentError(f"a {features.chunk_length} s chunk gives {features.nb_max_frames}"
                            f" frames but the encoder takes {2 * encoder.max_source_positions}",
                            argument="chunk_length")


def encoder_lengths(mel_frames: int) -> int:
    """Positions after the stride-2 convolution for ``mel_frames`` valid frames."""
    return (mel_frames - 1) // 2 + 1
