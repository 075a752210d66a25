"""FireRedLID: its Kaldi fbank + CMVN processor, field contract and Conformer encoder.

The processor is vLLM 0.33's ``FireRedLIDFeatureExtractor``: the waveform at int16 scale,
80-bin Kaldi filterbank (25 ms Povey windows every 10 ms, pre-emphasis 0.97, DC removal,
power spectrum, log mel; what ``kaldi_native_fbank`` computes with dither 0), then CMVN with
the ``means`` / ``inverse_std_variences`` of the checkpoint's ``preprocessor_config.json``.
The fbank is ours, vectorised over frames in torch (one strided view, one batched real FFT,
one matmul with the mel matrix).

The encoder is the Conformer whose output the LID decoder attends to (vLLM's
``ConformerEncoder``): ``Conv2dSubsampling`` (×4 in time after a 6-frame context pad),
relative positional encoding, and Conformer blocks (½ FFN, rel-pos self-attention with
``pos_bias_u/v``, convolution module, ½ FFN, LayerNorm), with the published checkpoint's
parameter names under ``encoder.``. Its output per item is the encoder frames the decoder's
cross-attention reads, ``[tokens, d_model]``.

Placement: ``speech_lengths`` is ``both``. Its device side meets a device ``arange`` in the
padding mask; its host side gives the output length per item (the subsampling formula), so
cutting the padded output per item needs no device-to-host read, unlike vLLM, which uploads
the lengths with a blocking copy and reads the encoder lengths back with ``.item()``.
``fake_token_lengths`` (the decoder prompt's placeholder count) is never read by the
encoder and stays on the host.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mmferry.errors import ArgumentError, CheckpointError, ContractError, MediaError
from mmferry.fields import FieldSpec
from mmferry.media import load_audio, source_name
from mmferry.media.samples import speech_like
from mmferry.models.checkpoint import read_json
from mmferry.transfer import host_and_device, upload

__all__ = [
    "TINY",
    "EncoderConfig",
    "FeatureConfig",
    "FireRedLID",
    "encoder_lengths",
    "kaldi_fbank",
]

# float32 log(10000), as the reference's tables take it (``torch.log(torch.tensor(1e4)).item()``).
_LOG_1E4 = float(np.float32(math.log(10000.0)))
# Conv2dSubsampling's context: 3 frames left and right of the current one, so the input is
# padded with 6 frames before the two stride-2 convolutions.
CONTEXT = 7


@dataclass(frozen=True, slots=True)
class EncoderConfig:
    """The encoder part of a FireRedLID ``config.json`` (vLLM's ``FireRedLIDConfig``);
    defaults are the published model's."""

    idim: int = 80
    d_model: int = 1280
    n_head: int = 20
    n_layers_enc: int = 16
    kernel_size: int = 33
    pe_maxlen: int = 5000

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> EncoderConfig:
        """Read a checkpoint's ``config.json`` content; a bad value is an ArgumentError
        naming its key."""
        model_type = config.get("model_type")
        if model_type not in (None, "fireredlid"):
            raise ArgumentError(f"config is for model_type {model_type!r}, not 'fireredlid'",
                                argument="config")
        values = {}
        for f in fields(cls):
            value = config.get(f.name, f.default)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ArgumentError(f"config {f.name} must be a positive int, got {value!r}",
                                    argument=f.name)
            values[f.name] = value
        out = cls(**values)
        if out.d_model % out.n_head or out.d_model % 2:
            raise ArgumentError(f"d_model {out.d_model} must be even and split into "
                                f"{out.n_head} heads", argument="n_head")
        if out.kernel_size % 2 == 0:
            raise ArgumentError(f"kernel_size must be odd, got {out.kernel_size}",
                                argument="kernel_size")
        if out.idim < 7:
            raise ArgumentError(f"idim {out.idim} is too small for two stride-2 3x3 convolutions",
                                argument="idim")
        return out


TINY = EncoderConfig(idim=80, d_model=32, n_head=2, n_layers_enc=2, kernel_size=5)


@dataclass(frozen=True, slots=True)
class FeatureConfig:
    """vLLM's ``FireRedLIDFeatureExtractor`` settings, from ``preprocessor_config.json``.

    ``means`` / ``inverse_std_variences`` are the CMVN statistics (the reference spells it
    so); ``None`` (the tiny model) is the identity. Like the reference, ``frame_length`` /
    ``frame_shift`` / ``dither`` are not used: frames are 25 ms every 10 ms, without dither.
    ``left_context`` / ``right_context`` only enter ``fake_token_lengths``, as there.
    """

    sampling_rate: int = 16000
    num_mel_bins: int = 80
    chunk_length: int = 30
    left_context: int = 3
    right_context: int = 3
    means: tuple[float, ...] | None = None
    inverse_std_variences: tuple[float, ...] | None = None

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], source: str) -> FeatureConfig:
        """Read ``preprocessor_config.json`` content (``source`` names the file in errors).

        Raises:
            CheckpointError: missing CMVN statistics, or a value of the wrong type or size;
                the message names the file and the key.
        """
        values: dict[str, Any] = {}
        defaults = {f.name: f.default for f in fields(cls)}
        for name in ("sampling_rate", "num_mel_bins", "chunk_length", "left_context",
                     "right_context"):
            value = config.get(name, defaults[name])
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise CheckpointError(f"{source}: {name} must be a non-negative int, got {value!r}",
                                      parameter=name)
            values[name] = value
        if values["sampling_rate"] < 8000:
            raise CheckpointError(f"{source}: sampling_rate {values['sampling_rate']} is too low "
                                  "for 80 mel bins up to Nyquist", parameter="sampling_rate")
        dim = config.get("dim", values["num_mel_bins"])
        if dim != values["num_mel_bins"]:
            raise CheckpointError(f"{source}: CMVN dim {dim!r} differs from num_mel_bins "
                                  f"{values['num_mel_bins']}", parameter="dim")
        for name in ("means", "inverse_std_variences"):
            stats = config.get(name)
            if (not isinstance(stats, list) or len(stats) != dim
                    or not all(isinstance(v, int | float) and math.isfinite(v) for v in stats)):
                got = f"{len(stats)} values" if isinstance(stats, list) else repr(stats)
                raise CheckpointError(f"{source}: {name} must be {dim} finite numbers (the CMVN "
                                      f"statistics), got {got}", parameter=name)
            values[name] = tuple(float(v) for v in stats)
        return cls(**values)


