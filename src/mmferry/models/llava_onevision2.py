"""LLaVA-OneVision-2: its image / video-frame processor, field contract and vision tower.

OV2 is remote code (not in transformers); the reference is vLLM 0.33's
``llava_onevision2.py`` and the checkpoint's ``LlavaOnevision2Processor``.

Processor: transformers' ``Qwen2VLImageProcessor`` (the torchvision backend vLLM 0.33 builds
with transformers 5) with a temporal patch of 1: smart resize, merge-block patch order, rows of
``C·P·P``. ``patch_positions`` holds each patch's (t, h, w) in the same order. Videos take
vLLM's frame backend: the frames (padded to an even count by repeating the last) go through
the image branch, one ``(1, h, w)`` grid row and t = 0 positions per frame, with
``frame_timestamps`` = frame index / fps. By default the pixels stay uint8 levels (the
resized frame, patchified) with the CLIP normalisation declared on the field spec and folded
into the patch embedding; ``pixel_dtype="float32"`` normalises them as transformers does.
``resize_mode="fast"`` (the default) resizes with torchvision's kernel, as vLLM's processor
does; ``"exact"`` with Pillow's, as transformers' ``Qwen2VLImageProcessorPil``. A temporal
patch of 1 means nothing is duplicated over time: an image ships as ``[h·w, C·P·P]`` either way.

Encoder: conv patch embedding (no bias), ``layernorm_pre``, blocks with a fused ``qkv``,
3-D interleaved rotary positions (head_dim/2 split 4:6:6 over t, h, w) from
``patch_positions`` and attention within windows of ``frame_windows_size`` frames, then the
merger (LN, merge² patches concatenated, Linear-GELU-Linear to the language model's width).
Parameter names are the published checkpoint's under ``model.visual.``.

Placement: ``patch_positions`` / ``patch_positions_videos`` are per-patch data that meet the
rotary kernels, so they live on the device. Grids and frame metadata stay on the host; the
attention windows are host integers derived from the grid (each window run is a slice of the
device activations), so nothing derived from metadata is copied to the device at all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from mmferry.errors import ArgumentError, ContractError, MediaError
from mmferry.fields import FieldSpec, Normalize
from mmferry.media import load_image, load_video
from mmferry.media.arguments import as_images, as_videos
from mmferry.media.resize import (
    DEFAULT_PIXEL_DTYPE,
    DEFAULT_RESIZE_MODE,
    check_pixel_options,
    resize,
)
from mmferry.models.blocks import PixelFold, check_normalize, describe, frame_attention
from mmferry.models.checkpoint import read_json
from mmferry.models.qwen2_vl import CLIP_MEAN, CLIP_STD, smart_resize

__all__ = ["TINY", "LlavaOnevision2", "ProcessorConfig", "VisionConfig", "patch_positions",
           "patchify_into"]


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """What the tower needs of a ``config.json``: its ``vision_config`` and the language
    model's width (``text_config.hidden_size``). Defaults are LLaVA-OneVision-2-8B's."""

    hidden_size: int = 1024
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    intermediate_size: int = 4096
    patch_size: int = 14
    spatial_merge_size: int = 2
    num_channels: int = 3
    frame_windows_size: int = 4
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-6
    text_hidden_size: int = 4096  # the merger's output, the language model's width

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> VisionConfig:
        """Read a checkpoint's ``config.json`` content, with the defaults vLLM applies to
        absent optional keys (``num_channels``, ``frame_windows_size``, ``rope_theta``,
        ``layer_norm_eps``).

        Raises:
            ArgumentError: a missing ``vision_config`` / ``text_config.hidden_size`` or a
                value of the wrong type or size; it names the key.
        """
        vision = config.get("vision_config")
        if not isinstance(vision, Mapping):
            raise ArgumentError("config.json needs a vision_config mapping",
                                argument="vision_config")
        text = config.get("text_config")
        if not isinstance(text, Mapping) or "hidden_size" not in text:
            raise ArgumentError("config.json needs text_config.hidden_size (the merger's output "
                                "width)", argument="text_config.hidden_size")
        values: dict[str, Any] = {"text_hidden_size": text["hidden_size"]}
        required = ("hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size", "patch_size", "spatial_merge_size")
        for key in required:
            if key not in vision:
                raise ArgumentError("missing from vision_config", argument=f"vision_config.{key}")
            values[key] = vision[key]
        for key in ("num_channels", "frame_windows_size", "rope_theta", "layer_norm_eps"):
            if vision.get(key) is not None:
                values[key] = vision[key]
        for key, value in values.items():
            name = "text_config.hidden_size" if key == "text_hidden_size" else f"vision_config.{key}"
            if key in ("rope_theta", "layer_norm_eps"):
                if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                    raise ArgumentError(f"must be a positive number, got {value!r}", argument=name)
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ArgumentError(f"must be a positive int, got {value!r}", argument=name)
        out = cls(**values)
        if out.hidden_size % out.num_attention_heads or out.head_dim % 32:
            raise ArgumentError(
                f"hidden_size {out.hidden_size} must split into {out.num_attention_heads} heads "
                "whose size is a multiple of 32 (half of it splits 4:6:6 over t, h, w)",
                argument="vision_config.num_attention_heads")
        return out


TINY = VisionConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=128, text_hidden_size=48)


@dataclass(frozen=True, slots=True)
class ProcessorConfig:
    """The image processor's settings; defaults are transformers' ``Qwen2VLImageProcessor``
    class defaults with OV2's temporal patch of 1."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 1
    rescale_factor: float = 1 / 255

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> ProcessorConfig:
        """Read a checkpoint's ``preprocessor_config.json`` content the way
        ``Qwen2VLImageProcessor.from_pretrained`` does (``min_pixels`` / ``max_pixels``
        override ``size``)."""
        out = cls()
        size = config.get("size") or {}
        min_pixels = config.get("min_pixels") or size.get("shortest_edge", out.min_pixels)
        max_pixels = config.get("max_pixels") or size.get("longest_edge", out.max_pixels)
        try:
            return replace(
                out,
                min_pixels=int(min_pixels),
                max_pixels=int(max_pixels),
                image_mean=tuple(float(v) for v in config.get("image_mean", out.image_mean)),
                image_std=tuple(float(v) for v in config.get("image_std", out.image_std)),
                patch_size=int(config.get("patch_size", out.patch_size)),
                merge_size=int(config.get("merge_size", out.merge_size)),
                temporal_patch_size=int(config.get("temporal_patch_size",
                                                   out.temporal_patch_size)),
                rescale_factor=float(config.get("rescale_factor", out.rescale_factor)),
            )
        except (TypeError, ValueError) as e:
            raise ArgumentError(f"preprocessor_config.json: {e}",
                                argument="preprocessor_config") from None


