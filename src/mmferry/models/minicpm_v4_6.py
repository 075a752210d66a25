"""MiniCPM-V 4.6: its image/video processor, field contract and vision encoder.

The processor matches transformers' ``MiniCPMV4_6ImageProcessor`` (torchvision,
``resize_mode="fast"``) or ``MiniCPMV4_6ImageProcessorPil`` (``"exact"``): a source image
plus a grid of slices chosen by ``max_slice_nums`` and ``scale_resolution``, the bicubic
filter, the NaViT ``[C, P, h·w·P]`` patch layout; it lays each image out the way vLLM 0.33
re-pads it: ``(n_slices, C, P, L_max)``. By default the pixels are uint8 levels whose spec
carries the normalisation; the encoder folds it into the patch embedding. A video is
processed frame by frame, as vLLM does. The encoder is the SigLIP-NaViT vision tower with the
window-attention merger after layer ``insert_layer_id`` and the final 2×2 merger to the
language model's width (``MiniCPMV4_6Model.get_image_features``), with transformers'
parameter names.

Placement: the slice sizes (``tgt_sizes``), the merger flags and the video frame sizes stay on
the host. Everything derived from them (which patch rows are real, position ids, how slices
group into equal-length attention batches, the output order) is host math; the derived
indices go up in one upload per call. Only the real patch rows are gathered (the zero
padding is never read, which matters for uint8 levels: with the folded bias level 0 is not
a zero input), slices of equal size attend in one batched call, so no padding mask exists;
after the window merger the new sizes are the host's ``size // k``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from mmferry.errors import ArgumentError, ContractError
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
from mmferry.transfer import upload

__all__ = ["TINY", "MiniCPMV46", "ProcessorConfig", "VisionConfig"]

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


def _int_pair(value: Any, key: str) -> tuple[int, int]:
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                                 for v in pair):
        raise ArgumentError(f"{key} must be a positive int or a pair of them, got {value!r}",
                            argument="config")
    return pair  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """The encoder part of a MiniCPM-V 4.6 ``config.json``: ``vision_config``, the merger
    settings at the top level and the language model's width (``text_config.hidden_size``).
    Defaults are the SigLIP-400M tower MiniCPM-V uses."""

    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_hidden_layers: int = 27
    num_attention_heads: int = 16
    num_channels: int = 3
    image_size: int = 980
    patch_size: int = 14
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6
    insert_layer_id: int = 6
    window_kernel_size: tuple[int, int] = (2, 2)
    merge_kernel_size: tuple[int, int] = (2, 2)
    merger_times: int = 1
    downsample_mode: str = "16x"
    drop_vision_last_layer: bool = False
    text_hidden_size: int = 2048  # the final merger's output, the language model's width

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> VisionConfig:
        """Read a checkpoint's ``config.json`` content."""
        model_type = config.get("model_type")
        if model_type not in (None, "minicpmv4_6"):
            raise ArgumentError(f"config is for model_type {model_type!r}, not 'minicpmv4_6'",
                                argument="config")
        vision = config.get("vision_config")
        text = config.get("text_config")
        if not isinstance(vision, Mapping):
            raise ArgumentError("config needs a vision_config mapping", argument="config")
        if not isinstance(text, Mapping) or "hidden_size" not in text:
            raise ArgumentError("config needs text_config.hidden_size (the merger's output "
                                "width)", argument="config")
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in vision.items() if k in names}
        # The top-level values win, as MiniCPMV4_6Config copies insert_layer_id down.
        for key in ("insert_layer_id", "merge_kernel_size", "merger_times", "downsample_mode",
                    "drop_vision_last_layer"):
            if key in config:
                values[key] = config[key]
        values["text_hidden_size"] = text["hidden_size"]
        for key in ("window_kernel_size", "merge_kernel_size"):
            if key in values:
                values[key] = _int_pair(values[key], key)
        for key in ("image_size", "patch_size"):
            if isinstance(values.get(key), list | tuple):
                pair = _int_pair(values[key], f"vision_config.{key}")
                if pair[0] != pair[1]:
                    raise ArgumentError(f"vision_config.{key} must be square, got {pair}",
                                        argument="config")
                values[key] = pair[0]
        out = cls(**values)
        out.validate()
        return out

    def validate(self) -> None:
        """Raise :class:`ArgumentError` naming the first value the encoder cannot run with."""
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_channels", "image_size", "patch_size",
                    "merger_times", "text_hidden_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ArgumentError(f"{key} must be a positive int, got {value!r}",
                                    argument="config")
        if self.hidden_size % self.num_attention_heads:
            raise ArgumentError(f"hidden_size {self.hidden_size} does not split into "
                                f"{self.num_attention_heads} heads", argument="config")
        if self.hidden_act not in _ACTIVATIONS:
            raise ArgumentError(f"unsupported hidden_act {self.hidden_act!r}; supported: "
                                f"{sorted(_ACTIVATIONS)}", argument="config")
        if self.window_kernel_size[0] != self.window_kernel_size[1]:
            raise ArgumentError(f"window_kernel_size must be square, got "
                                f"{self.window_kernel_size}", argument="config")
        if not isinstance(self.insert_layer_id, int) or self.insert_layer_id >= self.depth:
            raise ArgumentError(f"insert_layer_id {self.insert_layer_id!r} must be below the "
                                f"{self.depth} layers that run", argument="config")
        if self.downsample_mode not in ("16x", "4x"):
            raise ArgumentError(f"downsample_mode must be '16x' or '4x', got "
                                f"{self.downsample_mode!r}", argument="config")

    @property
    def depth(self) -> int:
        """Encoder layers that run (vLLM drops the last one when the config says so)."""
        return self.num_hidden_layers - int(bool(self.drop_vision_last_layer))

    @property
    def merger_default(self) -> bool:
        """Whether the window merger runs when an item does not say (the config's mode)."""
        return self.downsample_mode != "4x" and self.insert_layer_id >= 0