# -- features ----------------------------------------------------------------------------


def _mel_scale(freq: np.ndarray) -> np.ndarray:
    return np.float32(1127.0) * np.log(np.float32(1.0) + freq / np.float32(700.0))


@lru_cache(maxsize=8)
def _mel_matrix(num_bins: int, sampling_rate: int, padded: int) -> torch.Tensor:
    """``[padded/2 + 1, num_bins]`` float32: Kaldi's triangular mel filters from 20 Hz to
    Nyquist over the FFT bins (the Nyquist bin gets no weight, as in Kaldi), in float32
    arithmetic as ``kaldi_native_fbank`` builds them."""
    f32 = np.float32
    low, high = _mel_scale(f32(20.0)), _mel_scale(f32(sampling_rate / 2))
    delta = (high - low) / f32(num_bins + 1)
    freqs = np.arange(padded // 2, dtype=np.float32) * f32(sampling_rate / padded)
    mel = _mel_scale(freqs)[:, None]
    b = np.arange(num_bins, dtype=np.float32)[None, :]
    left, center, right = low + b * delta, low + (b + 1) * delta, low + (b + 2) * delta
    up = (mel - left) / (center - left)
    down = (right - mel) / (right - center)
    weights = np.where((mel > left) & (mel < right), np.where(mel <= center, up, down), f32(0))
    out = np.zeros((padded // 2 + 1, num_bins), dtype=np.float32)
    out[: padded // 2] = weights
    return torch.from_numpy(out)


@lru_cache(maxsize=8)
def _povey_window(length: int) -> torch.Tensor:
    i = np.arange(length, dtype=np.float64)
    return torch.from_numpy((0.5 - 0.5 * np.cos(2 * np.pi * i / (length - 1))) ** 0.85).float()


def kaldi_fbank(wave: torch.Tensor | np.ndarray, sampling_rate: int = 16000,
                num_mel_bins: int = 80) -> torch.Tensor:
    """Kaldi log-mel filterbank of a 1-D waveform, ``[frames, num_mel_bins]`` float32.

    The options are ``kaldi_native_fbank.FbankOptions()``'s with dither 0: 25 ms frames every
    10 ms without edge padding (``snip_edges``), DC offset removed, pre-emphasis 0.97, Povey
    window, FFT size the next power of two, power spectrum, mel filters from 20 Hz to
    Nyquist, log with a floor of float32 epsilon. Frames are processed together: a strided
    view of the samples, one batched real FFT and one matmul. A waveform shorter than one
    frame gives zero frames.
    """
    wave = torch.as_tensor(wave, dtype=torch.float32)
    frame = int(sampling_rate * 0.025)
    shift = int(sampling_rate * 0.010)
    padded = 1 << (frame - 1).bit_length()
    n = wave.numel()
    if n < frame:
        return torch.zeros(0, num_mel_bins)
    count = 1 + (n - frame) // shift
    x = wave.contiguous().as_strided((count, frame), (shift, 1))
    x = x - x.mean(dim=1, keepdim=True)
    # Frames are written into an explicitly zero-padded buffer: torch's rfft pads a
    # [frames, 400] input to 512 several times slower than it transforms a padded one.
    buf = x.new_zeros((count, padded))
    # Pre-emphasis (the first sample against itself, as Kaldi does), then the window.
    torch.cat((x[:, :1] - 0.97 * x[:, :1], x[:, 1:] - 0.97 * x[:, :-1]), dim=1,
              out=buf[:, :frame])
    buf[:, :frame].mul_(_povey_window(frame))
    spectrum = torch.fft.rfft(buf)
    power = spectrum.real.square() + spectrum.imag.square()
    mel = power @ _mel_matrix(num_mel_bins, sampling_rate, padded)
    return mel.clamp_min_(torch.finfo(torch.float32).eps).log_()


def _subsampled_count(length: int, padded: int) -> int:
    """Ones left in a ``padded``-long mask with ``length`` leading ones after vLLM's
    ``mask[:-2:2][:-2:2]`` (each step keeps the even positions before the last two)."""
    for _ in range(2):
        kept = max(padded - 2, 0)
        length, padded = (min(length, kept) + 1) // 2, (kept + 1) // 2
    return length


def encoder_lengths(frames: int) -> int:
    """Encoder output frames for ``frames`` fbank frames: ``ceil(frames / 4)``, what the
    twice ``[:-2:2]``-subsampled padding mask of ``Conv2dSubsampling`` counts after the
    6-frame context pad (the count does not depend on the batch's longest item)."""
    return _subsampled_count(frames, frames + CONTEXT - 1)


def _as_clips(audios: Any) -> list[Any]:
    """The clips of ``audios``: one source (a path, bytes, a file object, a 1-D array or an
    ``(array, rate)`` pair) or a sequence of them."""
    if audios is None:
        return []
    one = (isinstance(audios, str | os.PathLike | bytes | bytearray | memoryview)
           or hasattr(audios, "read")
           or (isinstance(audios, np.ndarray | torch.Tensor) and audios.ndim == 1)
           or (isinstance(audios, tuple) and len(audios) == 2
               and isinstance(audios[1], int | np.integer) and not isinstance(audios[1], bool)))
    return [audios] if one else list(audios)


# -- encoder -----------------------------------------------------------------------------


class Conv2dSubsampling(nn.Module):
    """Two 3×3 stride-2 convolutions with ReLU over (time, mel), then a linear map of the
    flattened channels × mel to ``d_model``: ×4 fewer frames."""

    def __init__(self, idim: int, d_model: int, channels: int = 32) -> None:
        super().__init__()
        # Indices 0 and 2 are the checkpoint's (ReLUs at 1 and 3).
        self.conv = nn.Sequential(nn.Conv2d(1, channels, 3, 2), nn.ReLU(),
                                  nn.Conv2d(channels, channels, 3, 2), nn.ReLU())
        self.out = nn.Linear(channels * (((idim - 1) // 2 - 1) // 2), d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x.unsqueeze(1))
        return self.out(x.transpose(1, 2).flatten(2))


class FeedForward(nn.Module):
    """LayerNorm, ×4 expansion, Swish, projection; residual added by the block."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        # The published Sequential: norm, expand, Swish, dropout, project.
        self.net = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, 4 * d_model), nn.SiLU(),
                                 nn.Identity(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@dataclass(frozen=True, slots=True)
class Packing:
    """Where each clip's real encoder frames sit in the padded ``[B, T]`` batch.

    Position-wise work (feed-forward, projections, norms, pointwise convolutions) runs on the
    packed ``[Σ tokens, C]`` rows only; attention and the depthwise convolution, which mix
    frames, run on the padded batch rebuilt with zeros at the padding. Padding frames cannot
    reach real ones there (masked keys; zero inputs to a bias-free convolution, as vLLM's
    ``masked_fill`` makes them), so the result equals the padded computation's real rows.
    ``rows`` (flat indices of the real frames, from host lengths, uploaded once) is ``None``
    when nothing is padded.
    """

    batch: int
    frames: int
    rows: torch.Tensor | None

    @classmethod
    def of(cls, tokens: Sequence[int], frames: int, device: torch.device) -> Packing:
        if all(n == frames for n in tokens):
            return cls(len(tokens), frames, None)
        rows = np.concatenate([np.arange(n) + i * frames for i, n in enumerate(tokens)])
        return cls(len(tokens), frames, upload(torch.from_numpy(rows), device))

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, C]`` -> ``[Σ tokens, C]``."""
        x = x.flatten(0, 1)
        return x if self.rows is None else x.index_select(0, self.rows)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """``[Σ tokens, C]`` -> ``[B, T, C]``, zeros at the padding."""
        if self.rows is not None:
            x = x.new_zeros((self.batch * self.frames, x.shape[-1])).index_copy_(0, self.rows, x)
        return x.view(self.batch, self.frames, -1)


class RelPosAttention(nn.Module):
    """Self-attention with relative positions (Transformer-XL): scores are
    ``(q + u)·k + shift((q + v)·p)``; q, k, v each get their own LayerNorm."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        d_k = d_model // n_head
        self.w_qs = nn.Linear(d_model, d_model, bias=False)
        self.w_ks = nn.Linear(d_model, d_model, bias=False)
        self.w_vs = nn.Linear(d_model, d_model, bias=False)
        self.layer_norm_q = nn.LayerNorm(d_model)
        self.layer_norm_k = nn.LayerNorm(d_model)
        self.layer_norm_v = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, d_model, bias=False)
        self.linear_pos = nn.Linear(d_model, d_model, bias=False)
        self.pos_bias_u = nn.Parameter(torch.empty(n_head, d_k))
        self.pos_bias_v = nn.Parameter(torch.empty(n_head, d_k))

    def forward(self, x: torch.Tensor, pos_emb: torch.Tensor, key_bias: torch.Tensor,
                packing: Packing) -> torch.Tensor:
        """``x`` ``[Σ tokens, d]``, ``pos_emb`` ``[2T - 1, d]`` (relative positions T-1 .. 1-T),
        ``key_bias`` ``[B, 1, 1, T]`` (0 for a frame, -inf for padding)."""
        b, t = packing.batch, packing.frames
        heads = (b, t, self.n_head, -1)
        q = packing.unpack(self.w_qs(self.layer_norm_q(x))).view(heads)
        k = packing.unpack(self.w_ks(self.layer_norm_k(x))).view(heads).transpose(1, 2)
        v = packing.unpack(self.w_vs(self.layer_norm_v(x))).view(heads).transpose(1, 2)
        p = self.linear_pos(pos_emb).view(1, 2 * t - 1, self.n_head, -1).transpose(1, 2)
        scale = q.shape[-1] ** -0.5
        bd = torch.matmul((q + self.pos_bias_v).transpose(1, 2), p.transpose(-2, -1))
        # The relative shift as a view: score (i, j) reads column T-1-i+j of row i, the
        # embedding of relative position i-j.
        s = bd.stride()
        bd = bd.as_strided((b, self.n_head, t, t), (s[0], s[1], s[2] - 1, s[3]),
                           bd.storage_offset() + t - 1)
        bias = torch.add(key_bias, bd, alpha=scale)
        out = F.scaled_dot_product_attention((q + self.pos_bias_u).transpose(1, 2), k, v,
                                             attn_mask=bias)
        return self.fc(packing.pack(out.transpose(1, 2).flatten(2)))


class ConvModule(nn.Module):
    """Pointwise ×4 conv → GLU → depthwise conv → LayerNorm → Swish → pointwise conv (the
    checkpoint calls the LayerNorm ``batch_norm``)."""

    def __init__(self, d_model: int, kernel_size: int) -> None:
        super().__init__()
        self.pre_layer_norm = nn.LayerNorm(d_model)
        self.pointwise_conv1 = nn.Conv1d(d_model, 4 * d_model, 1, bias=False)
        self.depthwise_conv = nn.Conv1d(2 * d_model, 2 * d_model, kernel_size,
                                        padding=(kernel_size - 1) // 2, groups=2 * d_model,
                                        bias=False)
        self.batch_norm = nn.LayerNorm(2 * d_model)
        self.pointwise_conv2 = nn.Conv1d(2 * d_model, d_model, 1, bias=False)

    def forward(self, x: torch.Tensor, packing: Packing) -> torch.Tensor:
        """``x`` ``[Σ tokens, d]``. Pointwise convolutions are linear maps over the packed
        rows; only the depthwise one sees the padded, channels-first batch."""
        out = F.linear(self.pre_layer_norm(x), self.pointwise_conv1.weight.squeeze(-1))
        out = packing.unpack(F.glu(out, dim=-1))
        out = packing.pack(self.depthwise_conv(out.transpose(1, 2)).transpose(1, 2))
        out = F.silu(self.batch_norm(out))
        return F.linear(out, self.pointwise_conv2.weight.squeeze(-1))


class ConformerBlock(nn.Module):
    def __init__(self, d_model: int, n_head: int, kernel_size: int) -> None:
        super().__init__()
        self.ffn1 = FeedForward(d_model)
        self.mhsa = RelPosAttention(d_model, n_head)
        self.conv = ConvModule(d_model, kernel_size)
        self.ffn2 = FeedForward(d_model)
        self.layer_norm = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor, pos_emb: torch.Tensor, key_bias: torch.Tensor,
                packing: Packing) -> torch.Tensor:
        x = x + 0.5 * self.ffn1(x)
        x = x + self.mhsa(x, pos_emb, key_bias, packing)
        x = x + self.conv(x, packing)
        x = x + 0.5 * self.ffn2(x)
        return self.layer_norm(x)


class ConformerEncoder(nn.Module):
    """Subsampling, relative positions and Conformer blocks over padded fbank frames."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.input_preprocessor = Conv2dSubsampling(cfg.idim, cfg.d_model)
        self.layer_stack = nn.ModuleList(ConformerBlock(cfg.d_model, cfg.n_head, cfg.kernel_size)
                                         for _ in range(cfg.n_layers_enc))

    def _pos_emb(self, t: int, device: torch.device) -> torch.Tensor:
        """``[2t - 1, d]`` sinusoids of relative positions t-1 down to 1-t, computed as the
        reference's table (float32 angles ``position * div_term``), on the device."""
        d = self.cfg.d_model
        div = torch.exp(torch.arange(0, d, 2, device=device).float()
                        * -(_LOG_1E4 / d))
        angles = torch.arange(t - 1, -t, -1, device=device).float()[:, None] * div
        return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(1)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor, tokens: Sequence[int]) -> torch.Tensor:
        """``x`` ``[B, T + 6, idim]`` (zero padded), ``lengths`` ``[B]`` on the device,
        ``tokens`` each clip's encoder frames (host ints); returns the clips' encoder frames
        packed, ``[Σ tokens, d_model]``."""
        frames = torch.arange(x.shape[1], device=x.device)
        mask = frames[None, :] < lengths[:, None]
        mask = mask[:, :-2:2][:, :-2:2]
        x = self.input_preprocessor(x)
        packing = Packing.of(tokens, x.shape[1], x.device)
        key_bias = torch.zeros(mask.shape, dtype=x.dtype, device=x.device)
        key_bias = key_bias.masked_fill_(~mask, float("-inf"))[:, None, None, :]
        pos_emb = self._pos_emb(x.shape[1], x.device).to(x.dtype)
        x = packing.pack(x)
        for block in self.layer_stack:
            x = block(x, pos_emb, key_bias, packing)
        return x


# -- the model ---------------------------------------------------------------------------

FEATURES, LENGTHS, FAKE = "input_features", "speech_lengths", "fake_token_lengths"


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
    return type(value).__name__


def _int_scalar(item: Mapping[str, Any], name: str) -> int:
    value = item.get(name)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        return int(value.reshape(()))
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ContractError(f"expected one integer, got {_describe(value)}", field=name)


class FireRedLID(nn.Module):
    """FireRedLID's audio encoder as the runtime drives it (see
    :class:`mmferry.encoder.model.EncoderModel`).

    Build with :func:`mmferry.models.load`. Parameters live under ``encoder.`` with the
    published checkpoint's names; the LID decoder's weights (``lid_decoder.``) are not read.
    """

    name = "firered-lid"
    modalities = ("audio",)
    precomputed_fields: frozenset[str] = frozenset()
    # The original training code saved the relative positional table as a buffer; vLLM skips
    # it when loading ("rebuilt at init") and so does this model (it computes it per call).
    checkpoint_prefixes: ClassVar[Mapping[str, str | None]] = MappingProxyType(
        {"encoder.": "encoder.", "encoder.positional_encoding.": None})

    def __init__(self, config: EncoderConfig = TINY, features: FeatureConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.features = features or FeatureConfig(num_mel_bins=config.idim)
        if self.features.num_mel_bins != config.idim:
            raise ArgumentError(f"the processor's {self.features.num_mel_bins} mel bins differ "
                                f"from the encoder's idim {config.idim}", argument="idim")
        self.hidden_size = config.d_model
        self.encoder = ConformerEncoder(config)

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None, folder: Path | None = None) -> FireRedLID:
        """The tiny encoder (``config=None``) or the one a ``config.json`` describes. A
        checkpoint folder must hold ``preprocessor_config.json`` with the CMVN statistics,
        as vLLM's processor needs; without a folder CMVN is the identity."""
        cfg = TINY if config is None else EncoderConfig.from_dict(config)
        features = None
        if folder is not None:
            name = "preprocessor_config.json"
            features = FeatureConfig.from_dict(read_json(folder, name), str(Path(folder) / name))
        return cls(cfg, features)

    # -- processor ---------------------------------------------------------------------

    def processor(self, *, images: Any = None, videos: Any = None, audios: Any = None,
                  sampling_rate: int | None = None, **kwargs: Any) -> dict[str, Any]:
        """Clips to ``input_features`` (per clip ``[T, num_mel_bins]`` float32 fbank + CMVN:
        one ``[B, T, n]`` tensor when all clips have T frames, else a list),
        ``speech_lengths`` ``[B]`` int64 (T per clip) and ``fake_token_lengths`` ``[B]``
        int64 (the encoder frames per clip, the decoder prompt's placeholder count).

        ``audios``: one clip or a sequence; a clip is anything
        :func:`mmferry.media.load_audio` takes (a path, encoded bytes, a file object, a 1-D
        array at the model's rate of 16 kHz, or an ``(array, rate)`` pair), decoded to mono at
        that rate. ``sampling_rate``, if given, must be the model's, as in the reference.

        Raises:
            MediaError: a clip that cannot be decoded, breaks a limit, or is shorter than one
                25 ms frame; names the file or ``item N``.
            ArgumentError: images or videos, another option, or another sampling rate.
        """
        if kwargs:
            raise ArgumentError(f"unknown processor option(s) {sorted(kwargs)}; firered-lid "
                                "takes sampling_rate", argument=sorted(kwargs)[0])
        if images is not None or videos is not None:
            raise ArgumentError("firered-lid takes audio only",
                                argument="images" if images is not None else "videos")
        fc = self.features
        if sampling_rate is not None and sampling_rate != fc.sampling_rate:
            raise ArgumentError(f"firered-lid expects sampling_rate={fc.sampling_rate}, got "
                                f"{sampling_rate}", argument="sampling_rate")
        feats = []
        for i, clip in enumerate(_as_clips(audios)):
            wave = load_audio(clip, fc.sampling_rate, index=i)
            # The reference feeds int16-scale samples to Kaldi's fbank.
            feat = kaldi_fbank(torch.from_numpy(wave) * 32768, fc.sampling_rate, fc.num_mel_bins)
            if not len(feat):
                raise MediaError(f"{len(wave)} samples at {fc.sampling_rate} Hz is shorter than "
                                 "one 25 ms frame", source=source_name(clip, i))
            feats.append(self._cmvn(feat))
        if not feats:
            return {}
        lengths = [len(f) for f in feats]
        pad = fc.left_context + fc.right_context
        fake = [max(1, _subsampled_count(n, n + pad)) for n in lengths]
        same = all(n == lengths[0] for n in lengths)
        return {FEATURES: torch.stack(feats) if same else feats,
                LENGTHS: torch.tensor(lengths, dtype=torch.int64),
                FAKE: torch.tensor(fake, dtype=torch.int64)}

    def _cmvn(self, feat: torch.Tensor) -> torch.Tensor:
        fc = self.features
        if fc.means is None or fc.inverse_std_variences is None:
            return feat
        # In float64 and rounded once, as the reference (numpy statistics) does.
        means = torch.tensor(fc.means, dtype=torch.float64)
        scale = torch.tensor(fc.inverse_std_variences, dtype=torch.float64)
        return feat.double().sub_(means).mul_(scale).float()

    # -- contract ----------------------------------------------------------------------

    def field_specs(self, outputs: Mapping[str, Any]) -> dict[str, FieldSpec]:
        """One entry per clip for each field: features on the device, lengths on both sides
        (device mask, host output sizes), the prompt's placeholder counts on the host."""
        placements = {FEATURES: "device", LENGTHS: "both", FAKE: "host"}
        present = [k for k in outputs if outputs[k] is not None]
        unknown = set(present) - set(placements)
        if unknown:
            raise ContractError("not a firered-lid field", field=sorted(unknown)[0])
        if FEATURES in present and LENGTHS not in present:
            raise ContractError(f"{LENGTHS} is needed with {FEATURES}", field=LENGTHS)
        return {k: FieldSpec.batched("audio", placement=placements[k]) for k in present}

    def check_item(self, item: Mapping[str, Any]) -> None:
        """Features ``[T, n_mels]`` floating point with ``T == speech_lengths >= 1``, at most
        the positional table's length in encoder frames; ``fake_token_lengths``, when given,
        one integer."""
        unknown = set(item) - {FEATURES, LENGTHS, FAKE}
        if unknown:
            raise ContractError("not a firered-lid field", field=sorted(unknown)[0])
        length = _int_scalar(item, LENGTHS)
        if length < 1:
            raise ContractError(f"must be at least 1, got {length}", field=LENGTHS)
        if encoder_lengths(length) > self.config.pe_maxlen:
            raise ContractError(f"{length} frames give {encoder_lengths(length)} encoder frames, "
                                f"above pe_maxlen {self.config.pe_maxlen}", field=LENGTHS)
        feats = item.get(FEATURES)
        shape = (length, self.config.idim)
        if (not isinstance(feats, torch.Tensor) or not feats.is_floating_point()
                or tuple(feats.shape) != shape):
            raise ContractError(f"expected floating point {list(shape)} from {LENGTHS}, got "
                                f"{_describe(feats)}", field=FEATURES)
        if FAKE in item:
            _int_scalar(item, FAKE)

    def tokens_per_item(self, item: Mapping[str, Any]) -> int:
        """Encoder frames of the clip, from its host ``speech_lengths``."""
        return encoder_lengths(_int_scalar(item, LENGTHS))

    def encode(self, **batch: Any) -> torch.Tensor:
        """One batch of clips to ``[Σ tokens, d_model]``: each clip's encoder frames, in
        order, without padding.

        ``input_features`` (a ``[B, T, n]`` tensor or a list of ``[T_i, n]``) on the device;
        ``speech_lengths`` both (its host side sizes the output, its device side masks the
        padding); ``fake_token_lengths`` is accepted and not read.
        """
        unknown = set(batch) - {FEATURES, LENGTHS, FAKE}
        if unknown:
            raise ContractError("not a firered-lid field", field=sorted(unknown)[0])
        for name in (FEATURES, LENGTHS):
            if batch.get(name) is None:
                raise ContractError("missing from the batch", field=name)
        host_lengths, lengths = host_and_device(batch[LENGTHS])
        sizes = [int(n) for n in host_lengths.reshape(-1).tolist()]
        feats = batch[FEATURES]
        if isinstance(feats, torch.Tensor) and feats.ndim == 2:
            feats = feats.unsqueeze(0)
        rows = [f.shape[0] for f in feats]
        if len(rows) != len(sizes) or any(r < n for r, n in zip(rows, sizes, strict=True)):
            raise ContractError(f"feature rows {rows} do not hold {LENGTHS} {sizes}", field=FEATURES)
        weight = self.encoder.input_preprocessor.out.weight
        x = self._pad(feats, weight.dtype)
        return self.encoder(x, lengths.reshape(-1), [encoder_lengths(n) for n in sizes])

    def _pad(self, feats: torch.Tensor | Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """``[B, T_max + 6, n]``: the clips zero-padded to the longest plus the subsampling
        context, in one device buffer."""
        if isinstance(feats, torch.Tensor):
            return F.pad(feats.to(dtype), (0, 0, 0, CONTEXT - 1))
        # Per-clip pads and one stack (rather than pad_sequence) keep the placement audit's
        # provenance: a finding on the result still names input_features.
        rows = max(f.shape[0] for f in feats) + CONTEXT - 1
        return torch.stack([F.pad(f, (0, 0, 0, rows - f.shape[0])) for f in feats]).to(dtype)

    def dummy_inputs(self) -> dict[str, Any]:
        """Processor output for two speech-like clips of different lengths (0.5 s, 0.9 s)."""
        rate = self.features.sampling_rate
        return self.processor(audios=[speech_like(0.5, rate, seed=1), speech_like(0.9, rate, seed=2)])
