"""Ernie4.5-VL: its image/video processor, field contract, vision tower and resampler.

The processor emits uint8 pixel levels by default (resized, patchified, not normalised; the
pixel field's spec carries the CLIP normalisation, which the encoder folds into its patch
embedding) or, with ``pixel_dtype="float32"``, transformers' normalised values. Images: smart
resize, merge-block patch order, one frame per patch. With ``resize_mode="exact"`` the float32
output is ``Ernie4_5_VLMoeImageProcessorPil``'s bit for bit (Pillow's bicubic filter, its
rescale then normalise); with ``"fast"`` (the default) it is ``Ernie4_5_VLMoeImageProcessor``'s
(torch's antialiased bicubic on uint8, the fused rescale-and-normalise). Videos follow
``Ernie4_5_VLMoeVideoProcessor``: timestamps drawn on the frames when the checkpoint's video
processor config asks for it (``draw_on_frames``, with its font file), at most ``max_frames``
frames sampled evenly, an odd frame count padded with the last frame, one row per patch of
every frame; ``"fast"`` gives that processor's values bit for bit, ``"exact"`` resizes the
frames with Pillow and normalises as the PIL image processor does. The encoder is the
Ernie4.5-VL vision transformer and its ``VariableResolutionResamplerModel`` (2×2 spatial
merge, pairwise temporal merge, projection to the language model's width), with the public
checkpoint's parameter names.

Placement: ``image_grid_thw`` / ``video_grid_thw`` stay on the host. Everything derived from
them (split sizes, attention runs, rotary positions, the resampler's frame-pair indices) is
host math; the two derived tensors that meet device kernels (positions and frame-pair
indices) are uploaded once per call. No kernel reads the grid itself, so a device copy of it
would never be used.
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
from PIL import Image, ImageDraw, ImageFont
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
from mmferry.models.blocks import (
    ACTIVATIONS,
    PixelFold,
    RotaryBlock,
    check_normalize,
    describe,
    frame_rotary,
)
from mmferry.models.checkpoint import read_json
from mmferry.models.qwen2_vl import smart_resize
from mmferry.transfer import host_and_device, upload

__all__ = ["TINY", "Ernie45VL", "ErnieConfig", "ProcessorConfig"]

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _get(config: Mapping[str, Any], key: str, default: Any, kind: type | tuple[type, ...],
         where: str) -> Any:
    value = config.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ArgumentError(f"{where}{key} must be {getattr(kind, '__name__', kind)}, got "
                            f"{value!r}", argument="config")
    return value


@dataclass(frozen=True, slots=True)
class ErnieConfig:
    """The encoder's part of an Ernie4.5-VL ``config.json``; defaults are the published
    28B-A3B's (vision width 1280, 32 blocks, language model width 2560)."""

    depth: int = 32
    width: int = 1280  # the vision transformer's hidden size
    intermediate_size: int = 5120
    num_heads: int = 16
    hidden_act: str = "quick_gelu"
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_merge_size: int = 2
    rope_theta: float = 10000.0
    vision_eps: float = 1e-6  # the vision LayerNorms' (and the resampler's LayerNorms')
    hidden_size: int = 2560  # the language model's width: the resampler's output
    text_eps: float = 1e-5  # the resampler's final RMSNorm

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> ErnieConfig:
        """Read a checkpoint's ``config.json`` content: the transformers layout
        (``model_type`` ``ernie4_5_vl_moe``: ``vision_config`` + ``text_config``) or the
        original one (``vision_config`` with ``embed_dim`` / ``mlp_ratio``, the language
        model's ``hidden_size`` / ``rms_norm_eps`` and ``temporal_conv_size`` at the top)."""
        if not isinstance(config, Mapping):
            raise ArgumentError("config must be a mapping", argument="config")
        model_type = config.get("model_type")
        if model_type not in (None, "ernie4_5_vl_moe", "ernie4_5_moe_vl", "ernie4_5_vl"):
            raise ArgumentError(f"config is for model_type {model_type!r}, not 'ernie4_5_vl_moe'",
                                argument="config")
        vision = config.get("vision_config")
        if not isinstance(vision, Mapping):
            raise ArgumentError("config needs a vision_config mapping", argument="config")
        text = config.get("text_config") or config  # the original layout keeps it on top
        if not isinstance(text, Mapping):
            raise ArgumentError("text_config must be a mapping", argument="config")
        d, v, t = cls(), "vision_config.", "text_config." if "text_config" in config else ""
        width = _get(vision, "hidden_size", _get(vision, "embed_dim", d.width, int, v), int, v)
        if "embed_dim" in vision and vision["embed_dim"] != width:
            raise ArgumentError(f"vision_config.embed_dim {vision['embed_dim']} differs from "
                                f"vision_config.hidden_size {width}", argument="config")
        if "intermediate_size" in vision:
            inter = _get(vision, "intermediate_size", None, int, v)
        else:
            inter = int(width * _get(vision, "mlp_ratio", 4, int | float, v))
        rope = vision.get("rope_parameters") or {}
        theta = rope.get("rope_theta", vision.get("rope_theta", d.rope_theta))
        out = cls(
            depth=_get(vision, "depth", d.depth, int, v),
            width=width,
            intermediate_size=inter,
            num_heads=_get(vision, "num_heads", d.num_heads, int, v),
            hidden_act=_get(vision, "hidden_act", d.hidden_act, str, v),
            in_channels=_get(vision, "in_channels", d.in_channels, int, v),
            patch_size=_get(vision, "patch_size", d.patch_size, int, v),
            spatial_merge_size=_get(vision, "spatial_merge_size",
                                    config.get("spatial_conv_size", d.spatial_merge_size), int, v),
            temporal_merge_size=_get(vision, "temporal_merge_size",
                                     config.get("temporal_conv_size", d.temporal_merge_size),
                                     int, v),
            rope_theta=float(theta),
            vision_eps=float(_get(vision, "rms_norm_eps", d.vision_eps, int | float, v)),
            hidden_size=_get(text, "hidden_size", d.hidden_size, int, t),
            text_eps=float(_get(text, "rms_norm_eps", d.text_eps, int | float, t)),
        )
        if out.width % out.num_heads or (out.width // out.num_heads) % 4:
            raise ArgumentError(f"vision_config.hidden_size {out.width} must split into "
                                f"{out.num_heads} heads of a size divisible by 4 (2-D rotary)",
                                argument="config")
        if out.hidden_act not in ACTIVATIONS:
            raise ArgumentError(f"vision_config.hidden_act {out.hidden_act!r} is not supported; "
                                f"supported: {sorted(ACTIVATIONS)}", argument="config")
        if out.temporal_merge_size != 2:
            # The resampler pairs frames (even, odd); the reference supports nothing else.
            raise ArgumentError("vision_config.temporal_merge_size must be 2, got "
                                f"{out.temporal_merge_size}", argument="config")
        for name in ("depth", "width", "intermediate_size", "num_heads", "patch_size",
                     "spatial_merge_size", "hidden_size"):
            if getattr(out, name) < 1:
                raise ArgumentError(f"{name} must be positive, got {getattr(out, name)}",
                                    argument="config")
        return out


TINY = ErnieConfig(depth=2, width=32, intermediate_size=64, num_heads=2, hidden_size=48)


@dataclass(frozen=True, slots=True)
class ProcessorConfig:
    """Resize bounds, normalisation and frame limit; defaults are transformers' Ernie4.5-VL
    image and video processors'."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 6177
    video_min_pixels: int = 299 * 28 * 28
    video_max_pixels: int = 1196 * 28 * 28
    max_frames: int = 180
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    # Timestamps drawn on video frames with this TrueType font (the checkpoint's), or None.
    timestamp_font: str | None = None

    @classmethod
    def from_files(cls, image: Mapping[str, Any], video: Mapping[str, Any] | None,
                   folder: Path | None = None) -> ProcessorConfig:
        """Read ``preprocessor_config.json`` content (``size`` as transformers writes it, or
        ``min_pixels`` / ``max_pixels`` as the original processor does) and, when the folder
        has one, ``video_preprocessor_config.json`` (with ``draw_on_frames``, its ``font``
        file is looked up in ``folder``)."""
        out = cls()
        size = image.get("size") or {}
        vsize = (video or {}).get("size") or {}
        font = None
        if (video or {}).get("draw_on_frames"):
            name = video.get("font")
            if not isinstance(name, str) or folder is None or not (folder / name).is_file():
                raise ArgumentError(f"video_preprocessor_config.json draws timestamps with font "
                                    f"{name!r}, which the checkpoint folder lacks",
                                    argument="font")
            font = str(folder / name)
        try:
            return replace(
                out,
                min_pixels=int(image.get("min_pixels", size.get("shortest_edge", out.min_pixels))),
                max_pixels=int(image.get("max_pixels", size.get("longest_edge", out.max_pixels))),
                video_min_pixels=int(vsize.get("shortest_edge", out.video_min_pixels)),
                video_max_pixels=int(vsize.get("longest_edge", out.video_max_pixels)),
                max_frames=int((video or {}).get("max_frames", out.max_frames)),
                image_mean=tuple(float(x) for x in image.get("image_mean", out.image_mean)),
                image_std=tuple(float(x) for x in image.get("image_std", out.image_std)),
                rescale_factor=float(image.get("rescale_factor", out.rescale_factor)),
                timestamp_font=font,
            )
        except (TypeError, ValueError) as e:
            raise ArgumentError(f"bad processor config value: {e}", argument="config") from None


# -- processor ---------------------------------------------------------------------------


@lru_cache(maxsize=8)
def _pil_table(mean: tuple[float, ...], std: tuple[float, ...], scale: float) -> np.ndarray:
    """``[C, 256]`` float32: each uint8 value rescaled then normalised, with the arithmetic of
    transformers' Pillow backend (rescale in float64, cast to float32, normalise in float32),
    so a lookup gives its values bit for bit."""
    scaled = (np.arange(256, dtype=np.float64) * scale).astype(np.float32)
    m = np.asarray(mean, dtype=np.float32)[:, None]
    s = np.asarray(std, dtype=np.float32)[:, None]
    table = (scaled[None, :] - m) / s
    table.setflags(write=False)
    return table


@lru_cache(maxsize=8)
def _fused_table(mean: tuple[float, ...], std: tuple[float, ...], scale: float) -> np.ndarray:
    """``[C, 256]`` float32 with the torchvision processors' fused arithmetic: mean and std
    divided by the rescale factor in float32, then ``(value - mean) / std`` in float32."""
    m = (torch.tensor(mean) * (1.0 / scale))[:, None]
    s = (torch.tensor(std) * (1.0 / scale))[:, None]
    table = ((torch.arange(256, dtype=torch.float32)[None, :] - m) / s).numpy()
    table.setflags(write=False)
    return table


@lru_cache(maxsize=4)
def _patch_runs(c: int, h: int, w: int, patch: int, merge: int) -> torch.Tensor:
    """Where each ``patch``-wide run of patchified rows starts in a ``[C, H, W]`` frame, in
    units of ``patch``: one int64 per (merge-block row, merge-block column, row in block,
    column in block, channel, patch row)."""
    bh, bw, runs = h // (patch * merge), w // (patch * merge), w // patch
    block = (np.arange(bh)[:, None, None, None] * merge + np.arange(merge)[None, None, :, None])
    block = (block * patch * runs + np.arange(bw)[None, :, None, None] * merge
             + np.arange(merge)[None, None, None, :])
    inside = np.arange(c)[:, None] * h * runs + np.arange(patch)[None, :] * runs
    return torch.from_numpy((block[..., None, None] + inside).reshape(-1))


def _patchify_into(out: np.ndarray, planes: np.ndarray, table: np.ndarray | None, *,
                   patch: int, merge: int) -> None:
    """Write ``planes`` (one frame, uint8 ``[C, H, W]``) into ``out`` (``[H·W/P², C·P·P]``,
    uint8 when ``table`` is None, else float32).

    Rows run over (merge-block row, merge-block column, row in block, column in block);
    columns over (channel, patch row, patch column). uint8 levels are copied as they are: a
    contiguous frame as ``patch``-byte rows gathered by one ``index_select`` (a memcpy per
    run, faster than a strided copy of the same bytes), any other in one strided copy.
    float32 values are looked up per channel in ``table`` with one fancy index (numpy's
    ``take`` is several times slower on uint8 indices), then copied in patch order."""
    c, h, w = planes.shape
    if table is None and planes.flags.c_contiguous and planes.flags.writeable:
        runs = _patch_runs(c, h, w, patch, merge)
        torch.index_select(torch.from_numpy(planes).view(-1, patch), 0, runs,
                           out=torch.from_numpy(out).view(-1, patch))
        return
    bh, bw = h // (patch * merge), w // (patch * merge)
    dest = out.reshape(bh, bw, merge, merge, c, patch, patch)
    if table is None:
        dest[...] = planes.reshape(c, bh, merge, patch, bw, merge, patch).transpose(
            1, 4, 2, 5, 0, 3, 6)
        return
    for ch in range(c):
        dest[:, :, :, :, ch] = table[ch][planes[ch]].reshape(
            bh, merge, patch, bw, merge, patch).transpose(0, 3, 1, 4, 2, 5)


def _sample_indices(total: int, max_frames: int) -> list[int]:
    """Indices of at most ``max_frames`` of ``total`` frames, evenly spaced, as the video
    processor samples them."""
    if total <= max_frames:
        return list(range(total))
    return torch.arange(0, total, total / max_frames).int().tolist()


def _timestamp(index: int, fps: float) -> str:
    """``time: HH:MM:SS.ss`` of frame ``index``, with the video processor's float32
    arithmetic (its frame indices are an int32 tensor)."""
    seconds = torch.tensor(index, dtype=torch.int32) / fps
    hours = seconds // 3600
    seconds = seconds % 3600
    minutes = seconds // 60
    seconds = seconds % 60
    return f"time: {int(hours):02d}:{int(minutes):02d}:{float(seconds):05.02f}"


def _draw_timestamps(frames: list[Image.Image], indices: list[int], fps: float,
                     font_path: str) -> list[Image.Image]:
    """Each frame with its timestamp in the top-left corner, black on a white outline, in a
    font a tenth of the shorter side, as the video processor draws them."""
    size = int(min(*frames[0].size) * 0.1)  # the frames of a video share one size
    font = ImageFont.truetype(font_path, size)
    out = []
    for frame, index in zip(frames, indices, strict=True):
        frame = frame.copy()
        ImageDraw.Draw(frame).text((0, 0), _timestamp(index, fps), font=font, fill=(0, 0, 0),
                                   stroke_width=int(size * 0.1), stroke_fill=(255, 255, 255))
        out.append(frame)
    return out


# -- encoder -----------------------------------------------------------------------------


class PatchEmbed(nn.Module):
    """A linear map of each patch's ``C·P·P`` values (channel-major). uint8 levels go
    through the weight with ``normalize`` folded in (a bias appears), so no normalising pass
    runs on the device; floating pixels (already normalised) through the weight itself."""

    def __init__(self, cfg: ErnieConfig) -> None:
        super().__init__()
        self.channels = cfg.in_channels
        self.proj = nn.Linear(cfg.in_channels * cfg.patch_size ** 2, cfg.width, bias=False)
        self.fold = PixelFold()

    def forward(self, pixels: torch.Tensor, normalize: Normalize) -> torch.Tensor:
        weight = self.proj.weight
        if pixels.dtype != torch.uint8:
            return self.proj(pixels.to(weight.dtype))
        folded, bias = self.fold(weight.view(weight.shape[0], self.channels, -1), None,
                                 normalize, channel_dim=1)
        return F.linear(pixels.to(weight.dtype), folded.flatten(1), bias)


class VisionTransformer(nn.Module):
    """Linear patch embedding, blocks with 2-D rotary positions and per-frame attention, and
    a final LayerNorm; one output row per patch."""

    def __init__(self, cfg: ErnieConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(
            RotaryBlock(cfg.width, cfg.num_heads, cfg.intermediate_size, cfg.hidden_act,
                        cfg.vision_eps) for _ in range(cfg.depth))
        self.ln = nn.LayerNorm(cfg.width, eps=cfg.vision_eps)

    def forward(self, pixels: torch.Tensor, grid: Sequence[tuple[int, int, int]],
                normalize: Normalize) -> torch.Tensor:
        """``pixels`` ``[Σ t·h·w, C·P·P]`` on the device (uint8 levels that ``normalize``
        describes, or normalised floats), ``grid`` host ints per item."""
        x = self.patch_embed(pixels, normalize)
        cos, sin, runs = frame_rotary(grid, self.cfg.spatial_merge_size,
                                      self.cfg.width // self.cfg.num_heads, self.cfg.rope_theta,
                                      x.device)
        for block in self.blocks:
            x = block(x, cos, sin, runs)
        return self.ln(x)


def _mlp(dim_in: int, dim_out: int, eps: float) -> nn.Sequential:
    # Linear, GELU, Linear, LayerNorm: a Sequential so the names are the checkpoint's
    # (``0``, ``2``, ``3``).
    return nn.Sequential(nn.Linear(dim_in, dim_out), nn.GELU(), nn.Linear(dim_out, dim_out),
                         nn.LayerNorm(dim_out, eps=eps))


def _pair_rows(grid: Sequence[tuple[int, int, int]], merge: int) -> np.ndarray | None:
    """Rows of the spatially merged features that the temporal merge concatenates, as one
    ``[tokens * 2]`` index (first frame of a pair, second frame of a pair, next token, ...).

    An item's frames pair up (0, 1), (2, 3), ...; a still image (t == 1) pairs with itself.
    ``None`` when every item is a still image: then the pair is one row repeated, which
    :meth:`Resampler.forward` folds into the weights instead of gathering."""
    if all(t == 1 for t, _, _ in grid):
        return None
    parts, offset = [], 0
    for t, h, w in grid:
        frame = h * w // merge ** 2
        rows = np.arange(t * frame).reshape(t, frame)
        pairs = np.stack([rows, rows], 1) if t == 1 else rows.reshape(t // 2, 2, frame)
        parts.append(pairs.transpose(0, 2, 1).reshape(-1) + offset)
        offset += t * frame
    return np.concatenate(parts)


class Resampler(nn.Module):
    """``VariableResolutionResamplerModel``: each 2×2 merge block's four patch rows are
    concatenated and mapped (``spatial_linear``), each pair of frames is concatenated and
    mapped (``temporal_linear``), then projected to the language model's width (``mlp``,
    ``after_norm``)."""

    def __init__(self, cfg: ErnieConfig) -> None:
        super().__init__()
        self.merge = cfg.spatial_merge_size
        spatial = cfg.width * self.merge ** 2
        self.spatial_linear = _mlp(spatial, spatial, cfg.vision_eps)
        self.temporal_linear = _mlp(spatial * cfg.temporal_merge_size, spatial, cfg.vision_eps)
        self.mlp = nn.Linear(spatial, cfg.hidden_size)
        self.after_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.text_eps)

    def forward(self, x: torch.Tensor, grid: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """``x`` ``[Σ t·h·w, width]`` from the vision transformer, ``grid`` host ints."""
        x = self.spatial_linear(x.reshape(-1, x.shape[-1] * self.merge ** 2))
        first = self.temporal_linear[0]
        pairs = _pair_rows(grid, self.merge)
        if pairs is None:
            # Still images only: [x, x] @ [A | B]^T == x @ (A + B)^T, half the multiply.
            half = x.shape[-1]
            weight = first.weight[:, :half] + first.weight[:, half:]
            x = F.linear(x, weight, first.bias)
        else:
            index = upload(torch.from_numpy(pairs), x.device)
            x = first(x.index_select(0, index).view(-1, 2 * x.shape[-1]))
        for layer in self.temporal_linear[1:]:
            x = layer(x)
        x = self.mlp(x)
        # The reference's RMSNorm: float32 statistics, scaled in the input dtype.
        normed = F.rms_norm(x.float(), x.shape[-1:], eps=self.after_norm.eps).to(x.dtype)
        return self.after_norm.weight * normed


# -- the model ---------------------------------------------------------------------------

_FIELDS = {
    "image": ("pixel_values", "image_grid_thw"),
    "video": ("pixel_values_videos", "video_grid_thw"),
}


def _grid_rows(name: str, grid: Any) -> list[tuple[int, int, int]]:
    """The (t, h, w) rows of a host grid: a ``[n, 3]`` tensor or array, or a sequence of
    rows."""
    if isinstance(grid, torch.Tensor | np.ndarray):
        if grid.ndim != 2:
            raise ContractError(f"expected [items, 3], got shape {list(grid.shape)}", field=name)
        rows = grid.tolist()
    else:
        rows = [g.tolist() if isinstance(g, torch.Tensor) else list(g) for g in grid]
    if any(len(r) != 3 for r in rows):
        raise ContractError(f"expected rows of (t, h, w), got {rows}", field=name)
    return [(int(t), int(h), int(w)) for t, h, w in rows]


class Ernie45VL(nn.Module):
    """Ernie4.5-VL's multimodal encoder as the runtime drives it (see
    :class:`mmferry.encoder.model.EncoderModel`).

    Build with :func:`mmferry.models.load`. Parameters live under ``vision_model.`` and
    ``resampler_model.`` with the public checkpoint's names. ``normalize`` (a
    :class:`~mmferry.fields.Normalize` from the processor config's mean, std and rescale
    factor) is what uint8 pixel levels stand for: the processor's uint8 fields carry it,
    ``check_item`` requires it, and the patch embedding folds it into its weight.
    """

    name = "ernie4.5-vl"
    modalities = ("image", "video")
    precomputed_fields: frozenset[str] = frozenset()
    # Checkpoint key prefix -> our name prefix: the public layout (``vision_model.``,
    # ``model.resampler_model.``), what transformers' save_pretrained writes
    # (``model.vision_model.``), and its in-memory names (``model.vision_tower.``, the
    # resampler's MLPs as ``fc1`` / ``fc2`` / ``ln``).
    checkpoint_prefixes: ClassVar[Mapping[str, str]] = MappingProxyType({
        "vision_model.": "vision_model.",
        "model.vision_model.": "vision_model.",
        "model.vision_tower.": "vision_model.",
        "model.resampler_model.": "resampler_model.",
        **{f"model.resampler_model.{m}.{hf}.": f"resampler_model.{m}.{ours}."
           for m in ("spatial_linear", "temporal_linear")
           for hf, ours in (("fc1", "0"), ("fc2", "2"), ("ln", "3"))},
    })

    def __init__(self, config: ErnieConfig = TINY,
                 processor_config: ProcessorConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.processor_config = processor_config or ProcessorConfig()
        pc = self.processor_config
        # What uint8 pixel levels stand for: the spec of every uint8 pixel field carries it.
        self.normalize = Normalize(pc.image_mean, pc.image_std, pc.rescale_factor)
        self.hidden_size = config.hidden_size
        self.vision_model = VisionTransformer(config)
        self.resampler_model = Resampler(config)

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None,
                    folder: Path | None = None) -> Ernie45VL:
        """The tiny encoder (``config=None``) or the one a ``config.json`` describes; a
        checkpoint folder's ``preprocessor_config.json`` (and
        ``video_preprocessor_config.json``) set the processor."""
        arch = TINY if config is None else ErnieConfig.from_dict(config)
        processor = ProcessorConfig()
        if folder is not None and (folder / "preprocessor_config.json").is_file():
            video = None
            if (folder / "video_preprocessor_config.json").is_file():
                video = read_json(folder, "video_preprocessor_config.json")
            processor = ProcessorConfig.from_files(
                read_json(folder, "preprocessor_config.json"), video, folder)
        return cls(arch, processor)

    # -- processor -----------------------------------------------------------------------

    def processor(self, *, images: Any = None, videos: Any = None, audios: Any = None,
                  min_pixels: int | None = None, max_pixels: int | None = None,
                  fps: float | None = None, pixel_dtype: str = DEFAULT_PIXEL_DTYPE,
                  resize_mode: str = DEFAULT_RESIZE_MODE, **kwargs: Any) -> dict[str, torch.Tensor]:
        """Images and videos to ``pixel_values`` ``[Σ h·w, C·P·P]`` and ``image_grid_thw``
        ``[n, 3]`` int64 (t = 1), and ``pixel_values_videos`` ``[Σ t·h·w, C·P·P]`` /
        ``video_grid_thw`` (t = frames, padded to even).

        ``images``: one image or a sequence, each anything :func:`mmferry.media.load_image`
        takes. ``videos``: videos as :func:`mmferry.media.as_videos` names them (files,
        frame folders, frames, ``T×H×W×C`` arrays). When the checkpoint's video processor
        draws timestamps (``draw_on_frames``), each frame gets its time at ``fps`` frames
        per second (default 24, transformers' fallback); otherwise none are drawn.
        ``min_pixels`` / ``max_pixels`` override the resize bounds of both. A modality
        without media has no fields in the output.

        ``pixel_dtype``: ``"uint8"`` (default) gives the resized levels, not normalised, for
        the encoder to normalise in its first layer (:attr:`normalize` says how);
        ``"float32"`` gives transformers' normalised values. ``resize_mode``: ``"fast"``
        (default; torch's uint8 filter, transformers' torchvision processors, which vLLM
        uses) or ``"exact"`` (Pillow's filter, transformers' PIL image processor).

        Raises:
            MediaError: a source cannot be decoded, breaks a limit, or has an aspect ratio
                above 200; it names the file or ``item N``.
            ArgumentError: audio, a non-positive ``fps``, an unknown ``pixel_dtype`` /
                ``resize_mode``, or another option.
        """
        if kwargs:
            raise ArgumentError(f"unknown processor option(s) {sorted(kwargs)}; ernie4.5-vl "
                                "takes min_pixels, max_pixels, fps, pixel_dtype and resize_mode",
                                argument=sorted(kwargs)[0])
        check_pixel_options(pixel_dtype, resize_mode)
        if fps is not None and not (isinstance(fps, int | float) and fps > 0):
            raise ArgumentError(f"fps must be a positive number, got {fps!r}", argument="fps")
        if audios is not None:
            raise ArgumentError("ernie4.5-vl takes images and videos, not audio",
                                argument="audios")
        pc = self.processor_config
        out: dict[str, torch.Tensor] = {}
        loaded = [load_image(x, index=i) for i, x in enumerate(as_images(images))]
        if loaded:
            self._process(out, "image", [[img] for img in loaded], min_pixels or pc.min_pixels,
                          max_pixels or pc.max_pixels, pixel_dtype, resize_mode)
        clips = []
        for i, source in enumerate(as_videos(videos)):
            frames = load_video(source, index=i, max_frames=pc.max_frames)
            indices = _sample_indices(len(frames), pc.max_frames)
            frames = [frames[j] for j in indices]
            if pc.timestamp_font is not None:
                frames = _draw_timestamps(frames, indices, fps or 24.0, pc.timestamp_font)
            clips.append(frames)
        if clips:
            self._process(out, "video", clips, min_pixels or pc.video_min_pixels,
                          max_pixels or pc.video_max_pixels, pixel_dtype, resize_mode)
        return out

    def _process(self, out: dict[str, torch.Tensor], modality: str,
                 media: list[list[Image.Image]], min_pixels: int, max_pixels: int,
                 pixel_dtype: str, resize_mode: str) -> None:
        cfg, pc = self.config, self.processor_config
        patch, merge = cfg.patch_size, cfg.spatial_merge_size
        sizes, grids = [], []
        for i, frames in enumerate(media):
            width, height = frames[0].size
            try:
                h, w = smart_resize(height, width, patch * merge, min_pixels, max_pixels)
            except ValueError as e:
                raise MediaError(str(e), source=f"item {i}") from None
            t = len(frames) + len(frames) % 2 if modality == "video" else 1
            sizes.append((h, w))
            grids.append((t, h // patch, w // patch))
        frame_rows = [gh * gw for _, gh, gw in grids]
        total = sum(t * n for (t, _, _), n in zip(grids, frame_rows, strict=True))
        dtype = torch.uint8 if pixel_dtype == "uint8" else torch.float32
        pixels = torch.empty((total, cfg.in_channels * patch * patch), dtype=dtype)
        # Each mode normalises with the arithmetic of the transformers processors it matches.
        table = None if pixel_dtype == "uint8" else (
            _pil_table if resize_mode == "exact" else _fused_table)(
            tuple(pc.image_mean), tuple(pc.image_std), pc.rescale_factor)
        rows, start = pixels.numpy(), 0
        for frames, (h, w), n in zip(media, sizes, frame_rows, strict=True):
            for frame in frames:
                # [C, H, W]: the fast kernel's own contiguous planes, else a transposed view.
                planes = resize(frame, h, w, mode=resize_mode, contiguous=False).transpose(2, 0, 1)
                _patchify_into(rows[start:start + n], planes, table, patch=patch, merge=merge)
                start += n
            if modality == "video" and len(frames) % 2:
                # An odd clip is padded with its last frame, already in place just above.
                rows[start:start + n] = rows[start - n:start]
                start += n
        values, grid_name = _FIELDS[modality]
        out[values] = pixels
        out[grid_name] = torch.tensor(grids, dtype=torch.int64).reshape(-1, 3)

    # -- contract ------------------------------------------------------------------------

    def field_specs(self, outputs: Mapping[str, Any]) -> dict[str, FieldSpec]:
        """Pixels split by the grid (``t·h·w`` rows per item), uint8 levels with the model's
        :attr:`normalize`; grids are per item and stay on the host. Names exactly the fields
        present in ``outputs``."""
        specs: dict[str, FieldSpec] = {}
        for modality, (values, grid_name) in _FIELDS.items():
            if outputs.get(grid_name) is None:
                if outputs.get(values) is not None:
                    raise ContractError(f"{grid_name} is needed to split it", field=values)
                continue
            patches = torch.as_tensor(outputs[grid_name]).reshape(-1, 3).prod(-1)
            specs[grid_name] = FieldSpec.batched(modality, placement="host")
            pixels = outputs.get(values)
            if pixels is not None:
                levels = isinstance(pixels, torch.Tensor) and pixels.dtype == torch.uint8
                specs[values] = FieldSpec.flat_from_sizes(
                    modality, patches, normalize=self.normalize if levels else None)
        return specs

    def _tokens(self, t: int, h: int, w: int) -> int:
        # Frames merge in pairs; a still image pairs with itself.
        pairs = 1 if t == 1 else t // self.config.temporal_merge_size
        return pairs * h * w // self.config.spatial_merge_size ** 2

    def _check_grid(self, grid_name: str, rows: Sequence[tuple[int, int, int]]) -> None:
        merge = self.config.spatial_merge_size
        for t, h, w in rows:
            still = grid_name == "image_grid_thw"
            if (min(t, h, w) < 1 or h % merge or w % merge or (still and t != 1)
                    or (not still and t % self.config.temporal_merge_size)):
                frames = "t == 1" if still else f"t a multiple of {self.config.temporal_merge_size}"
                raise ContractError(f"grid (t, h, w) = {(t, h, w)} must be positive with {frames} "
                                    f"and h, w multiples of the merge size {merge}",
                                    field=grid_name)

    def check_item(self, item: Mapping[str, Any]) -> None:
        """One integer grid row (t = 1 for an image, an even t for a video; h and w multiples
        of the merge size) and pixels ``[t·h·w, C·P·P]``: floating point, or uint8 whose spec
        carries the model's :attr:`normalize` (an item without specs has no normalisation)."""
        modality = next((m for m, names in _FIELDS.items() if names[1] in item), None)
        if modality is None:
            raise ContractError("an item needs image_grid_thw or video_grid_thw",
                                field="image_grid_thw")
        values, grid_name = _FIELDS[modality]
        unknown = set(item) - set(_FIELDS[modality])
        if unknown:
            raise ContractError(f"not an ernie4.5-vl {modality} field", field=sorted(unknown)[0])
        grid = item[grid_name]
        if not isinstance(grid, torch.Tensor) or grid.shape != (3,) or grid.is_floating_point():
            raise ContractError(f"expected one integer (t, h, w) row, got {describe(grid)}",
                                field=grid_name)
        rows = _grid_rows(grid_name, [grid])
        self._check_grid(grid_name, rows)
        (t, h, w), cfg = rows[0], self.config
        width = cfg.in_channels * cfg.patch_size ** 2
        value = item.get(values)
        if (not isinstance(value, torch.Tensor)
                or not (value.is_floating_point() or value.dtype == torch.uint8)
                or tuple(value.shape) != (t * h * w, width)):
            raise ContractError(f"expected floating point or uint8 [{t * h * w}, {width}] from "
                                f"{grid_name} {(t, h, w)}, got {describe(value)}", field=values)
        if value.dtype == torch.uint8:
            check_normalize(item, values, self.normalize)

    def tokens_per_item(self, item: Mapping[str, Any]) -> int:
        """From the item's host grid: ``h·w / merge²`` for an image, ``t·h·w / (merge² ·
        temporal_merge_size)`` for a video."""
        for _, grid_name in _FIELDS.values():
            if grid_name in item:
                ((t, h, w),) = _grid_rows(grid_name, [item[grid_name]])
                return self._tokens(t, h, w)
        raise ContractError("an item needs image_grid_thw or video_grid_thw to count its tokens",
                            field="image_grid_thw")

    def encode(self, **batch: Any) -> torch.Tensor:
        """One modality's batch to ``[Σ tokens, hidden_size]``: the vision transformer, then
        the resampler. The grid is read on the host only; the pixels must be on the model's
        device."""
        modalities = [m for m, names in _FIELDS.items() if any(k in batch for k in names)]
        if len(modalities) != 1:
            raise ContractError(f"a batch holds exactly one of image or video fields, got "
                                f"{sorted(batch)}", field=None)
        values, grid_name = _FIELDS[modalities[0]]
        unknown = set(batch) - {values, grid_name}
        if unknown:
            raise ContractError("not an ernie4.5-vl field", field=sorted(unknown)[0])
        if grid_name not in batch:
            raise ContractError("missing from the batch", field=grid_name)
        # A `both` placement works too; only its host side is ever read.
        grid_host, _ = host_and_device(batch[grid_name])
        grid = _grid_rows(grid_name, grid_host)
        self._check_grid(grid_name, grid)
        pixels = batch.get(values)
        if pixels is None:
            raise ContractError("missing from the batch", field=values)
        rows = sum(t * h * w for t, h, w in grid)
        if pixels.ndim != 2 or pixels.shape[0] != rows:
            raise ContractError(f"expected {rows} rows from {grid_name}, got shape "
                                f"{list(pixels.shape)}", field=values)
        if not rows:
            weight = self.resampler_model.mlp.weight
            return torch.empty(0, self.hidden_size, dtype=weight.dtype, device=weight.device)
        return self.resampler_model(self.vision_model(pixels, grid, self.normalize), grid)

    def dummy_inputs(self) -> dict[str, torch.Tensor]:
        """Processor output for two small seeded images of different sizes and two videos
        (4 frames, and 3 frames padded to 4), at small resize bounds."""
        rng = np.random.default_rng(0)
        images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((56, 84), (84, 112))]
        videos = [rng.integers(0, 256, (t, h, w, 3), dtype=np.uint8)
                  for t, h, w in ((4, 56, 56), (3, 56, 84))]
        return self.processor(images=images, videos=videos, min_pixels=56 * 56,
                              max_pixels=28 * 28 * 16)