# -- processor ---------------------------------------------------------------------------


@lru_cache(maxsize=16)
def _normalise_table(mean: tuple[float, ...], std: tuple[float, ...], rescale: float,
                     resize_mode: str) -> np.ndarray:
    """``[C, 256]`` float32: every uint8 level normalised bit for bit as the transformers
    processor whose pixels ``resize_mode`` gives does it (a table lookup repeats any
    per-level arithmetic exactly).

    ``fast``, the torchvision backend: rescale fused into the statistics (``mean / rescale``
    and ``std / rescale`` in float32), then ``(x - mean) / std`` in float32. ``exact``, the
    PIL backend: ``x * rescale`` in float64 rounded to float32, then ``(x - mean) / std`` in
    float32.
    """
    if resize_mode == "fast":
        m = torch.tensor(mean) * (1.0 / rescale)
        s = torch.tensor(std) * (1.0 / rescale)
        table = ((torch.arange(256, dtype=torch.float32)[None, :] - m[:, None]) / s[:, None]).numpy()
    else:
        levels = (np.arange(256, dtype=np.float64) * rescale).astype(np.float32)
        m, s = np.asarray(mean, dtype=np.float32), np.asarray(std, dtype=np.float32)
        table = (levels[None, :] - m[:, None]) / s[:, None]
    table.setflags(write=False)
    return table


