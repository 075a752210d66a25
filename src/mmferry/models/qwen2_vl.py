"""Qwen2-VL: its image/video processor, field contract and vision encoder.

The processor resizes as transformers' ``Qwen2VLImageProcessorPil`` (``resize_mode="exact"``,
Pillow's bicubic filter) or its torchvision ``Qwen2VLImageProcessor`` (``"fast"``, the
default), then patchifies in the merge-block patch order. By default the patches stay uint8
levels with the CLIP normalisation declared in their field spec, and an image is sent once
rather than repeated over the temporal patch; the encoder folds both into its patch
embedding. ``pixel_dtype="float32"`` gives transformers' normalised, repeated patches.

The encoder is the Qwen2-VL vision tower (``Qwen2VisionTransformerPretrainedModel``) with the
public checkpoint's parameter names under ``visual.``.

Placement: ``image_grid_thw`` / ``video_grid_thw`` stay on the host. Everything derived from
them (split sizes, attention runs, rotary positions) is host math; the one derived tensor that
meets device kernels, the rotary position table, is uploaded once per call.
"""

from __future__ import annotations

import math
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
from mmferry.media.resize import DEFAULT_PIXEL_DTYPE, DEFAULT_RESIZE_MODE, check_pixel_options, resize
from mmferry.models.blocks import (
    ACTIVATIONS,
    PixelFold,
    RotaryBlock,
    check_normalize,
    describe,
    frame_rotary,
)
from mmferry.models.checkpoint import config_values, read_json

__all__ = ["TINY", "ProcessorConfig", "Qwen2VL", "VisionConfig", "smart_resize"]

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """The vision part of a Qwen2-VL ``config.json`` (``vision_config``); defaults are 7B's."""

    depth: int = 32
    embed_dim: int = 1280
    hidden_size: int = 3584  # the merger's output size, the language model's width
    num_heads: int = 16
    mlp_ratio: float = 4.0
    hidden_act: str = "quick_gelu"
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    rope_theta: float = 10000.0

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> VisionConfig:
        """Read a checkpoint's ``config.json`` content (or its ``vision_config`` alone)."""
        model_type = config.get("model_type")
        where = ""
        if "vision_config" in config:
            if model_type not in (None, "qwen2_vl"):
                raise ArgumentError(
                    f"config is for model_type {model_type!r}, not 'qwen2_vl'", argument="config"
                )
            config, where = config["vision_config"], "vision_config"
            if not isinstance(config, Mapping):
                raise ArgumentError(f"vision_config must be an object, got {config!r}",
                                    argument="config")
        vision = dict(config)
        # Older checkpoints spell these differently.
        for old, new in (("in_chans", "in_channels"), ("spatial_patch_size", "patch_size")):
            if old in vision:
                vision.setdefault(new, vision[old])
        rope = vision.get("rope_parameters") or {}
        if isinstance(rope, Mapping) and "rope_theta" in rope:
            vision["rope_theta"] = rope["rope_theta"]
        out = cls(**config_values(cls, vision, where))
        if out.embed_dim % out.num_heads or (out.embed_dim // out.num_heads) % 4:
            raise ArgumentError(
                f"embed_dim {out.embed_dim} must split into {out.num_heads} heads of a size "
                "divisible by 4 (2-D rotary)", argument="config")
        if out.hidden_act not in ACTIVATIONS:
            raise ArgumentError(f"unsupported hidden_act {out.hidden_act!r}; supported: "
                                f"{sorted(ACTIVATIONS)}", argument="config")
        return out


TINY = VisionConfig(depth=2, embed_dim=32, hidden_size=64, num_heads=2)


@dataclass(frozen=True, slots=True)
class ProcessorConfig:
    """Resize bounds and normalisation; defaults are transformers' Qwen2-VL image and video
    processors'."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 28 * 28 * 768
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> ProcessorConfig:
        """Read a checkpoint's ``preprocessor_config.json`` content."""
        size = config.get("size") or {}
        if not isinstance(size, Mapping):
            raise ArgumentError(f"size must be an object, got {size!r}", argument="config")
        values = {k: config[k] for k in ("min_pixels", "max_pixels", "image_mean", "image_std")
                  if k in config}
        for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            if key not in values and edge in size:
                values[key] = size[edge]
        out = replace(cls(), **config_values(cls, values, ""))
        check_resize_bounds(out.min_pixels, out.max_pixels, argument="config")
        if any(s == 0 for s in out.image_std):
            raise ArgumentError(f"image_std must not hold 0, got {list(out.image_std)}",
                                argument="config")
        return out


# Bounds on the resize options. max_pixels: Qwen's own documentation goes up to 16384
# patches of 28x28. min_pixels is a floor for small images; above the default max_pixels
# (about a megapixel) it would only upscale tiny images into huge tensors (a 1x1 image with
# min_pixels=10**8 would become a 2.4 GB float tensor).
MAX_RESIZE_PIXELS = 28 * 28 * 16384
MAX_MIN_PIXELS = 28 * 28 * 1280


def check_resize_bounds(min_pixels: Any, max_pixels: Any, *, argument: str) -> None:
    """``min_pixels`` / ``max_pixels`` as positive ints with ``min <= max``, ``min`` at most
    :data:`MAX_MIN_PIXELS` and ``max`` at most :data:`MAX_RESIZE_PIXELS`.

    Raises:
        ArgumentError: naming the option (and ``argument``) and the bound.
    """
    for name, value, high in (("min_pixels", min_pixels, MAX_MIN_PIXELS),
                              ("max_pixels", max_pixels, MAX_RESIZE_PIXELS)):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= high:
            raise ArgumentError(f"{name} must be an int in [1, {high}], got {value!r}",
                                argument=name if argument == "options" else argument)
    if min_pixels > max_pixels:
        raise ArgumentError(f"min_pixels {min_pixels} is above max_pixels {max_pixels}",
                            argument="min_pixels" if argument == "options" else argument)


def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """The size Qwen2-VL resizes an image to: both sides multiples of ``factor``, the area
    within ``[min_pixels, max_pixels]``, the aspect ratio kept as closely as that allows.

    Raises ``ValueError`` when the aspect ratio exceeds 200.
    """
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} exceeds 200")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    return h, w