TINY = VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=2, image_size=56, insert_layer_id=0,
                    text_hidden_size=48)


@dataclass(frozen=True, slots=True)
class ProcessorConfig:
    """Slicing and normalisation; defaults are transformers' ``MiniCPMV4_6ImageProcessor``
    and ``MiniCPMV4_6VideoProcessor``'s."""

    max_slice_nums: int = 9
    video_max_slice_nums: int = 9
    scale_resolution: int = 448
    patch_size: int = 14
    slice_mode: bool = True
    downsample_mode: str = "16x"
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any],
                  video: Mapping[str, Any] | None = None) -> ProcessorConfig:
        """Read a checkpoint's ``preprocessor_config.json`` (and its
        ``video_preprocessor_config.json`` for the video slice limit)."""
        out = cls()
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in config:
                values[f.name] = config[f.name]
        for key in ("image_mean", "image_std"):
            if key in values:
                v = values[key]
                values[key] = tuple(float(x) for x in (v if isinstance(v, list | tuple)
                                                       else [v] * 3))
        if video and "max_slice_nums" in video:
            values["video_max_slice_nums"] = video["max_slice_nums"]
        out = replace(out, **values)
        for key in ("max_slice_nums", "video_max_slice_nums", "scale_resolution", "patch_size"):
            value = getattr(out, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ArgumentError(f"preprocessor_config {key} must be a positive int, got "
                                    f"{value!r}", argument=key)
        _check_mode(out.downsample_mode)
        return out


def _check_mode(mode: Any) -> str:
    if mode not in ("16x", "4x"):
        raise ArgumentError(f"downsample_mode must be '16x' or '4x', got {mode!r}",
                            argument="downsample_mode")
    return mode


# -- slicing (host math, the reference's formulas) --------------------------------------


def _ensure_divide(length: float, divisor: int) -> int:
    return max(round(length / divisor) * divisor, divisor)


def best_resize(height: float, width: float, scale_resolution: int, patch_size: int,
                mode: str, allow_upscale: bool) -> tuple[int, int]:
    """The size a source image (or one slice) is resized to: within ``scale_resolution²``
    pixels (or scaled up to it), both sides multiples of ``patch_size`` times 4 ("16x": two
    2×2 merges) or 2 ("4x")."""
    if height * width > scale_resolution * scale_resolution or allow_upscale:
        aspect = width / height
        height = int(scale_resolution / math.sqrt(aspect))
        width = int(height * aspect)
    factor = patch_size * (2 if mode == "4x" else 4)
    return _ensure_divide(height, factor), _ensure_divide(width, factor)


def refine_size(height: int, width: int, grid: tuple[int, int], scale_resolution: int,
                patch_size: int, mode: str) -> tuple[int, int]:
    """The size the image is resized to before it is cut into ``grid`` (rows, columns)."""
    rows, cols = grid
    h = _ensure_divide(height, rows)
    w = _ensure_divide(width, cols)
    bh, bw = best_resize(h / rows, w / cols, scale_resolution, patch_size, mode, True)
    return bh * rows, bw * cols


def slice_grid(height: int, width: int, max_slice_nums: int,
               scale_resolution: int) -> tuple[int, int] | None:
    """(rows, columns) of slices for an image, or None when it is small enough not to slice:
    the grid with about ``area / scale_resolution²`` cells whose shape is closest to the
    image's aspect ratio in log scale (more rows on a tie)."""
    log_ratio = math.log(width / height)
    multiple = min(math.ceil(width * height / (scale_resolution * scale_resolution)),
                   max_slice_nums)
    if multiple <= 1:
        return None
    best, best_error = (1, 1), float("inf")
    for n in (multiple - 1, multiple, multiple + 1):
        if n == 1 or n > max_slice_nums:
            continue
        for rows in range(1, n + 1):
            if n % rows:
                continue
            error = abs(log_ratio - math.log((n // rows) / rows))
            if error < best_error or (error == best_error and rows > best[0]):
                best, best_error = (rows, n // rows), error
    return best


# -- processor --------------------------------------------------------------------------


@lru_cache(maxsize=8)
def _normalise_table(mean: tuple[float, ...], std: tuple[float, ...], rescale: float | None,
                     normalise: bool) -> np.ndarray:
    """``[C, 256]`` float32: every uint8 value rescaled and normalised per channel, with
    transformers' arithmetic (rescale in float64, cast to float32, then subtract and divide
    in float32), so a lookup gives its values bit for bit."""
    values = np.arange(256, dtype=np.float64)
    scaled = (values * rescale if rescale is not None else values).astype(np.float32)
    table = np.broadcast_to(scaled, (len(mean), 256)).copy()
    if normalise:
        m = np.asarray(mean, dtype=np.float32)[:, None]
        s = np.asarray(std, dtype=np.float32)[:, None]
        table = (table - m) / s
    table.setflags(write=False)
    return table


# A resized image and the (rows, columns) grid it is cut into: (1, 1) for the source image.
Part = tuple[np.ndarray, tuple[int, int]]


def _image_parts(img: Image.Image, max_slice_nums: int, scale_resolution: int, patch: int,
                 mode: str, slice_mode: bool, resize_mode: str) -> list[Part]:
    """The source image, then (when it is sliced) the refined image and its grid, resized to
    uint8 ``[h, w, C]``: the reference's slices in order are the source, then the refined
    image's cells row by row."""
    width, height = img.size
    grid = slice_grid(height, width, max_slice_nums, scale_resolution) if slice_mode else None
    sh, sw = best_resize(height, width, scale_resolution, patch, mode, grid is None)
    # Pillow resizes its own image; torch an array, copied out of the image once for both.
    source: Image.Image | np.ndarray = img
    if resize_mode != "exact" and grid is not None:
        source = np.array(img)
    # Strided views are fine: the layout copies them into place in one pass.
    parts = [(resize(source, sh, sw, mode=resize_mode, contiguous=False), (1, 1))]
    if grid is not None:
        rh, rw = refine_size(height, width, grid, scale_resolution, patch, mode)
        parts.append((resize(source, rh, rw, mode=resize_mode, contiguous=False), grid))
    return parts


def _layout(parts: Sequence[Part], patch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Parts to vLLM's per-item layout, as uint8 levels: ``(n, C, P, L_max)``, slice ``i``
    holding its ``h·w`` patches side by side along the last dimension (patch ``(r, c)`` at
    ``(r·w + c)·P``), zero-padded to the longest; and the ``(n, 2)`` int64 patch grid.

    All cells of one part have one size, so each part is one strided copy of its uint8
    pixels straight into place: no per-slice array, no float copy."""
    sizes: list[tuple[int, int]] = []
    for pixels, (rows, cols) in parts:
        cell = (pixels.shape[0] // rows // patch, pixels.shape[1] // cols // patch)
        sizes += [cell] * (rows * cols)
    channels = parts[0][0].shape[2]
    longest = max(h * w for h, w in sizes) * patch
    out = np.empty((len(sizes), channels, patch, longest), dtype=np.uint8)
    first = 0
    for pixels, (rows, cols) in parts:
        h, w = sizes[first]
        count, length = rows * cols, h * w * patch
        # [rows, h, P, cols, w, P, C] -> [rows, cols, C, P (row in patch), h, w, P (column)]
        cells = pixels.reshape(rows, h, patch, cols, w, patch, channels)
        dest = out[first:first + count, :, :, :length].reshape(
            rows, cols, channels, patch, h, w, patch)  # splits axes only: always a view
        np.copyto(dest, cells.transpose(0, 3, 6, 2, 1, 4, 5))
        out[first:first + count, :, :, length:] = 0
        first += count
    return torch.from_numpy(out), torch.tensor(sizes, dtype=torch.int64).reshape(-1, 2)


def _normalised(levels: torch.Tensor, sizes: torch.Tensor, patch: int,
                table: np.ndarray) -> torch.Tensor:
    """uint8 levels of :func:`_layout` to transformers' float32 values (padding stays 0)."""
    channels = levels.shape[1]
    out = np.empty(tuple(levels.shape), dtype=np.float32)
    src = levels.numpy()
    for c in range(channels):
        np.take(table[c], src[:, c], out=out[:, c], mode="clip")
    for i, length in enumerate((sizes[:, 0] * sizes[:, 1] * patch).tolist()):
        out[i, :, :, length:] = 0
    return torch.from_numpy(out)


# -- encoder ----------------------------------------------------------------------------


@lru_cache(maxsize=1024)
def _position_ids(h: int, w: int, side: int) -> torch.Tensor:
    """Row-major indices into the ``side × side`` position table for an ``h × w`` slice:
    each fractional coordinate bucketed onto the table's grid, in transformers' float32
    arithmetic (``get_vision_nearest_position_ids``), so the buckets agree at every edge."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side)
    rows = torch.bucketize(torch.arange(h) / h, boundaries, right=True)
    cols = torch.bucketize(torch.arange(w) / w, boundaries, right=True)
    return (rows[:, None] * side + cols).flatten()


@dataclass(frozen=True, slots=True)
class Group:
    """A run of ``count`` slices of one ``h × w`` patch grid, contiguous in the packed rows."""

    count: int
    h: int
    w: int
    merged: bool  # goes through the window merger


class Attention(nn.Module):
    """Multi-head self-attention over equal-length sequences ``[batch, length, D]``."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def attend(self, x: torch.Tensor, runs: Sequence[tuple[int, int]]) -> torch.Tensor:
        """``x`` ``[N, D]`` packed rows; ``runs`` (sequences, length) tile it: each run is
        ``sequences`` back-to-back sequences of ``length`` rows that attend within
        themselves. Projections run once over all rows, attention once per run."""
        n = x.shape[0]
        q, k, v = (p(x).view(n, self.heads, -1) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(frame_attention(q, k, v, runs))


class MLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.act = _ACTIVATIONS[cfg.hidden_act]
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = Attention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, runs: Sequence[tuple[int, int]]) -> torch.Tensor:
        x = x + self.self_attn.attend(self.layer_norm1(x), runs)
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))


class Embeddings(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size,
                                         stride=cfg.patch_size)
        # The patch embedding with the processor's normalisation folded in, for uint8 levels.
        self.patch_fold = PixelFold()
        side = cfg.image_size // cfg.patch_size
        self.position_embedding = nn.Embedding(side * side, cfg.hidden_size)


def _space_to_depth(x: torch.Tensor, groups: Sequence[Group], kh: int, kw: int) -> torch.Tensor:
    """Packed rows of ``groups`` to one row per ``kh × kw`` block, ``[Σ blocks, kh·kw, D]``:
    blocks row-major over each slice, the block's rows row-major inside it."""
    pieces, start = [], 0
    d = x.shape[-1]
    for g in groups:
        stop = start + g.count * g.h * g.w
        block = x[start:stop].view(g.count, g.h // kh, kh, g.w // kw, kw, d)
        pieces.append(block.permute(0, 1, 3, 2, 4, 5).reshape(-1, kh * kw, d))
        start = stop
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


class WindowMerger(nn.Module):
    """``MiniCPMV4_6ViTWindowAttentionMerger``: self-attention inside each ``k × k`` window
    (pre-norm, residual), then each window's ``k²`` rows concatenated through an MLP to one
    row, plus the window's mean."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        k2 = cfg.window_kernel_size[0] * cfg.window_kernel_size[1]
        self.kernel = cfg.window_kernel_size
        self.self_attn = Attention(cfg)
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.pre_norm = nn.LayerNorm(cfg.hidden_size * k2, eps=cfg.layer_norm_eps)
        self.linear_1 = nn.Linear(cfg.hidden_size * k2, cfg.intermediate_size * k2)
        self.linear_2 = nn.Linear(cfg.intermediate_size * k2, cfg.hidden_size)

    def forward(self, x: torch.Tensor, groups: Sequence[Group]) -> torch.Tensor:
        kh, kw = self.kernel
        windows = _space_to_depth(x, groups, kh, kw)  # [W, k², D]
        nw, k2, d = windows.shape
        flat = windows.reshape(nw * k2, d)
        flat = flat + self.self_attn.attend(self.layer_norm1(flat), [(nw, k2)])
        windows = flat.view(nw, k2, d)
        out = self.linear_2(F.gelu(self.linear_1(self.pre_norm(flat.view(nw, k2 * d))),
                                   approximate="tanh"))
        return out + windows.mean(dim=1)


class VisionTower(nn.Module):
    """``MiniCPMV4_6VisionModel``: patch and position embeddings, the encoder layers with
    the window merger after ``insert_layer_id``, the final layer norm."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.vit_merger = WindowMerger(cfg)


class DownsampleMLP(nn.Module):
    def __init__(self, width_in: int, width_out: int) -> None:
        super().__init__()
        self.pre_norm = nn.LayerNorm(width_in, eps=1e-6)
        self.linear_1 = nn.Linear(width_in, width_in)
        self.linear_2 = nn.Linear(width_in, width_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(self.pre_norm(x))))


class Merger(nn.Module):
    """``MiniCPMV4_6Merger``: ``merger_times`` rounds of ``m1 × m2`` space-to-depth + MLP, the
    last one to the language model's width."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        m = cfg.merge_kernel_size[0] * cfg.merge_kernel_size[1]
        d = cfg.hidden_size
        self.mlp = nn.ModuleList(
            DownsampleMLP(d * m, cfg.text_hidden_size if i == cfg.merger_times - 1 else d)
            for i in range(cfg.merger_times))


# -- the model --------------------------------------------------------------------------

_FIELDS = {
    "image": {"pixels": "pixel_values", "sizes": "tgt_sizes", "flag": "use_vit_merger",
              "embeds": "image_embeds"},
    "video": {"pixels": "video_pixel_values", "sizes": "video_tgt_sizes",
              "flag": "video_use_vit_merger", "embeds": "video_embeds",
              "frames": "video_image_sizes"},
}


def _size_rows(name: str, value: Any) -> list[list[tuple[int, int]]]:
    """Per item, its slices' (h, w) patch grids, from a batched ``(B, n, 2)`` tensor or a
    list of ``(n, 2)`` tensors (host values)."""
    if isinstance(value, torch.Tensor):
        if value.ndim != 3 or value.shape[-1] != 2 or value.is_floating_point():
            raise ContractError(f"expected integer [items, slices, 2], got {describe(value)}",
                                field=name)
        rows = value.tolist()
    elif isinstance(value, list | tuple):
        for v in value:
            if (not isinstance(v, torch.Tensor) or v.ndim != 2 or v.shape[-1] != 2
                    or v.is_floating_point()):
                raise ContractError(f"expected integer [slices, 2] per item, got "
                                    f"{describe(v)}", field=name)
        rows = [v.tolist() for v in value]
    else:
        raise ContractError(f"expected a tensor or a list, got {describe(value)}", field=name)
    return [[(int(h), int(w)) for h, w in item] for item in rows]


def _is_uint8(name: str, pixels: Any) -> bool:
    """Whether pixels (a tensor or a list of them) are uint8 levels rather than floating
    values; one kind only."""
    values = [pixels] if isinstance(pixels, torch.Tensor) else list(pixels)
    kinds = {p.dtype == torch.uint8 if isinstance(p, torch.Tensor) and (
        p.dtype == torch.uint8 or p.is_floating_point()) else None for p in values}
    if None in kinds or len(kinds) > 1:
        raise ContractError(f"expected uint8 or floating point pixels, all of one kind, got "
                            f"{sorted({describe(p) for p in values})}", field=name)
    return kinds == {True}


def _flag_rows(name: str, value: Any, items: int, default: bool) -> list[bool]:
    """Per item, whether its slices go through the window merger (host values)."""
    if value is None:
        return [default] * items
    if isinstance(value, torch.Tensor):
        flags = value.reshape(-1).tolist()
    elif isinstance(value, list | tuple):
        flags = [f for v in value for f in torch.as_tensor(v).reshape(-1).tolist()]
    else:
        raise ContractError(f"expected a tensor or a list, got {describe(value)}", field=name)
    if len(flags) != items:
        raise ContractError(f"expected one flag per item ({items}), got {len(flags)}",
                            field=name)
    return [bool(f) for f in flags]


class MiniCPMV46(nn.Module):
    """MiniCPM-V 4.6's multimodal encoder as the runtime drives it (see
    :class:`mmferry.encoder.model.EncoderModel`).

    Build with :func:`mmferry.models.load`. Parameters are named as transformers'
    ``MiniCPMV4_6Model`` names them, under ``vision_tower.`` and ``merger.``.
    """

    name = "minicpm-v-4.6"
    modalities = ("image", "video")
    precomputed_fields = frozenset({"image_embeds", "video_embeds"})
    # transformers >= 5.7 saves model.vision_tower.* (the window merger inside it) and
    # model.merger.*; the remote-code layout vLLM also reads has vpm / vit_merger / merger.
    checkpoint_prefixes: ClassVar[Mapping[str, str]] = MappingProxyType({
        "model.vision_tower.": "vision_tower.",
        "model.vpm.": "vision_tower.",
        "vpm.": "vision_tower.",
        "model.vit_merger.": "vision_tower.vit_merger.",
        "vit_merger.": "vision_tower.vit_merger.",
        "model.merger.": "merger.",
        "merger.": "merger.",
    })

    def __init__(self, config: VisionConfig = TINY,
                 processor_config: ProcessorConfig | None = None) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.processor_config = processor_config or ProcessorConfig()
        if self.processor_config.patch_size != config.patch_size:
            raise ArgumentError(f"processor patch_size {self.processor_config.patch_size} "
                                f"differs from the encoder's {config.patch_size}",
                                argument="patch_size")
        self.hidden_size = config.text_hidden_size
        self.vision_tower = VisionTower(config)
        self.merger = Merger(config)
        pc = self.processor_config
        channels = len(pc.image_mean)
        #: What the uint8 pixel levels stand for: transformers' rescale then normalise.
        self.normalize = Normalize(pc.image_mean if pc.do_normalize else (0.0,) * channels,
                                   pc.image_std if pc.do_normalize else (1.0,) * channels,
                                   pc.rescale_factor if pc.do_rescale else 1.0)

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None,
                    folder: Path | None = None) -> MiniCPMV46:
        """The tiny encoder (``config=None``) or the one a ``config.json`` describes; a
        checkpoint folder's ``preprocessor_config.json`` (and
        ``video_preprocessor_config.json``) set the processor."""
        vision = TINY if config is None else VisionConfig.from_dict(config)
        processor = ProcessorConfig()
        if folder is not None and (folder / "preprocessor_config.json").is_file():
            video = None
            if (folder / "video_preprocessor_config.json").is_file():
                video = read_json(folder, "video_preprocessor_config.json")
            processor = ProcessorConfig.from_dict(read_json(folder, "preprocessor_config.json"),
                                                  video)
        return cls(vision, processor)

    # -- processor ----------------------------------------------------------------------

    def processor(self, *, images: Any = None, videos: Any = None, audios: Any = None,
                  max_slice_nums: int | None = None, scale_resolution: int | None = None,
                  downsample_mode: str | None = None, pixel_dtype: str = DEFAULT_PIXEL_DTYPE,
                  resize_mode: str = DEFAULT_RESIZE_MODE, **kwargs: Any) -> dict[str, Any]:
        """Images and videos to vLLM 0.33's MiniCPM-V 4.6 fields.

        Images: ``pixel_values`` (per image ``(n_slices, C, P, L_max)``: the source image,
        then its grid slices row by row, zero-padded to the longest), ``tgt_sizes`` (per image
        ``(n_slices, 2)`` int64 patch rows and columns) and ``use_vit_merger`` (per image
        ``(1,)`` bool). Videos, frame by frame with the video slice limit:
        ``video_pixel_values``, ``video_tgt_sizes`` (all frames' slices),
        ``video_image_sizes`` (per frame ``[width, height]``) and ``video_use_vit_merger``.

        ``pixel_dtype="uint8"`` (the default) gives the resized pixel levels, not normalised,
        and the pixel fields' specs carry :attr:`normalize`, which the encoder folds into its
        patch embedding; ``"float32"`` gives transformers' normalised values (padding 0).
        ``resize_mode="fast"`` (the default) resizes as transformers' torchvision processor
        (``MiniCPMV4_6ImageProcessor``, vLLM's default), ``"exact"`` as its PIL processor
        (``MiniCPMV4_6ImageProcessorPil``), bit for bit in float32.

        ``max_slice_nums`` (images only, as in vLLM), ``scale_resolution`` and
        ``downsample_mode`` ("16x" or "4x") override the checkpoint's processor settings.
        A modality without media has no fields in the output.

        Raises:
            MediaError: a source cannot be decoded or breaks a limit; names the file or item.
            ArgumentError: audio, an unknown option or a bad option value.
        """
        if kwargs:
            raise ArgumentError(f"unknown processor option(s) {sorted(kwargs)}; {self.name} "
                                "takes max_slice_nums, scale_resolution, downsample_mode, "
                                "pixel_dtype and resize_mode", argument=sorted(kwargs)[0])
        check_pixel_options(pixel_dtype, resize_mode)
        if audios is not None:
            raise ArgumentError(f"{self.name} takes images and videos, not audio",
                                argument="audios")
        pc = self.processor_config
        for key, value in (("max_slice_nums", max_slice_nums),
                           ("scale_resolution", scale_resolution)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise ArgumentError(f"{key} must be a positive int, got {value!r}",
                                    argument=key)
        mode = _check_mode(downsample_mode or pc.downsample_mode)
        resolution = scale_resolution or pc.scale_resolution
        flag = mode != "4x" and self.config.insert_layer_id >= 0
        patch = pc.patch_size
        out: dict[str, Any] = {}

        def lay(parts: Sequence[Part]) -> tuple[torch.Tensor, torch.Tensor]:
            levels, sizes = _layout(parts, patch)
            if pixel_dtype == "uint8":
                return levels, sizes
            table = _normalise_table(pc.image_mean, pc.image_std,
                                     pc.rescale_factor if pc.do_rescale else None,
                                     pc.do_normalize)
            return _normalised(levels, sizes, patch, table), sizes

        def parts(img: Image.Image, limit: int) -> list[Part]:
            return _image_parts(img, limit, resolution, patch, mode, pc.slice_mode, resize_mode)

        images = [load_image(x, index=i) for i, x in enumerate(as_images(images))]
        if images:
            laid = [lay(parts(img, max_slice_nums or pc.max_slice_nums)) for img in images]
            out["pixel_values"] = [p for p, _ in laid]
            out["tgt_sizes"] = [s for _, s in laid]
            out["use_vit_merger"] = torch.full((len(images), 1), flag, dtype=torch.bool)
        videos = [load_video(v, index=i) for i, v in enumerate(as_videos(videos))]
        if videos:
            pixels, sizes, frame_sizes = [], [], []
            for frames in videos:
                p, s = lay([part for f in frames for part in parts(f, pc.video_max_slice_nums)])
                pixels.append(p)
                sizes.append(s)
                frame_sizes.append(torch.tensor([f.size for f in frames], dtype=torch.int64))
            out["video_pixel_values"] = pixels
            out["video_tgt_sizes"] = sizes
            out["video_image_sizes"] = frame_sizes
            out["video_use_vit_merger"] = torch.full((len(videos), 1), flag, dtype=torch.bool)
        return out

    # -- contract -----------------------------------------------------------------------

    def _slice_tokens(self, h: int, w: int, merged: bool) -> int:
        cfg = self.config
        if merged:
            h, w = h // cfg.window_kernel_size[0], w // cfg.window_kernel_size[1]
        for _ in range(cfg.merger_times):
            h, w = h // cfg.merge_kernel_size[0], w // cfg.merge_kernel_size[1]
        return h * w

    def _item_tokens(self, sizes: Sequence[tuple[int, int]], merged: bool) -> int:
        return sum(self._slice_tokens(h, w, merged) for h, w in sizes)

    def field_specs(self, outputs: Mapping[str, Any]) -> dict[str, FieldSpec]:
        """Per-item (batched) pixels, host slice sizes, host flags and host frame sizes;
        embeddings split by the tokens the host sizes give. Names exactly the fields present
        in ``outputs``."""
        specs: dict[str, FieldSpec] = {}
        for modality, names in _FIELDS.items():
            present = [n for n in names.values() if outputs.get(n) is not None]
            if not present:
                continue
            sizes_name = names["sizes"]
            if outputs.get(sizes_name) is None:
                raise ContractError(f"{sizes_name} is needed to split it", field=present[0])
            specs[sizes_name] = FieldSpec.batched(modality, placement="host")
            for key in ("flag", "frames"):
                if names.get(key) in present:
                    specs[names[key]] = FieldSpec.batched(modality, placement="host")
            if names["pixels"] in present:
                levels = _is_uint8(names["pixels"], outputs[names["pixels"]])
                specs[names["pixels"]] = FieldSpec.batched(
                    modality, normalize=self.normalize if levels else None)
            if names["embeds"] in present:
                sizes = _size_rows(sizes_name, outputs[sizes_name])
                flags = _flag_rows(names["flag"], outputs.get(names["flag"]), len(sizes),
                                   self.config.merger_default)
                tokens = [self._item_tokens(s, f) for s, f in zip(sizes, flags, strict=True)]
                specs[names["embeds"]] = FieldSpec.flat_from_sizes(modality, tokens)
        return specs

    def _modality_of(self, keys: Any) -> str:
        found = [m for m, names in _FIELDS.items() if any(k in keys for k in names.values())]
        if len(found) != 1:
            raise ContractError(f"expected the fields of exactly one of image or video, got "
                                f"{sorted(keys)}", field=None)
        unknown = set(keys) - set(_FIELDS[found[0]].values())
        if unknown:
            raise ContractError(f"not a {self.name} {found[0]} field", field=sorted(unknown)[0])
        return found[0]

    def _divisor(self, merged: bool) -> tuple[int, int]:
        cfg = self.config
        dh, dw = cfg.merge_kernel_size[0] ** cfg.merger_times, \
            cfg.merge_kernel_size[1] ** cfg.merger_times
        if merged:
            dh, dw = dh * cfg.window_kernel_size[0], dw * cfg.window_kernel_size[1]
        return dh, dw

    def check_item(self, item: Mapping[str, Any]) -> None:
        """Slice sizes ``(n, 2)`` of positive multiples of the merges the item goes through;
        pixels ``(n, C, P, L)`` with every slice's patches within ``L``, floating point or
        uint8 levels whose spec carries :attr:`normalize` (an :class:`~mmferry.items.Item`'s
        specs; a plain mapping has none, so its uint8 pixels are refused), or embeddings
        ``[tokens, hidden]``; one flag; video frame sizes ``(frames, 2)`` that divide the
        slices evenly."""
        names = _FIELDS[self._modality_of(item.keys())]
        sizes_name = names["sizes"]
        sizes = item.get(sizes_name)
        if (not isinstance(sizes, torch.Tensor) or sizes.ndim != 2 or sizes.shape[1] != 2
                or sizes.shape[0] < 1 or sizes.is_floating_point()):
            raise ContractError(f"expected integer [slices, 2], got {describe(sizes)}",
                                field=sizes_name)
        rows = _size_rows(sizes_name, [sizes])[0]
        flag = item.get(names["flag"])
        if flag is not None and (not isinstance(flag, torch.Tensor) or flag.numel() != 1):
            raise ContractError(f"expected one flag, got {describe(flag)}", field=names["flag"])
        merged = _flag_rows(names["flag"], flag, 1, self.config.merger_default)[0]
        dh, dw = self._divisor(merged)
        if any(h < 1 or w < 1 or h % dh or w % dw for h, w in rows):
            raise ContractError(f"slice grids {rows} must be positive multiples of ({dh}, {dw}) "
                                f"{'with' if merged else 'without'} the window merger",
                                field=sizes_name)
        if "frames" in names and names["frames"] in item:
            frames = item[names["frames"]]
            if (not isinstance(frames, torch.Tensor) or frames.ndim != 2 or frames.shape[1] != 2
                    or frames.shape[0] < 1 or len(rows) % frames.shape[0]):
                raise ContractError(f"expected [frames, 2] whose frames split the {len(rows)} "
                                    f"slices evenly, got {describe(frames)}",
                                    field=names["frames"])
        pixels_name, embeds_name = names["pixels"], names["embeds"]
        if (pixels_name in item) == (embeds_name in item):
            raise ContractError(f"an item holds {pixels_name} or {embeds_name}",
                                field=pixels_name)
        if pixels_name in item:
            cfg = self.config
            p = item[pixels_name]
            longest = max(h * w for h, w in rows) * cfg.patch_size
            if (not isinstance(p, torch.Tensor) or p.ndim != 4
                    or not (p.is_floating_point() or p.dtype == torch.uint8)
                    or tuple(p.shape[:3]) != (len(rows), cfg.num_channels, cfg.patch_size)
                    or p.shape[3] < longest or p.shape[3] % cfg.patch_size):
                raise ContractError(
                    f"expected uint8 or floating point [{len(rows)}, {cfg.num_channels}, "
                    f"{cfg.patch_size}, L >= {longest}] with L a multiple of "
                    f"{cfg.patch_size}, got {describe(p)}", field=pixels_name)
            if p.dtype == torch.uint8:
                check_normalize(item, pixels_name, self.normalize)
        else:
            e = item[embeds_name]
            tokens = self._item_tokens(rows, merged)
            if (not isinstance(e, torch.Tensor) or not e.is_floating_point()
                    or tuple(e.shape) != (tokens, self.hidden_size)):
                raise ContractError(f"expected floating point [{tokens}, {self.hidden_size}] "
                                    f"from {sizes_name}, got {describe(e)}", field=embeds_name)

    def tokens_per_item(self, item: Mapping[str, Any]) -> int:
        """Σ over the item's slices of ``h·w / 16`` with the window merger ("16x"), ``h·w / 4``
        without ("4x"), from the host sizes and flag."""
        names = _FIELDS[self._modality_of(item.keys())]
        if names["sizes"] not in item:
            raise ContractError("an item needs its slice sizes to count its tokens",
                                field=names["sizes"])
        rows = _size_rows(names["sizes"], [item[names["sizes"]]])[0]
        merged = _flag_rows(names["flag"], item.get(names["flag"]), 1,
                            self.config.merger_default)[0]
        return self._item_tokens(rows, merged)

    # -- encoder ------------------------------------------------------------------------

    def encode(self, **batch: Any) -> torch.Tensor:
        """One modality's batch to ``[Σ tokens, hidden_size]``, item after item, each item's
        source image then its slices (each slice's tokens row-major).

        Pixels are on the model's device; slice sizes and flags are read on the host (video
        frame sizes are not needed); ``image_embeds`` / ``video_embeds`` pass through.
        """
        names = _FIELDS[self._modality_of(batch.keys())]
        sizes_name, pixels_name, embeds_name = names["sizes"], names["pixels"], names["embeds"]
        if sizes_name not in batch:
            raise ContractError("missing from the batch", field=sizes_name)
        sizes = _size_rows(sizes_name, batch[sizes_name])
        flags = _flag_rows(names["flag"], batch.get(names["flag"]), len(sizes),
                           self.config.merger_default)
        tokens = sum(self._item_tokens(s, f) for s, f in zip(sizes, flags, strict=True))
        if embeds_name in batch:
            if pixels_name in batch:
                raise ContractError(f"give {pixels_name} or {embeds_name}, not both",
                                    field=embeds_name)
            out = batch[embeds_name]
            if out.ndim != 2 or tuple(out.shape) != (tokens, self.hidden_size):
                raise ContractError(f"expected [{tokens}, {self.hidden_size}] from "
                                    f"{sizes_name}, got {list(out.shape)}", field=embeds_name)
            return out
        if pixels_name not in batch:
            raise ContractError("missing from the batch", field=pixels_name)
        pixels = batch[pixels_name]
        pixels = list(pixels.unbind(0) if isinstance(pixels, torch.Tensor) else pixels)
        if len(pixels) != len(sizes):
            raise ContractError(f"{len(pixels)} items but {len(sizes)} in {sizes_name}",
                                field=pixels_name)
        for i, (p, s) in enumerate(zip(pixels, sizes, strict=True)):
            if p.ndim != 4 or p.shape[0] != len(s) or p.shape[3] < max(
                    (h * w for h, w in s), default=0) * self.config.patch_size:
                raise ContractError(f"item {i}: pixels {list(p.shape)} do not hold the "
                                    f"{len(s)} slices of {sizes_name}", field=pixels_name)
            dh, dw = self._divisor(flags[i])
            if any(h < 1 or w < 1 or h % dh or w % dw for h, w in s):
                raise ContractError(f"item {i}: slice grids {s} are not positive multiples "
                                    f"of ({dh}, {dw})", field=sizes_name)
        levels = _is_uint8(pixels_name, pixels)
        weight = self.vision_tower.embeddings.patch_embedding.weight
        if tokens == 0:
            return torch.empty(0, self.hidden_size, dtype=weight.dtype, device=weight.device)
        return self._forward(pixels, sizes, flags, levels)

    def _forward(self, pixels: list[torch.Tensor], sizes: list[list[tuple[int, int]]],
                 flags: list[bool], levels: bool) -> torch.Tensor:
        cfg = self.config
        patch = cfg.patch_size
        tower = self.vision_tower
        # Host plan. Slices are packed so that slices of one size are contiguous, the ones
        # that go through the window merger first: each run attends in one batched call,
        # with no padding, and the merger takes one leading span.
        slices: list[tuple[bool, int, int, int]] = []  # (bypass, h, w, first patch row)
        base = 0
        for p, s, merged in zip(pixels, sizes, flags, strict=True):
            per_slice = p.shape[3] // patch
            slices += [(not merged, h, w, base + j * per_slice) for j, (h, w) in enumerate(s)]
            base += p.shape[0] * per_slice
        order = sorted(range(len(slices)), key=lambda i: slices[i][:3])
        groups: list[Group] = []
        for i in order:
            bypass, h, w, _ = slices[i]
            if groups and (groups[-1].h, groups[-1].w, groups[-1].merged) == (h, w, not bypass):
                groups[-1] = replace(groups[-1], count=groups[-1].count + 1)
            else:
                groups.append(Group(1, h, w, not bypass))
        side = cfg.image_size // patch
        gather = torch.cat([torch.arange(first, first + h * w)
                            for _, h, w, first in (slices[i] for i in order)])
        positions = torch.cat([_position_ids(h, w, side)
                               for _, h, w, _ in (slices[i] for i in order)])
        # Output rows of each slice in packed order, then the item order the caller expects.
        counts = [self._slice_tokens(h, w, not bypass) for bypass, h, w, _ in slices]
        starts = [0] * len(slices)
        offset = 0
        for i in order:
            starts[i] = offset
            offset += counts[i]
        reorder = order != sorted(order)
        index = [gather, positions]
        if reorder:
            index.append(torch.cat([torch.arange(starts[i], starts[i] + counts[i])
                                    for i in range(len(slices))]))
        weight = tower.embeddings.patch_embedding.weight
        device = weight.device
        indices = upload(torch.cat(index), device)
        gather_d = indices[:len(gather)]
        positions_d = indices[len(gather):len(gather) + len(positions)]

        # Patch rows [Σ slices·L/P, C·P·P] in (channel, row, column) order, the real ones
        # gathered (padding is never read: a folded bias would make its zero levels count),
        # cast, then the patch embedding as one matmul: uint8 levels through the weight and
        # bias with the normalisation folded in, floating values through the checkpoint's.
        channels = cfg.num_channels
        bias = tower.embeddings.patch_embedding.bias
        if levels:
            weight, bias = tower.embeddings.patch_fold(weight, bias, self.normalize, 1)
        rows = [p.reshape(p.shape[0], channels, patch, p.shape[3] // patch, patch)
                .permute(0, 3, 1, 2, 4).reshape(-1, channels * patch * patch) for p in pixels]
        flat = rows[0] if len(rows) == 1 else torch.cat(rows)
        x = F.linear(flat.index_select(0, gather_d).to(weight.dtype),
                     weight.reshape(weight.shape[0], -1), bias)
        x = x + F.embedding(positions_d, tower.embeddings.position_embedding.weight)

        for layer_id, layer in enumerate(tower.encoder.layers[:cfg.depth]):
            x = layer(x, [(g.count, g.h * g.w) for g in groups])
            if layer_id == cfg.insert_layer_id and any(g.merged for g in groups):
                x, groups = self._window_merge(x, groups)
        x = tower.post_layernorm(x)

        m1, m2 = cfg.merge_kernel_size
        for mlp in self.merger.mlp:
            blocks = _space_to_depth(x, groups, m1, m2)
            x = mlp(blocks.reshape(blocks.shape[0], -1))
            groups = [replace(g, h=g.h // m1, w=g.w // m2) for g in groups]
        if reorder:
            x = x.index_select(0, indices[len(gather) + len(positions):])
        return x

    def _window_merge(self, x: torch.Tensor,
                      groups: list[Group]) -> tuple[torch.Tensor, list[Group]]:
        """The window merger on the merged groups (packed first); the others pass unchanged.
        New sizes are the host's ``size // k``: nothing is read back from the device."""
        kh, kw = self.config.window_kernel_size
        merged = [g for g in groups if g.merged]
        span = sum(g.count * g.h * g.w for g in merged)
        out = self.vision_tower.vit_merger(x[:span], merged)
        if span < x.shape[0]:
            out = torch.cat([out, x[span:]])
        return out, [replace(g, h=g.h // kh, w=g.w // kw) if g.merged else g for g in groups]

    def dummy_inputs(self) -> dict[str, Any]:
        """Processor output at a small ``scale_resolution`` (56): images in "16x" (one scaled
        up unsliced, one sliced 2×2 plus a source, one wide sliced 1×4) and two videos in
        "4x" (2 frames unsliced, 3 frames sliced)."""
        rng = np.random.default_rng(0)
        images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
                  for h, w in ((40, 50), (100, 120), (50, 220))]
        videos = [rng.integers(0, 256, (t, h, w, 3), dtype=np.uint8)
                  for t, h, w in ((2, 40, 50), (3, 60, 100))]
        out = self.processor(images=images, scale_resolution=56, downsample_mode="16x")
        out.update(self.processor(videos=videos, scale_resolution=56, downsample_mode="4x"))
        return out
