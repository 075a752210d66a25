"""Whisper building blocks shared by the audio models (not a registered model itself).

* :class:`FeatureConfig` and :func:`log_mel`: the log-mel spectrogram of transformers'
  ``WhisperFeatureExtractor`` (its ``padding="max_length"``, truncating, per-clip
  normalisation, and its frame-level attention mask), computed faster.
* :class:`EncoderConfig`, :class:`EncoderLayer`, :class:`AudioEncoder`: the Whisper encoder
  (two convolutions, learned positions, pre-norm layers, final LayerNorm) under the parameter
  names of transformers' Whisper-style encoders (``conv1``, ``layers.N.self_attn.q_proj``, ...).

How the log-mel is fast (torch, not numpy): the STFT is ``torch.stft`` on the reflect-padded
signal (numpy's FFT was 4x slower here on 400-point frames); the power spectrum is
``re² + im²`` on the complex output's real view (``abs() ** 2`` takes a square root first and
is ~40x slower); the mel projection multiplies only the band of FFT bins each block of
filters covers (the filters are triangles over a few bins, so the dense ``[mels, 201]``
matmul is mostly zeros); and frames past the end of a clip, which hold only padding, are not
transformed at all: they are the constant log of the floor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mmferry.errors import ArgumentError

__all__ = [
    "AudioEncoder",
    "EncoderConfig",
    "EncoderLayer",
    "FeatureConfig",
    "log_mel",
    "mel_filters",
    "speech_like",
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


def log_mel(waveforms: Sequence[np.ndarray], cfg: FeatureConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Whisper log-mel features of each clip, padded or truncated to one chunk.

    Equals ``WhisperFeatureExtractor(**cfg)(waveforms, sampling_rate=cfg.sampling_rate,
    padding="max_length", truncation=True, return_attention_mask=True)``: returns
    ``input_features`` float32 ``[clips, feature_size, nb_max_frames]`` and the frame-level
    ``attention_mask`` int32 ``[clips, nb_max_frames]`` (1 for frames whose first sample is
    inside the clip).
    """
    n, hop, n_fft, frames = cfg.n_samples, cfg.hop_length, cfg.n_fft, cfg.nb_max_frames
    count = len(waveforms)
    lengths = [min(len(w), n) for w in waveforms]
    todo = max((_frames_to_compute(length, cfg) for length in lengths), default=0)
    # Reflect-pad each clip as torch.stft(center=True) does, but only as far as the frames
    # that see the clip; the rest of the chunk is padding.
    half = n_fft // 2
    span = (todo - 1) * hop + n_fft
    padded = np.full((count, n + 2 * half), cfg.padding_value, dtype=np.float32)
    for row, (w, length) in zip(padded, zip(waveforms, lengths, strict=True), strict=True):
        row[half:half + length] = w[:length]
        row[:half] = row[2 * half:half:-1]
        row[half + n:] = row[half + n - 2:n - 2:-1]
    signal = torch.from_numpy(padded[:, :span])
    spec = torch.stft(signal, n_fft, hop, window=_window(n_fft), center=False, return_complex=True)
    # The complex output is frame-major in memory: per frame, (re, im) of each bin. Squared in
    # place, a filter bank with each weight twice (once for re², once for im²) gives the mel
    # power directly, with no |.| and no new multi-megabyte tensor (whose page faults cost as
    # much as the math here).
    squares = torch.view_as_real(spec).transpose(1, 2).reshape(count, todo, -1).square_()
    log_spec = torch.empty(count, cfg.feature_size, frames)
    mel = log_spec if todo == frames else torch.empty(count, cfg.feature_size, todo)
    for band in _bands(cfg.feature_size, n_fft, cfg.sampling_rate):
        torch.matmul(band.weight, squares[:, :, band.lo:band.hi].transpose(1, 2),
                     out=mel[:, band.first:band.last])
    if mel is not log_spec:
        log_spec[:, :, :todo] = mel
        log_spec[:, :, todo:] = torch.tensor(_LOG_FLOOR, dtype=torch.float32).log10()
    log_spec[:, :, :todo].clamp_(min=_LOG_FLOOR).log10_()
    peak = log_spec.amax(dim=(1, 2), keepdim=True)
    torch.maximum(log_spec, peak - 8.0, out=log_spec)
    log_spec.add_(4.0).div_(4.0)
    mask = torch.zeros(count, frames, dtype=torch.int32)
    for row, length in zip(mask, lengths, strict=True):
        row[:-(-length // hop)] = 1
    return log_spec, mask


# -- synthetic speech --------------------------------------------------------------------


def speech_like(seconds: float, sampling_rate: int = 16000, seed: int = 0) -> np.ndarray:
    """A deterministic speech-like clip: syllables of voiced harmonics (a gliding pitch near
    90-220 Hz) shaped by three moving formants, with short pauses between syllables and a
    little breath noise. Float32 in [-1, 1]; used for dummy inputs and benchmarks."""
    rng = np.random.default_rng(seed)
    n = int(seconds * sampling_rate)
    t = np.arange(n) / sampling_rate
    out = np.zeros(n)
    pos = int(rng.uniform(0.05, 0.2) * sampling_rate)
    while pos < n:
        dur = int(rng.uniform(0.12, 0.35) * sampling_rate)
        end = min(n, pos + dur)
        seg = t[pos:end] - t[pos]
        f0 = rng.uniform(90, 220) * (1 + 0.08 * np.sin(2 * np.pi * rng.uniform(2, 5) * seg))
        phase = 2 * np.pi * np.cumsum(f0) / sampling_rate
        formants = rng.uniform([350, 900, 2200], [800, 2000, 3200])
        # sin(kθ) by the Chebyshev recurrence: multiply-adds, no per-harmonic sine.
        two_cos, prev, cur = 2 * np.cos(phase), np.zeros_like(phase), np.sin(phase)
        harmonics, mean_f0 = np.zeros(end - pos), f0.mean()
        for k in range(1, int(4000 / f0.max()) + 1):
            freq = k * mean_f0
            gain = sum(np.exp(-0.5 * ((freq - fm) / (60 + 0.08 * fm)) ** 2) for fm in formants)
            harmonics += (gain + 0.02) / k ** 0.5 * cur
            prev, cur = cur, two_cos * cur - prev
        envelope = np.sin(np.pi * np.minimum(1.0, seg / (dur / sampling_rate))) ** 2
        out[pos:end] += envelope * harmonics
        out[pos:end] += 0.02 * envelope * rng.standard_normal(end - pos)
        # Syllables run into words; every few, a pause.
        pos = end + int(sampling_rate * (rng.uniform(0.25, 0.6) if rng.random() < 0.3
                                         else rng.uniform(0.0, 0.05)))
    out += 0.002 * rng.standard_normal(n)
    return (0.5 * out / max(1e-9, np.abs(out).max())).astype(np.float32)


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

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        b, n, _ = x.shape
        # The query is scaled before the product, as Whisper does (and its checkpoints expect
        # to the last bit).
        q = (self.q_proj(x) * self.scaling).view(b, n, self.heads, -1).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.heads, -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, scale=1.0)
        return self.out_proj(o.transpose(1, 2).reshape(b, n, -1))


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

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), key_mask)
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

    def forward(self, features: torch.Tensor, positions: int,
                key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``key_mask``: bool ``[b, 1, 1, positions]`` (True: attend) or None (all)."""
        x = self.embed(features, positions)
        for layer in self.layers:
            x = layer(x, key_mask)
        return self.layer_norm(x)


def encoder_lengths(mel_frames: int) -> int:
    """Positions after the stride-2 convolution for ``mel_frames`` valid frames."""
    return (mel_frames - 1) // 2 + 1