# -- processor ---------------------------------------------------------------------------


@lru_cache(maxsize=8)
def _normalise_table(mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """``[C, 256]`` float32: every uint8 value rescaled and normalised per channel.

    The arithmetic is transformers' (rescale in float64, cast to float32, then subtract and
    divide in float32), so a table lookup gives its values bit for bit in one pass.
    """
    scaled = (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32)
    m = np.asarray(mean, dtype=np.float32)[:, None]
    s = np.asarray(std, dtype=np.float32)[:, None]
    table = (scaled[None, :] - m) / s
    table.setflags(write=False)
    return table


def _patch_order(frames: np.ndarray, *, patch: int, merge: int, per_patch: int) -> np.ndarray:
    """``frames`` (uint8 ``[T, H, W, C]``) as a view ``[N, C, per_patch·P·P]`` in patch order:
    transformers' columns, for the float32 output.

    Rows run over (t, merge-block row, merge-block column, row in block, column in block);
    columns over (channel, frame in the temporal patch, patch row, patch column).
    """
    t, h, w, c = frames.shape
    gh, gw = h // patch, w // patch
    n = (t // per_patch) * gh * gw
    return frames.reshape(
        t // per_patch, per_patch, gh // merge, merge, patch, gw // merge, merge, patch, c
    ).transpose(0, 2, 5, 3, 6, 8, 1, 4, 7).reshape(n, c, per_patch * patch * patch)


def _level_order(frames: np.ndarray, *, patch: int, merge: int, per_patch: int) -> np.ndarray:
    """``frames`` (uint8 ``[T, H, W, C]``) as a view ``[N, per_patch, P·P·C]`` in patch order:
    the uint8 columns, channel last (frame in the temporal patch, patch row, patch column,
    channel), so each patch row is one run of P·C bytes of the frame: half the cost of
    gathering channel-major columns. The encoder reads its weight in the same order."""
    t, h, w, c = frames.shape
    gh, gw = h // patch, w // patch
    n = (t // per_patch) * gh * gw
    return frames.reshape(
        t // per_patch, per_patch, gh // merge, merge, patch, gw // merge, merge, patch * c
    ).transpose(0, 2, 5, 3, 6, 1, 4, 7).reshape(n, per_patch, patch * patch * c)


def _normalise_into(out: np.ndarray, ordered: np.ndarray, table: np.ndarray, temporal: int) -> None:
    """Look ``ordered`` (uint8 ``[N, C, k·P·P]``) up in ``table`` into ``out``
    (``[N, C·temporal·P·P]`` float32), repeating a single frame over the temporal patch as
    transformers does. Reordering the uint8 levels first moves a quarter of the bytes."""
    n, c, width = ordered.shape
    repeat = out.shape[1] // (c * width)
    dest = out.reshape(n, c, repeat, width)
    values = np.empty((n, width), dtype=np.float32)
    for ch in range(c):
        np.take(table[ch], ordered[:, ch], out=values)
        dest[:, ch] = values[:, None, :]


# -- encoder -----------------------------------------------------------------------------


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        # Kernel == stride, so the Conv3d is a Linear over the flattened (C, T, P, P) patch;
        # it is kept as a Conv3d for the checkpoint's parameter name and shape.
        self.proj = nn.Conv3d(cfg.in_channels, cfg.embed_dim, kernel, stride=kernel, bias=False)
        self.fold = nn.ModuleDict({"image": PixelFold(), "video": PixelFold()})

    def forward(self, pixels: torch.Tensor, normalize: Normalize | None = None) -> torch.Tensor:
        """Float pixels ``[N, C·Tp·P·P]`` as transformers gives them, or uint8 levels with the
        ``normalize`` they stand for, channel last: ``[N, Tp·P·P·C]`` (video) or
        ``[N, P·P·C]`` (an image, sent once for the Tp frames it stands for)."""
        weight = self.proj.weight
        if pixels.dtype != torch.uint8:
            return F.linear(pixels.to(weight.dtype), weight.view(weight.shape[0], -1))
        if normalize is None:
            raise ContractError("uint8 pixels need their normalisation", field="pixel_values")
        once = pixels.shape[1] != weight[0].numel()
        # [out, C, Tp, P, P] read as [out, Tp, P, P, C], the levels' column order.
        w, b = self.fold["image" if once else "video"](weight.permute(0, 2, 3, 4, 1), None,
                                                       normalize, 4, (1,) if once else ())
        return F.linear(pixels.to(w.dtype), w.view(w.shape[0], -1), b)


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        merged = cfg.embed_dim * cfg.spatial_merge_size**2
        self.ln_q = nn.LayerNorm(cfg.embed_dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, cfg.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_q(x)
        return self.mlp(x.view(-1, self.mlp[0].in_features))


class VisionTower(nn.Module):
    """The Qwen2-VL vision transformer: patch embedding, blocks with 2-D rotary positions and
    per-frame attention, and the 2×2 patch merger."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(
            RotaryBlock(cfg.embed_dim, cfg.num_heads, int(cfg.embed_dim * cfg.mlp_ratio),
                        cfg.hidden_act, 1e-6) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)

    def forward(self, pixels: torch.Tensor, grid: Sequence[tuple[int, int, int]],
                normalize: Normalize | None = None) -> torch.Tensor:
        """``pixels`` ``[sum t*h*w, ...]`` on the device (see :class:`PatchEmbed`), ``grid``
        host ints per item."""
        x = self.patch_embed(pixels, normalize)
        cos, sin, runs = frame_rotary(grid, self.cfg.spatial_merge_size,
                                      self.cfg.embed_dim // self.cfg.num_heads, self.cfg.rope_theta,
                                      x.device)
        for block in self.blocks:
            x = block(x, cos, sin, runs)
        return self.merger(x)


# -- the model ---------------------------------------------------------------------------

_FIELDS = {
    "image": ("pixel_values", "image_grid_thw", "image_embeds"),
    "video": ("pixel_values_videos", "video_grid_thw", "video_embeds"),
}


def _grid_rows(name: str, grid: Any) -> list[tuple[int, int, int]]:
    if isinstance(grid, torch.Tensor | np.ndarray):
        if grid.ndim != 2:
            raise ContractError(f"expected [items, 3], got shape {list(grid.shape)}", field=name)
        rows = grid.tolist()
    else:
        rows = [g.tolist() if isinstance(g, torch.Tensor) else list(g) for g in grid]
    if any(len(r) != 3 for r in rows):
        raise ContractError(f"expected rows of (t, h, w), got {rows}", field=name)
    return [(int(t), int(h), int(w)) for t, h, w in rows]


class Qwen2VL(nn.Module):
    """Qwen2-VL's multimodal encoder as the runtime drives it (see
    :class:`mmferry.encoder.model.EncoderModel`).

    Build with :func:`mmferry.models.load`. Parameters live under ``visual.`` with the public
    checkpoint's names.
    """

    name = "qwen2-vl"
    modalities = ("image", "video")
    precomputed_fields = frozenset({"image_embeds", "video_embeds"})
    # Checkpoint key prefix -> our name prefix: the public layout, and the one transformers
    # >= 5 uses in memory (and newer versions save).
    checkpoint_prefixes: ClassVar[Mapping[str, str]] = MappingProxyType(
        {"visual.": "visual.", "model.visual.": "visual."})

    def __init__(self, config: VisionConfig = TINY,
                 processor_config: ProcessorConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.processor_config = processor_config or ProcessorConfig()
        self.hidden_size = config.hidden_size
        # What uint8 pixel levels stand for: transformers' rescale by 1/255, then the mean/std.
        self.normalize = Normalize(self.processor_config.image_mean, self.processor_config.image_std)
        self.visual = VisionTower(config)

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None, folder: Path | None = None) -> Qwen2VL:
        """The tiny tower (``config=None``) or the one a ``config.json`` describes; a
        checkpoint folder's ``preprocessor_config.json`` sets the processor."""
        vision = TINY if config is None else VisionConfig.from_dict(config)
        processor = ProcessorConfig()
        if folder is not None and (folder / "preprocessor_config.json").is_file():
            processor = ProcessorConfig.from_dict(read_json(folder, "preprocessor_config.json"))
        return cls(vision, processor)

    def processor(self, *, images: Any = None, videos: Any = None, audios: Any = None,
                  min_pixels: int | None = None, max_pixels: int | None = None,
                  pixel_dtype: str = DEFAULT_PIXEL_DTYPE, resize_mode: str = DEFAULT_RESIZE_MODE,
                  **kwargs: Any) -> dict[str, torch.Tensor]:
        """Images and videos to ``pixel_values`` and ``image_grid_thw`` ``[n, 3]`` int64
        (``pixel_values_videos`` / ``video_grid_thw``).

        ``pixel_dtype="uint8"`` (the default): patches of uint8 levels, channel last,
        ``[Σ t·h·w, P·P·C]`` for images (each sent once) and ``[Σ t·h·w, Tp·P·P·C]`` for
        videos, whose field specs carry :attr:`normalize`. ``"float32"``: transformers' normalised
        ``[Σ t·h·w, C·Tp·P·P]``. ``resize_mode``: ``"fast"`` (the default; the pixels of
        transformers' torchvision processor) or ``"exact"`` (those of its PIL processor).

        ``images``: one image or a sequence, each anything :func:`mmferry.media.load_image`
        takes. ``videos``: videos as :func:`mmferry.media.as_videos` names them (files,
        frame folders, frames, ``T×H×W×C`` arrays). Frames are padded to a multiple of the
        temporal patch by repeating the last. ``min_pixels`` / ``max_pixels`` override the
        resize bounds of both. A modality without media has no fields in the output.

        Raises:
            MediaError: a source cannot be decoded, breaks a limit, or has an aspect ratio
                above 200; it names the file or ``item N``.
            ArgumentError: audio, an unknown option, ``min_pixels`` / ``max_pixels`` not an
                int within :func:`check_resize_bounds`, or a ``pixel_dtype`` /
                ``resize_mode`` :func:`~mmferry.media.resize.check_pixel_options` refuses.
        """
        if kwargs:
            raise ArgumentError(f"unknown processor option(s) {sorted(kwargs)}; qwen2-vl takes "
                                "min_pixels, max_pixels, pixel_dtype and resize_mode",
                                argument=sorted(kwargs)[0])
        if audios is not None:
            raise ArgumentError("qwen2-vl takes images and videos, not audio", argument="audios")
        check_pixel_options(pixel_dtype, resize_mode)
        pc = self.processor_config
        # Every option is checked before any media is read; the pair per modality in use.
        check_resize_bounds(1 if min_pixels is None else min_pixels,
                            MAX_RESIZE_PIXELS if max_pixels is None else max_pixels,
                            argument="options")
        bounds = {}
        for modality, low, high in (("image", pc.min_pixels, pc.max_pixels),
                                    ("video", pc.video_min_pixels, pc.video_max_pixels)):
            bounds[modality] = (low if min_pixels is None else min_pixels,
                                high if max_pixels is None else max_pixels)
        images, videos = as_images(images), as_videos(videos)
        for modality, media in (("image", images), ("video", videos)):
            if media:
                check_resize_bounds(*bounds[modality], argument="options")
        out: dict[str, torch.Tensor] = {}
        images = [load_image(x, index=i) for i, x in enumerate(images)]
        if images:
            frames = [[img] for img in images]
            self._process(out, "image", frames, *bounds["image"], pixel_dtype, resize_mode)
        videos = [load_video(v, index=i) for i, v in enumerate(videos)]
        if videos:
            self._process(out, "video", videos, *bounds["video"], pixel_dtype, resize_mode)
        return out

    def _process(self, out: dict[str, torch.Tensor], modality: str,
                 media: list[list[Image.Image]], min_pixels: int, max_pixels: int,
                 pixel_dtype: str, resize_mode: str) -> None:
        cfg = self.config
        patch, merge, temporal = cfg.patch_size, cfg.spatial_merge_size, cfg.temporal_patch_size
        sizes, grids = [], []
        for i, frames in enumerate(media):
            width, height = frames[0].size
            try:
                h, w = smart_resize(height, width, patch * merge, min_pixels, max_pixels)
            except ValueError as e:
                raise MediaError(str(e), source=f"item {i}") from None
            t = 1 if modality == "image" else -(-len(frames) // temporal)
            sizes.append((h, w))
            grids.append((t, h // patch, w // patch))
        rows = [t * gh * gw for t, gh, gw in grids]
        levels = pixel_dtype == "uint8"
        # An image stands for `temporal` identical frames: as levels it is sent once.
        width = cfg.in_channels * patch * patch * (1 if levels and modality == "image" else temporal)
        pixels = torch.empty((sum(rows), width), dtype=torch.uint8 if levels else torch.float32)
        flat = pixels.numpy()
        table = None if levels else _normalise_table(tuple(self.processor_config.image_mean),
                                                     tuple(self.processor_config.image_std))
        start = 0
        for frames, (h, w), n in zip(media, sizes, rows, strict=True):
            if len(frames) > 1 and len(frames) % temporal:
                frames = frames + [frames[-1]] * (temporal - len(frames) % temporal)
            resized = [resize(f, h, w, mode=resize_mode) for f in frames]
            stack = resized[0][None] if len(resized) == 1 else np.stack(resized)
            per_patch = 1 if len(frames) == 1 else temporal
            if table is None:  # a one-frame video repeats its frame over the temporal patch
                ordered = _level_order(stack, patch=patch, merge=merge, per_patch=per_patch)
                k = ordered.shape[2]
                flat[start:start + n].reshape(n, width // k, k)[:] = ordered
            else:
                ordered = _patch_order(stack, patch=patch, merge=merge, per_patch=per_patch)
                _normalise_into(flat[start:start + n], ordered, table, temporal)
            start += n
        values, grid_name, _ = _FIELDS[modality]
        out[values] = pixels
        out[grid_name] = torch.tensor(grids, dtype=torch.int64).reshape(-1, 3)

    def field_specs(self, outputs: Mapping[str, Any]) -> dict[str, FieldSpec]:
        """Pixels and embeddings split by the grid (rows per item, and rows per item over
        merge² for embeddings); grids are per item and stay on the host. Names exactly the
        fields present in ``outputs``."""
        specs: dict[str, FieldSpec] = {}
        merge2 = self.config.spatial_merge_size ** 2
        for modality, (values, grid_name, embeds) in _FIELDS.items():
            present = [k for k in (values, embeds) if outputs.get(k) is not None]
            if outputs.get(grid_name) is None:
                if present:
                    raise ContractError(f"{grid_name} is needed to split it", field=present[0])
                continue
            patches = torch.as_tensor(outputs[grid_name]).reshape(-1, 3).prod(-1)
            specs[grid_name] = FieldSpec.batched(modality, placement="host")
            if values in present:
                levels = torch.as_tensor(outputs[values]).dtype == torch.uint8
                specs[values] = FieldSpec.flat_from_sizes(
                    modality, patches, normalize=self.normalize if levels else None)
            if embeds in present:
                specs[embeds] = FieldSpec.flat_from_sizes(modality, patches // merge2)
        return specs

    def check_item(self, item: Mapping[str, Any]) -> None:
        """One grid row of positive multiples of the merge size; pixels ``[t·h·w, C·Tp·P·P]``
        floating point, or uint8 levels (``[t·h·w, C·P·P]`` for an image) whose spec carries
        :attr:`normalize`; or embeddings ``[t·h·w / merge², hidden]``."""
        modality = next((m for m, names in _FIELDS.items() if names[1] in item), None)
        if modality is None:
            raise ContractError("an item needs image_grid_thw or video_grid_thw",
                                field="image_grid_thw")
        values, grid_name, embeds = _FIELDS[modality]
        unknown = set(item) - set(_FIELDS[modality])
        if unknown:
            raise ContractError(f"not a qwen2-vl {modality} field", field=sorted(unknown)[0])
        grid = item[grid_name]
        if not isinstance(grid, torch.Tensor) or grid.shape != (3,) or grid.is_floating_point():
            raise ContractError(f"expected one integer (t, h, w) row, got {describe(grid)}",
                                field=grid_name)
        (t, h, w), merge = _grid_rows(grid_name, [grid])[0], self.config.spatial_merge_size
        if min(t, h, w) < 1 or h % merge or w % merge:
            raise ContractError(f"grid (t, h, w) = {(t, h, w)} must be positive with h and w "
                                f"multiples of the merge size {merge}", field=grid_name)
        cfg = self.config
        width = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
        value = item.get(values)
        levels = isinstance(value, torch.Tensor) and value.dtype == torch.uint8
        if levels:
            check_normalize(item, values, self.normalize)
            if modality == "image":
                width //= cfg.temporal_patch_size
            if tuple(value.shape) != (t * h * w, width):
                raise ContractError(f"expected uint8 [{t * h * w}, {width}] from {grid_name} "
                                    f"{(t, h, w)}, got {describe(value)}", field=values)
        for name, rows, cols in ((values, t * h * w, width),
                                 (embeds, t * h * w // merge ** 2, self.hidden_size)):
            if name not in item or (name == values and levels):
                continue
            value = item[name]
            if (not isinstance(value, torch.Tensor) or not value.is_floating_point()
                    or tuple(value.shape) != (rows, cols)):
                raise ContractError(f"expected floating point [{rows}, {cols}] from {grid_name} "
                                    f"{(t, h, w)}, got {describe(value)}", field=name)
        if (values in item) == (embeds in item):
            raise ContractError(f"an item holds {values} or {embeds}", field=values)

    def tokens_per_item(self, item: Mapping[str, Any]) -> int:
        """``t·h·w / merge²`` from the item's host grid."""
        for _, grid_name, _ in _FIELDS.values():
            if grid_name in item:
                ((t, h, w),) = _grid_rows(grid_name, [item[grid_name]])
                return t * h * w // self.config.spatial_merge_size ** 2
        raise ContractError("an item needs image_grid_thw or video_grid_thw to count its tokens",
                            field="image_grid_thw")

    def encode(self, **batch: Any) -> torch.Tensor:
        """One modality's batch to ``[Σ tokens, hidden_size]``.

        ``pixel_values`` + ``image_grid_thw`` (or the video pair) run the vision tower. The
        grid is read on the host; only the pixels need to be on the model's device.
        Precomputed ``image_embeds`` / ``video_embeds`` never reach here: the runner passes
        them through (the one place that policy lives) after ``check_item`` has checked them.
        """
        modalities = [m for m, names in _FIELDS.items() if any(k in batch for k in names)]
        if len(modalities) != 1:
            raise ContractError(f"a batch holds exactly one of image or video fields, got "
                                f"{sorted(batch)}", field=None)
        values, grid_name, embeds = _FIELDS[modalities[0]]
        unknown = set(batch) - set(_FIELDS[modalities[0]])
        if unknown:
            raise ContractError("not a qwen2-vl field", field=sorted(unknown)[0])
        if embeds in batch:
            raise ContractError("precomputed embeddings are passed through by EncoderRunner, "
                                "not encoded", field=embeds)
        if grid_name not in batch:
            raise ContractError("missing from the batch", field=grid_name)
        grid = _grid_rows(grid_name, batch[grid_name])
        pixels = batch.get(values)
        if pixels is None:
            raise ContractError("missing from the batch", field=values)
        merge = self.config.spatial_merge_size
        if any(h % merge or w % merge for _, h, w in grid):
            raise ContractError(f"grid rows {grid} are not multiples of the merge size {merge}",
                                field=grid_name)
        rows = sum(t * h * w for t, h, w in grid)
        cfg = self.config
        width = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
        levels = pixels.dtype == torch.uint8
        if levels and values == "pixel_values":
            width //= cfg.temporal_patch_size
        if pixels.ndim != 2 or tuple(pixels.shape) != (rows, width):
            raise ContractError(f"expected [{rows}, {width}] from {grid_name}, got "
                                f"{describe(pixels)}", field=values)
        if not rows:
            weight = self.visual.patch_embed.proj.weight
            return torch.empty(0, self.hidden_size, dtype=weight.dtype, device=weight.device)
        return self.visual(pixels, grid, self.normalize if levels else None)

    def dummy_inputs(self) -> dict[str, torch.Tensor]:
        """Processor output for two small seeded images of different sizes and two videos
        (4 frames, and 3 frames padded to 4), at small resize bounds."""
        rng = np.random.default_rng(0)
        images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((56, 84), (84, 112))]
        videos = [rng.integers(0, 256, (t, h, w, 3), dtype=np.uint8)
                  for t, h, w in ((4, 56, 56), (3, 56, 84))]
        return self.processor(images=images, videos=videos, min_pixels=56 * 56,
                              max_pixels=28 * 28 * 16)