def patchify_into(out: np.ndarray, planes: np.ndarray, *, patch: int, merge: int) -> None:
    """Write one frame's uint8 channel planes ``[C, H, W]`` into uint8 ``out``
    ``[h·w, C·P·P]``: rows in merge-block order (block row, block column, row in block,
    column in block), columns over (channel, patch row, patch column), the layout of
    Qwen2-VL's processors with a temporal patch of 1.

    A patch row of one channel is ``patch`` contiguous bytes in a plane and in ``out``, so it
    moves as one opaque numpy element: a few times faster than reordering byte by byte.
    """
    c, h, w = planes.shape
    gh, gw = h // patch, w // patch
    if planes.strides[2] != 1:  # a view of interleaved pixels: planes first, in one pass
        planes = np.ascontiguousarray(planes)
    row = np.dtype((np.void, patch))
    runs = planes.view(row).reshape(c, gh // merge, merge, patch, gw // merge, merge)
    dst = out.view(row).reshape(gh // merge, gw // merge, merge, merge, c, patch)
    np.copyto(dst, runs.transpose(1, 4, 2, 5, 0, 3))


def _normalise(levels: np.ndarray, table: np.ndarray) -> np.ndarray:
    """uint8 ``[N, C·k]`` patches (channel-major columns) to float32 ``table[c, level]``."""
    n, width = levels.shape
    c = table.shape[0]
    out = np.empty((n, c, width // c), dtype=np.float32)
    grouped = levels.reshape(n, c, width // c)
    for ch in range(c):
        np.take(table[ch], grouped[:, ch], out=out[:, ch])
    return out.reshape(n, width)


@lru_cache(maxsize=256)
def _frame_positions(h: int, w: int, merge: int) -> np.ndarray:
    """(0, row, column) of each patch of one ``h×w`` frame, in merge-block order (read-only)."""
    bh, bw = h // merge, w // merge
    shape = (bh, bw, merge, merge)
    rows = np.arange(bh)[:, None, None, None] * merge + np.arange(merge)[None, None, :, None]
    cols = np.arange(bw)[None, :, None, None] * merge + np.arange(merge)[None, None, None, :]
    pos = np.zeros((*shape, 3), dtype=np.int64)
    pos[..., 1] = np.broadcast_to(rows, shape)
    pos[..., 2] = np.broadcast_to(cols, shape)
    pos = pos.reshape(h * w, 3)
    pos.setflags(write=False)
    return pos


def patch_positions(grid: Sequence[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """``[Σ t·h·w, 3]`` int64 (t, h, w) of every patch of each ``(t, h, w)`` grid row, rows
    in the processor's order: t-major, then merge blocks, then the patch within its block;
    t counts from 0 in each row (what the checkpoint's ``build_patch_positions`` gives
    without frame indices)."""
    out = np.empty((sum(t * h * w for t, h, w in grid), 3), dtype=np.int64)
    start = 0
    for t, h, w in grid:
        frame = out[start:start + t * h * w].reshape(t, h * w, 3)
        frame[:] = _frame_positions(h, w, merge)
        frame[:, :, 0] = np.arange(t)[:, None]
        start += t * h * w
    return torch.from_numpy(out)


# -- encoder -----------------------------------------------------------------------------


def _rotary_tables(positions: torch.Tensor, head_dim: int, theta: float, device: torch.device,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and signed ``sin`` ``[n, 1, head_dim]`` float32 from ``[n, 3]`` positions.

    Frequencies: ``head_dim/2`` split 4:6:6 over (t, h, w), each axis ``theta^-(i/size)``;
    the angle table is ``cat(f, f)``. The sign of the interleaved rotate-half (even lanes
    take ``-x[odd]``) is folded into ``sin``, so applying it is a pair swap and two products.
    The frequencies are built on the activations' ``device``: positions anywhere else fail
    at their first use.
    """
    unit = head_dim // 32
    angles = []
    for axis, size in enumerate((4 * unit, 6 * unit, 6 * unit)):
        inv = 1.0 / (theta ** (torch.arange(size, dtype=torch.float32, device=device) / size))
        angles.append(torch.outer(positions[:, axis].float(), inv))
    freqs = torch.cat(angles, dim=-1)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    sign = torch.ones(head_dim, dtype=torch.float32, device=device)
    sign[0::2] = -1.0
    return emb.cos(), emb.sin() * sign


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved rotary in float32, back to ``x``'s dtype."""
    xf = x.float()
    swapped = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return (xf * cos + swapped * sin).to(x.dtype)


def window_runs(grid: Sequence[tuple[int, int, int]], window: int) -> list[tuple[int, int]]:
    """The attention windows of a batch's grid rows as runs of (count, length): each row's
    frames are cut into windows of ``window`` frames (the last may be shorter), a window
    holding ``frames·h·w`` patches, and consecutive windows of one length are merged."""
    runs: list[tuple[int, int]] = []
    for t, h, w in grid:
        full, rest = divmod(t, window)
        for count, frames in ((full, window), (1 if rest else 0, rest)):
            if not count:
                continue
            length = frames * h * w
            if runs and runs[-1][1] == length:
                runs[-1] = (runs[-1][0] + count, length)
            else:
                runs.append((count, length))
    return runs


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                runs: Sequence[tuple[int, int]]) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv(x).view(n, 3, self.num_heads, -1)
        # q and k rotate together: one pass over both, the tables broadcast over the pair.
        q, k = _rotate(qkv[:, :2], cos[:, None], sin[:, None]).unbind(1)
        return self.proj(frame_attention(q, k, qkv[:, 2], runs))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Exact GELU whatever config.hidden_act says, as vLLM's tower does.
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = Attention(cfg.hidden_size, cfg.num_attention_heads)
        self.mlp = Mlp(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                runs: Sequence[tuple[int, int]]) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), cos, sin, runs)
        return x + self.mlp(self.layer_norm2(x))


class Embeddings(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        p = cfg.patch_size
        # Kernel == stride over one patch: a Linear over the flattened (C, P, P) row, kept a
        # Conv2d for the checkpoint's name and shape.
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, p, stride=p,
                                         bias=False)
        self.fold = PixelFold()

    def forward(self, pixels: torch.Tensor, normalize: Normalize) -> torch.Tensor:
        """uint8 levels go through the weight with ``normalize`` folded in (a bias appears:
        level 0 is not input 0); floating pixels, already normalised, through the weight."""
        weight = self.patch_embedding.weight
        if pixels.dtype == torch.uint8:
            folded, bias = self.fold(weight, None, normalize, 1)
            return F.linear(pixels.to(weight.dtype), folded.view(weight.shape[0], -1), bias)
        return F.linear(pixels.to(weight.dtype), weight.view(weight.shape[0], -1))


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        merged = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.ln_q = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = nn.Sequential(nn.Linear(merged, merged), nn.GELU(),
                                 nn.Linear(merged, cfg.text_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.mlp[0].in_features))


class VisionTower(nn.Module):
    """The OV2 vision tower (no CLS token, 3-D rotary, windowed attention) and its merger."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = Embeddings(cfg)
        self.layernorm_pre = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.encoder = Encoder(cfg)
        self.merger = PatchMerger(cfg)

    def forward(self, pixels: torch.Tensor, grid: Sequence[tuple[int, int, int]],
                positions: torch.Tensor, normalize: Normalize) -> torch.Tensor:
        """``pixels`` ``[Σ t·h·w, C·P·P]`` (uint8 levels of ``normalize``, or normalised
        floats) and ``positions`` ``[Σ t·h·w, 3]`` on the device, ``grid`` host ints per grid
        row."""
        x = self.layernorm_pre(self.embeddings(pixels, normalize))
        cos, sin = _rotary_tables(positions, self.cfg.head_dim, self.cfg.rope_theta, x.device)
        runs = window_runs(grid, self.cfg.frame_windows_size)
        for block in self.encoder.layers:
            x = block(x, cos, sin, runs)
        return self.merger(x)


# -- the model ---------------------------------------------------------------------------

_IMAGE = ("pixel_values", "image_grid_thw", "patch_positions", "image_embeds")
_VIDEO = ("pixel_values_videos", "video_grid_thw", "patch_positions_videos", "video_num_frames",
          "frame_timestamps", "video_is_codec", "codec_fps")
_VIDEO_HOST = ("video_num_frames", "frame_timestamps", "video_is_codec", "codec_fps")
_FIELDS = {"image": _IMAGE, "video": _VIDEO}
_PIXELS = ("pixel_values", "pixel_values_videos")


def _grid_rows(name: str, grid: Any) -> list[tuple[int, int, int]]:
    """Host ``(t, h, w)`` rows of a grid: a ``[rows, 3]`` tensor or a list of them."""
    if isinstance(grid, list | tuple):
        grid = torch.cat([torch.as_tensor(g).reshape(-1, 3) for g in grid]) if grid else \
            torch.empty(0, 3, dtype=torch.int64)
    if not isinstance(grid, torch.Tensor | np.ndarray) or grid.ndim != 2 or grid.shape[1] != 3:
        raise ContractError(f"expected integer [rows, 3], got {describe(grid)}", field=name)
    return [(int(t), int(h), int(w)) for t, h, w in grid.tolist()]


def _check_rows(name: str, rows: list[tuple[int, int, int]], merge: int) -> None:
    if any(min(r) < 1 or r[1] % merge or r[2] % merge for r in rows):
        raise ContractError(f"grid rows {rows} must be positive with h and w multiples of the "
                            f"merge size {merge}", field=name)


class LlavaOnevision2(nn.Module):
    """LLaVA-OneVision-2's multimodal encoder as the runtime drives it (see
    :class:`mmferry.encoder.model.EncoderModel`).

    Build with :func:`mmferry.models.load`. Parameters live under ``visual.``; the published
    checkpoint holds them under ``model.visual.``.
    """

    name = "llava-onevision2"
    modalities = ("image", "video")
    precomputed_fields = frozenset({"image_embeds"})
    checkpoint_prefixes: ClassVar[Mapping[str, str]] = MappingProxyType(
        {"model.visual.": "visual.", "visual.": "visual."})

    def __init__(self, config: VisionConfig = TINY,
                 processor_config: ProcessorConfig | None = None) -> None:
        super().__init__()
        pc = processor_config or ProcessorConfig()
        for key, ours, theirs in (("patch_size", pc.patch_size, config.patch_size),
                                  ("merge_size", pc.merge_size, config.spatial_merge_size)):
            if ours != theirs:
                raise ArgumentError(f"the processor's {key} {ours} differs from the vision "
                                    f"tower's {theirs}", argument=f"preprocessor_config.{key}")
        if pc.temporal_patch_size != 1:
            raise ArgumentError(f"OV2 patches single frames; temporal_patch_size must be 1, got "
                                f"{pc.temporal_patch_size}",
                                argument="preprocessor_config.temporal_patch_size")
        self.config = config
        self.processor_config = pc
        # What the processor's uint8 levels stand for (the pixel specs carry it).
        self.normalize = Normalize(pc.image_mean, pc.image_std, pc.rescale_factor)
        self.hidden_size = config.text_hidden_size
        self.visual = VisionTower(config)

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None,
                    folder: Path | None = None) -> LlavaOnevision2:
        """The tiny tower (``config=None``) or the one a ``config.json`` describes; a
        checkpoint folder's ``preprocessor_config.json`` sets the processor."""
        vision = TINY if config is None else VisionConfig.from_dict(config)
        processor = ProcessorConfig()
        if folder is not None and (folder / "preprocessor_config.json").is_file():
            processor = ProcessorConfig.from_dict(read_json(folder, "preprocessor_config.json"))
        return cls(vision, processor)

    # -- processor -------------------------------------------------------------------------

    def processor(self, *, images: Any = None, videos: Any = None, audios: Any = None,
                  min_pixels: int | None = None, max_pixels: int | None = None,
                  fps: float | Sequence[float] | None = None,
                  pixel_dtype: str = DEFAULT_PIXEL_DTYPE, resize_mode: str = DEFAULT_RESIZE_MODE,
                  **kwargs: Any) -> dict[str, torch.Tensor]:
        """Images and videos to vLLM 0.33's OV2 fields.

        Images: ``pixel_values`` ``[Σ h·w, C·P·P]``, ``image_grid_thw`` ``[n, 3]``
        and ``patch_positions`` ``[Σ h·w, 3]`` int64. Videos (as
        :func:`mmferry.media.as_videos` names them), frame backend:
        ``pixel_values_videos``, ``video_grid_thw`` (one ``(1, h, w)`` row per frame),
        ``patch_positions_videos``, ``video_num_frames`` ``[n]``, ``frame_timestamps``
        ``[n, max frames]`` float32 (frame index / ``fps``, zero padded) and
        ``video_is_codec`` ``[n]`` (zeros). An odd frame count is padded by repeating the
        last frame. ``fps``: the frames' rate, one for all videos or one per video (default
        1.0, vLLM's when a video carries none). ``min_pixels`` / ``max_pixels`` override the
        resize bounds. A modality without media has no fields in the output.

        ``pixel_dtype``: ``"uint8"`` (default) gives the pixel fields as uint8 levels, whose
        spec carries :attr:`normalize`; ``"float32"`` normalises them (transformers' output).
        ``resize_mode``: ``"fast"`` (default) resizes as transformers' torchvision
        ``Qwen2VLImageProcessor`` (vLLM's) does, ``"exact"`` as ``Qwen2VLImageProcessorPil``
        (float32 pixels equal to its output bit for bit).

        Raises:
            MediaError: a source cannot be decoded, breaks a limit, or has an aspect ratio
                above 200; it names the file or ``item N``.
            ArgumentError: audio, a bad ``fps``, ``pixel_dtype`` or ``resize_mode``, or an
                unknown option.
        """
        if kwargs:
            raise ArgumentError(f"unknown processor option(s) {sorted(kwargs)}; {self.name} "
                                "takes min_pixels, max_pixels, fps, pixel_dtype and resize_mode",
                                argument=sorted(kwargs)[0])
        check_pixel_options(pixel_dtype, resize_mode)
        if audios is not None:
            raise ArgumentError(f"{self.name} takes images and videos, not audio",
                                argument="audios")
        pc = self.processor_config
        bounds = (min_pixels or pc.min_pixels, max_pixels or pc.max_pixels)
        options = {"pixel_dtype": pixel_dtype, "resize_mode": resize_mode}
        out: dict[str, torch.Tensor] = {}
        images = [load_image(x, index=i) for i, x in enumerate(as_images(images))]
        if images:
            pixels, grid, positions = self._frames(images, *bounds, source="item", **options)
            out.update(pixel_values=pixels, image_grid_thw=grid, patch_positions=positions)
        videos = [load_video(v, index=i) for i, v in enumerate(as_videos(videos))]
        if videos:
            rates = self._rates(fps, len(videos))
            frames: list[Image.Image] = []
            stamps = []
            for video, rate in zip(videos, rates, strict=True):
                indices = list(range(len(video)))
                if len(video) % 2:  # the tower pairs frames: vLLM repeats the last one
                    video, indices = [*video, video[-1]], [*indices, indices[-1]]
                stamps.append([i / rate for i in indices])
                frames.extend(video)
            pixels, grid, positions = self._frames(frames, *bounds, source="video frame",
                                                    **options)
            counts = [len(s) for s in stamps]
            width = max(counts)
            timestamps = torch.zeros(len(stamps), width, dtype=torch.float32)
            for i, s in enumerate(stamps):
                timestamps[i, :len(s)] = torch.tensor(s, dtype=torch.float32)
            out.update(pixel_values_videos=pixels, video_grid_thw=grid,
                       patch_positions_videos=positions,
                       video_num_frames=torch.tensor(counts, dtype=torch.int64),
                       frame_timestamps=timestamps,
                       video_is_codec=torch.zeros(len(stamps), dtype=torch.int64))
        return out

    @staticmethod
    def _rates(fps: Any, n: int) -> list[float]:
        rates = [1.0] * n if fps is None else (
            [fps] * n if isinstance(fps, int | float) else list(fps))
        if len(rates) != n or not all(
                isinstance(r, int | float) and not isinstance(r, bool) and r > 0 for r in rates):
            raise ArgumentError(f"fps must be a positive number or one per video ({n}), got "
                                f"{fps!r}", argument="fps")
        return [float(r) for r in rates]

    def _frames(self, frames: list[Image.Image], min_pixels: int, max_pixels: int, *,
                source: str, pixel_dtype: str, resize_mode: str,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Frames through the image processor: pixels, one grid row each, positions."""
        pc = self.processor_config
        patch, merge = pc.patch_size, pc.merge_size
        sizes, grid = [], []
        for i, frame in enumerate(frames):
            width, height = frame.size
            try:
                h, w = smart_resize(height, width, patch * merge, min_pixels, max_pixels)
            except ValueError as e:
                raise MediaError(str(e), source=f"{source} {i}") from None
            sizes.append((h, w))
            grid.append((1, h // patch, w // patch))
        rows = [h * w for _, h, w in grid]
        levels = np.empty((sum(rows), self.config.num_channels * patch * patch), dtype=np.uint8)
        start = 0
        for frame, (h, w), n in zip(frames, sizes, rows, strict=True):
            pixels = resize(frame, h, w, mode=resize_mode, contiguous=False)
            patchify_into(levels[start:start + n], pixels.transpose(2, 0, 1), patch=patch,
                          merge=merge)
            start += n
        if pixel_dtype == "float32":
            # Reordered as uint8 first (a quarter of the bytes), then looked up.
            levels = _normalise(levels, _normalise_table(pc.image_mean, pc.image_std,
                                                         pc.rescale_factor, resize_mode))
        return (torch.from_numpy(levels), torch.tensor(grid, dtype=torch.int64).reshape(-1, 3),
                patch_positions(grid, merge))

    # -- contract --------------------------------------------------------------------------

    def field_specs(self, outputs: Mapping[str, Any]) -> dict[str, FieldSpec]:
        """vLLM 0.33's OV2 contract for exactly the fields present: pixels and positions
        split by patches per item, embeddings by tokens per image; the video grid by frames
        per video; grids and frame metadata on the host, positions on the device."""
        specs: dict[str, FieldSpec] = {}
        merge2 = self.config.spatial_merge_size ** 2
        image_present = [k for k in _IMAGE if outputs.get(k) is not None]
        if image_present:
            if "image_grid_thw" not in image_present:
                raise ContractError("image_grid_thw is needed to split it", field=image_present[0])
            grid = torch.as_tensor(outputs["image_grid_thw"]).reshape(-1, 3)
            patches = grid.prod(-1)
            specs["image_grid_thw"] = FieldSpec.batched("image", placement="host")
            for name in ("pixel_values", "patch_positions"):
                if name in image_present:
                    specs[name] = FieldSpec.flat_from_sizes(
                        "image", patches, normalize=self._pixel_normalize(outputs, name))
            if "image_embeds" in image_present:
                specs["image_embeds"] = FieldSpec.flat_from_sizes("image", patches // merge2)
        video_present = [k for k in _VIDEO if outputs.get(k) is not None]
        if video_present:
            for needed in ("video_grid_thw", "video_num_frames"):
                if needed not in video_present:
                    raise ContractError(f"{needed} is needed to split it", field=video_present[0])
            frames = torch.as_tensor(outputs["video_num_frames"]).reshape(-1)
            rows = torch.as_tensor(outputs["video_grid_thw"]).reshape(-1, 3).prod(-1)
            if int(frames.sum()) != rows.numel():
                raise ContractError(f"frames per video {frames.tolist()} do not add up to the "
                                    f"{rows.numel()} grid rows", field="video_num_frames")
            ends = frames.cumsum(0)
            patches = [int(rows[int(e) - int(n):int(e)].sum()) for e, n in
                       zip(ends.tolist(), frames.tolist(), strict=True)]
            specs["video_grid_thw"] = FieldSpec.flat_from_sizes("video", frames, placement="host")
            for name in ("pixel_values_videos", "patch_positions_videos"):
                if name in video_present:
                    specs[name] = FieldSpec.flat_from_sizes(
                        "video", patches, normalize=self._pixel_normalize(outputs, name))
            for name in _VIDEO_HOST:
                if name in video_present:
                    specs[name] = FieldSpec.batched("video", placement="host")
        return specs

    def _pixel_normalize(self, outputs: Mapping[str, Any], name: str) -> Normalize | None:
        """The pixel fields' normalisation when they hold uint8 levels, else none."""
        if name in _PIXELS and torch.as_tensor(outputs[name]).dtype == torch.uint8:
            return self.normalize
        return None

    def check_item(self, item: Mapping[str, Any]) -> None:
        """One item against its own grid: positive grid rows, multiples of the merge size
        (one row per image; one per frame, as many as ``video_num_frames`` says); pixels
        ``[patches, C·P·P]``, floating point or uint8 levels, with integer positions
        ``[patches, 3]``, or image embeddings ``[patches / merge², hidden]``. Levels need the
        item's spec to carry the model's :attr:`normalize` (a plain mapping has no spec: its
        levels are refused)."""
        modality = "video" if "video_grid_thw" in item else "image"
        names = _FIELDS[modality]
        unknown = set(item) - set(names)
        if unknown:
            raise ContractError(f"not a {self.name} {modality} field", field=sorted(unknown)[0])
        grid_name = names[1]
        grid = item.get(grid_name)
        if not isinstance(grid, torch.Tensor) or grid.is_floating_point():
            raise ContractError(f"expected integer (t, h, w) rows, got {describe(grid)}",
                                field=grid_name)
        rows = _grid_rows(grid_name, grid.reshape(1, -1) if modality == "image" else grid)
        merge = self.config.spatial_merge_size
        _check_rows(grid_name, rows, merge)
        if modality == "image" and (grid.shape != (3,) or rows[0][0] != 1):
            raise ContractError(f"expected one (1, h, w) row, got {grid.tolist()}",
                                field=grid_name)
        patches = sum(t * h * w for t, h, w in rows)
        if modality == "video":
            frames = item.get("video_num_frames")
            if not isinstance(frames, torch.Tensor) or frames.numel() != 1 or \
                    int(frames) != len(rows):
                raise ContractError(f"expected the item's frame count {len(rows)}, got "
                                    f"{describe(frames)}", field="video_num_frames")
        values, _, positions = names[:3]
        width = self.config.num_channels * self.config.patch_size ** 2
        checks = [(values, patches, width, True), (positions, patches, 3, False)]
        if modality == "image":
            checks.append(("image_embeds", patches // merge ** 2, self.hidden_size, True))
        for name, n, cols, floating in checks:
            if name not in item:
                continue
            value = item[name]
            levels = name == values and isinstance(value, torch.Tensor) and \
                value.dtype == torch.uint8
            if (not isinstance(value, torch.Tensor)
                    or (value.is_floating_point() != floating and not levels)
                    or tuple(value.shape) != (n, cols)):
                kind = "uint8 or floating point" if name == values else \
                    "floating point" if floating else "integer"
                raise ContractError(f"expected {kind} [{n}, {cols}] from {grid_name} {rows}, "
                                    f"got {describe(value)}", field=name)
            if levels:
                check_normalize(item, name, self.normalize)
        if modality == "image" and ("image_embeds" in item) == (values in item):
            raise ContractError(f"an item holds {values} or image_embeds", field=values)
        if modality == "video" and values not in item:
            raise ContractError("missing from the item", field=values)
        if values in item and positions not in item:
            raise ContractError(f"needed with {values}", field=positions)

    def tokens_per_item(self, item: Mapping[str, Any]) -> int:
        """``t·h·w / merge²`` summed over the item's host grid rows (one per image, one per
        frame of a video)."""
        for grid_name in ("image_grid_thw", "video_grid_thw"):
            if grid_name in item:
                grid = torch.as_tensor(item[grid_name]).reshape(-1, 3)
                rows = _grid_rows(grid_name, grid)
                return sum(t * h * w for t, h, w in rows) // self.config.spatial_merge_size ** 2
        raise ContractError("an item needs image_grid_thw or video_grid_thw to count its tokens",
                            field="image_grid_thw")

    # -- encoder ---------------------------------------------------------------------------

    def encode(self, **batch: Any) -> torch.Tensor:
        """One modality's batch to ``[Σ tokens, hidden_size]``.

        Pixels (uint8 levels, as :meth:`check_item` vetted them, or normalised floats) and
        positions (device) run the tower over the host grid rows;
        ``image_embeds`` pass through. Video frame metadata is accepted and, apart from
        ``video_num_frames`` (checked against the grid on the host), not used.
        """
        modalities = [m for m, names in _FIELDS.items() if any(k in batch for k in names)]
        if len(modalities) != 1:
            raise ContractError(f"a batch holds exactly one of image or video fields, got "
                                f"{sorted(batch)}", field=None)
        names = _FIELDS[modalities[0]]
        unknown = set(batch) - set(names)
        if unknown:
            raise ContractError(f"not a {self.name} field", field=sorted(unknown)[0])
        values, grid_name, positions_name = names[:3]
        if grid_name not in batch:
            raise ContractError("missing from the batch", field=grid_name)
        grid = _grid_rows(grid_name, batch[grid_name])
        merge = self.config.spatial_merge_size
        _check_rows(grid_name, grid, merge)
        if modalities[0] == "video":
            if "video_num_frames" not in batch:
                raise ContractError("missing from the batch", field="video_num_frames")
            frames = batch["video_num_frames"]
            counted = sum(int(n) for f in frames for n in torch.as_tensor(f).reshape(-1).tolist()) \
                if isinstance(frames, list) else sum(frames.reshape(-1).tolist())
            if counted != len(grid):
                raise ContractError(f"{counted} frames for {len(grid)} grid rows",
                                    field="video_num_frames")
        patches = sum(t * h * w for t, h, w in grid)
        if "image_embeds" in batch:
            if values in batch:
                raise ContractError(f"give {values} or image_embeds, not both",
                                    field="image_embeds")
            out = batch["image_embeds"]
            tokens = patches // merge ** 2
            if out.ndim != 2 or tuple(out.shape) != (tokens, self.hidden_size):
                raise ContractError(f"expected [{tokens}, {self.hidden_size}] from the grid, got "
                                    f"{list(out.shape)}", field="image_embeds")
            return out
        for name in (values, positions_name):
            if name not in batch:
                raise ContractError("missing from the batch", field=name)
        pixels, positions = batch[values], batch[positions_name]
        if pixels.ndim != 2 or pixels.shape[0] != patches:
            raise ContractError(f"expected {patches} rows from {grid_name}, got shape "
                                f"{list(pixels.shape)}", field=values)
        if pixels.dtype != torch.uint8 and not pixels.is_floating_point():
            raise ContractError(f"expected uint8 levels or floating point pixels, got "
                                f"{describe(pixels)}", field=values)
        if positions.ndim != 2 or tuple(positions.shape) != (patches, 3):
            raise ContractError(f"expected [{patches}, 3] from {grid_name}, got shape "
                                f"{list(positions.shape)}", field=positions_name)
        if not patches:
            weight = self.visual.embeddings.patch_embedding.weight
            return torch.empty(0, self.hidden_size, dtype=weight.dtype, device=weight.device)
        return self.visual(pixels, grid, positions, self.normalize)

    def dummy_inputs(self) -> dict[str, torch.Tensor]:
        """Processor output for two seeded images of different sizes and aspect ratios and
        two videos (4 frames, and 3 frames padded to 4, of different sizes), at small
        resize bounds."""
        rng = np.random.default_rng(0)
        images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((56, 84), (84, 112))]
        videos = [rng.integers(0, 256, (t, h, w, 3), dtype=np.uint8)
                  for t, h, w in ((4, 56, 56), (3, 56, 84))]
        return self.processor(images=images, videos=videos, min_pixels=56 * 56,
                              max_pixels=28 * 28 * 16)
