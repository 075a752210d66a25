"""Isaac (Perceptron): its image processor, field contract and vision encoder.

The processor matches vLLM 0.33's ``IsaacImageProcessor``: each image is resized with
bilinear interpolation on its uint8 pixels to sides that are multiples of ``patch ·
pixel_shuffle_scale``, its patch count kept within ``[min_num_patches, max_num_patches]`` by
the reference's binary search on the scale; cut into ``patch × patch`` patches flattened as
(row, column, channel); shipped as those uint8 levels with the normalisation (rescale to
``[-1, 1]``) on the field spec, or normalised to float32 as the reference does.
``image_grid_thw`` is ``(1, h, w)`` in patches.

Both resize modes give the reference's pixels: Isaac has no Pillow processor anywhere (vLLM's
and transformers' are torch only) and its filter, torch's bilinear without antialias on the
uint8 pixels, is already the fast kernel, so there is nothing slower to be exact to and
nothing faster that keeps the pixels.

The encoder is a Siglip2 NaViT: a Linear patch embedding (uint8 levels go through its
weights with the normalisation folded in) plus a learned square position grid, bilinearly
interpolated (with antialias) to each image's ``(h, w)``; pre-norm blocks attending within
each image; a post-LayerNorm; a pixel shuffle that concatenates each ``r × r``
neighbourhood; and a Linear -> SiLU -> Linear projector to the language model's width.
Parameters keep the published checkpoint's names under ``model.vision_embedding.``
(``0`` the vision transformer, ``1`` and ``3`` the projector).

Placement: ``image_grid_thw`` stays on the host. Every tensor the encoder derives from it (the
per-image position-table gather and the pixel-shuffle gather) is built on the host and
uploaded in one copy, and attention is split by host lengths, so the device never needs the
grid itself (vLLM uploads a non-dense slice of it and reads it back with ``int()`` /
``.tolist()``).
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
from mmferry.media import load_image, source_name
from mmferry.media.arguments import as_images
from mmferry.media.resize import DEFAULT_PIXEL_DTYPE, DEFAULT_RESIZE_MODE, check_pixel_options
from mmferry.models.blocks import PixelFold, check_normalize, describe, frame_attention
from mmferry.models.checkpoint import config_values, read_json
from mmferry.transfer import host_and_device, upload

__all__ = ["TINY", "IsaacModel", "ProcessorConfig", "VisionConfig", "check_patch_bounds",
           "target_size"]

# The reference refuses images above 60 megapixels before resizing.
MAX_PIXELS = 60_000_000
# The reference's rescale and normalisation (vLLM's constants; transformers' Isaac has the
# same, IMAGENET_STANDARD): levels to [-1, 1].
MEAN = STD = 0.5


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """The encoder part of an Isaac ``config.json``: its ``vision_config`` (defaults are
    ``PixelShuffleSiglip2VisionConfig``'s) and the language model's width."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    patch_size: int = 16
    num_patches: int = 256  # the learned position grid, a square of this many cells
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    pixel_shuffle_scale_factor: int = 1
    text_hidden_size: int = 2048  # the projector's output: the language model's width

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> VisionConfig:
        """Read a checkpoint's ``config.json`` content.

        The text width is the top-level ``hidden_size`` (``IsaacConfig`` is a Qwen3 config),
        else ``text_config.hidden_size``.
        """
        model_type = config.get("model_type")
        if model_type not in (None, "isaac"):
            raise ArgumentError(f"config is for model_type {model_type!r}, not 'isaac'",
                                argument="config")
        vision = config.get("vision_config") or {}
        text = config.get("text_config") or {}
        for key, value in (("vision_config", vision), ("text_config", text)):
            if not isinstance(value, Mapping):
                raise ArgumentError(f"{key} must be an object, got {value!r}", argument="config")
        width = config.get("hidden_size", text.get("hidden_size"))
        if not isinstance(width, int) or isinstance(width, bool) or width < 1:
            raise ArgumentError("hidden_size (the language model's width, at the top level or "
                                f"in text_config) must be a positive integer, got {width!r}",
                                argument="config")
        values = {k: v for k, v in vision.items() if k != "text_hidden_size"}
        out = cls(**config_values(cls, values, "vision_config"), text_hidden_size=width)
        if out.hidden_size % out.num_attention_heads:
            raise ArgumentError(f"vision_config.hidden_size {out.hidden_size} does not split "
                                f"into {out.num_attention_heads} heads", argument="config")
        if math.isqrt(out.num_patches) ** 2 != out.num_patches:
            raise ArgumentError(f"vision_config.num_patches {out.num_patches} is not a square "
                                "(the position grid is side × side)", argument="config")
        if out.hidden_act not in _ACTIVATIONS:
            raise ArgumentError(f"vision_config.hidden_act {out.hidden_act!r} is not one of "
                                f"{sorted(_ACTIVATIONS)}", argument="config")
        return out


TINY = VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=2, patch_size=8, num_patches=16,
                    pixel_shuffle_scale_factor=2, text_hidden_size=48)


@dataclass(frozen=True, slots=True)
class ProcessorConfig:
    """Patch-count bounds of the resize; defaults are vLLM's ``IsaacImageProcessor``'s (which
    never reads the checkpoint's processor files). Patch size and shuffle scale are the
    encoder's."""

    max_num_patches: int = 6144
    min_num_patches: int | None = 256

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], vision: VisionConfig) -> ProcessorConfig:
        """Read a checkpoint's ``preprocessor_config.json`` content (transformers' Isaac
        image processor keys, or the ``vision_``-prefixed ones of vLLM's)."""
        for key, want in (("patch_size", vision.patch_size),
                          ("pixel_shuffle_scale", vision.pixel_shuffle_scale_factor)):
            if key in config and config[key] != want:
                raise ArgumentError(f"preprocessor_config {key} {config[key]!r} disagrees with "
                                    f"the encoder's {want}", argument="config")
        out = cls()
        max_n = config.get("max_num_patches", config.get("vision_max_num_patches",
                                                         out.max_num_patches))
        min_n = config.get("min_num_patches", config.get("vision_min_num_patches",
                                                         out.min_num_patches))
        check_patch_bounds(max_n, min_n, vision.patch_size, argument="config")
        return replace(out, max_num_patches=max_n, min_num_patches=min_n)


def check_patch_bounds(max_num_patches: Any, min_num_patches: Any, patch: int, *,
                       argument: str) -> None:
    """``max_num_patches`` and ``min_num_patches`` (or ``None``) as ints in ``[1, cap]``,
    ``cap`` the reference's 60-megapixel input ceiling in ``patch × patch`` patches: a larger
    minimum would blow a small image up beyond any image the reference accepts.

    Raises:
        ArgumentError: naming the option (``argument="options"``), else ``argument``.
    """
    cap = MAX_PIXELS // patch ** 2
    for name, value in (("max_num_patches", max_num_patches),
                        ("min_num_patches", min_num_patches)):
        if value is None and name == "min_num_patches":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= cap:
            raise ArgumentError(f"{name} must be an int in [1, {cap}], got {value!r}",
                                argument=name if argument == "options" else argument)


def target_size(height: int, width: int, patch: int, scale: int, max_num_patches: int,
                min_num_patches: int | None, eps: float = 1e-5) -> tuple[int, int]:
    """The ``(height, width)`` Isaac resizes an image to: multiples of ``patch · scale``
    whose patch count is within the bounds, found as the reference finds it (rounding each
    side up at a scale chosen by bisection to ``eps``)."""
    step = patch * scale

    def side(factor: float, size: int) -> int:
        return max(step, math.ceil(factor * size / step) * step)

    def patches(h: int, w: int) -> float:
        return (h / patch) * (w / patch)

    h, w = side(1, height), side(1, width)
    if min_num_patches is not None and patches(h, w) < min_num_patches:
        lo, hi = 1.0, 100.0  # grow: the smallest scale that reaches the minimum
        while hi - lo >= eps:
            mid = (lo + hi) / 2
            if patches(side(mid, height), side(mid, width)) >= min_num_patches:
                hi = mid
            else:
                lo = mid
        return side(hi, height), side(hi, width)
    if patches(h, w) <= max_num_patches:
        return h, w
    lo, hi = eps / 10, 1.0  # shrink: the largest scale that stays within the maximum
    while hi - lo >= eps:
        mid = (lo + hi) / 2
        if patches(side(mid, height), side(mid, width)) <= max_num_patches:
            lo = mid
        else:
            hi = mid
    return side(lo, height), side(lo, width)


# -- processor ---------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _normalise_table() -> np.ndarray:
    """float32 ``[256]``: each uint8 value rescaled by 1/255 and normalised by :data:`MEAN`
    and :data:`STD`, with the reference's float32 torch arithmetic, so a lookup gives its
    values bit for bit."""
    mean, std = torch.tensor(MEAN, dtype=torch.float32), torch.tensor(STD, dtype=torch.float32)
    table = ((torch.arange(256, dtype=torch.float32) * (1 / 255) - mean) / std).numpy()
    table.setflags(write=False)
    return table


def _resize(img: Image.Image, height: int, width: int) -> np.ndarray:
    """uint8 ``[height, width, C]``: the reference's resize, torch's bilinear interpolation
    (no antialias) run on the uint8 channels-last pixels, which rounds back to uint8. Both
    resize modes use it (see the module docstring)."""
    if img.size == (width, height):
        return np.asarray(img)  # read only: the patchify copies it
    pixels = torch.from_numpy(np.array(img, dtype=np.uint8))  # a writable copy
    return F.interpolate(pixels[None].permute(0, 3, 1, 2), size=(height, width),
                         mode="bilinear", align_corners=False)[0].permute(1, 2, 0).numpy()


def _patches(pixels: np.ndarray, patch: int) -> np.ndarray:
    """A view of ``pixels`` (``[H, W, C]``) as ``[h, w, P, P·C]`` patches: rows of the output
    run over patches in raster order, columns over (row in patch, column in patch, channel)."""
    height, width, c = pixels.shape
    h, w = height // patch, width // patch
    return pixels.reshape(h, patch, w, patch * c).transpose(0, 2, 1, 3)


def _patchify_into(out: np.ndarray, pixels: np.ndarray, patch: int) -> None:
    """Write ``pixels`` (uint8 ``[H, W, C]``) into ``out`` (``[h·w, P·P·C]``): as uint8 levels
    when ``out`` is uint8, else normalised to float32 by a table lookup on the reordered
    uint8 pixels (reordered first: a quarter of the float bytes)."""
    ordered = _patches(pixels, patch)
    if out.dtype == np.uint8:
        out.reshape(ordered.shape)[...] = ordered
    else:
        np.take(_normalise_table(), ordered.reshape(out.shape), out=out, mode="clip")


# -- encoder -----------------------------------------------------------------------------


_ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "silu": F.silu,
}


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, runs: Sequence[tuple[int, int]]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (p(x).view(n, self.num_heads, -1) for p in (self.q_proj, self.k_proj,
                                                                self.v_proj))
        return self.out_proj(frame_attention(q, k, v, runs))


class Mlp(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = Attention(cfg.hidden_size, cfg.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = Mlp(cfg)

    def forward(self, x: torch.Tensor, runs: Sequence[tuple[int, int]]) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), runs)
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))


class Embeddings(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Linear(cfg.num_channels * cfg.patch_size ** 2, cfg.hidden_size)
        self.position_embedding = nn.Embedding(cfg.num_patches, cfg.hidden_size)
        self.normalize = Normalize((MEAN,) * cfg.num_channels, (STD,) * cfg.num_channels)
        self._fold = PixelFold()

    def embed_patches(self, pixels: torch.Tensor) -> torch.Tensor:
        """The patch embedding of ``[n, P·P·C]`` pixels: floating point ones through the
        checkpoint's weights, uint8 levels (cast to the weights' dtype, exact for 0..255 in
        any float dtype) through the weights with :attr:`normalize` folded in, so no
        normalising pass runs. Columns are (row, column, channel): channel innermost."""
        linear = self.patch_embedding
        weight = linear.weight
        if pixels.dtype != torch.uint8:
            return linear(pixels.to(weight.dtype))
        c = self.normalize.channels
        folded, bias = self._fold(weight.view(weight.shape[0], -1, c), linear.bias,
                                  self.normalize, channel_dim=2)
        return F.linear(pixels.to(weight.dtype), folded.view_as(weight), bias)

    def position_tables(self, shapes: Sequence[tuple[int, int]]) -> torch.Tensor:
        """The position grid resized to each of ``shapes`` (bilinear, antialiased, as the
        reference), concatenated: ``[Σ h·w, hidden]``. The sizes are host ints. Interpolated
        in float32 (antialias has no half-precision CPU kernel), then cast to the weights'."""
        weight = self.position_embedding.weight
        side = math.isqrt(weight.shape[0])
        grid = weight.float().view(side, side, -1).permute(2, 0, 1)[None]  # [1, D, S, S]
        tables = [F.interpolate(grid, size=(h, w), mode="bilinear", align_corners=False,
                                antialias=True).flatten(2)[0].T for h, w in shapes]
        return (tables[0] if len(tables) == 1 else torch.cat(tables)).to(weight.dtype)


class VisionTransformer(nn.Module):
    """Siglip2 NaViT with pixel shuffle: ``model.vision_embedding.0`` of the checkpoint."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixels: torch.Tensor, grid: Sequence[tuple[int, int]]) -> torch.Tensor:
        """``pixels`` ``[Σ h·w, C·P·P]`` on the device, ``grid`` host ``(h, w)`` per image;
        returns ``[Σ h·w / r², hidden·r²]``."""
        r = self.cfg.pixel_shuffle_scale_factor
        shapes = list(dict.fromkeys(grid))  # distinct sizes, first-seen order
        # Gather indices from host ints, uploaded together in one copy: the rows of the
        # distinct-size position tables for each image (only when a size repeats: each size
        # is interpolated once), and the pixel-shuffle order.
        host: dict[str, np.ndarray] = {}
        if len(shapes) < len(grid):
            host["positions"] = _position_index(grid, shapes)
        if r > 1:
            host["shuffle"] = _shuffle_index(grid, r)
        index: dict[str, torch.Tensor] = {}
        if host:
            flat = upload(torch.from_numpy(np.concatenate(list(host.values()))), pixels.device)
            index = dict(zip(host, flat.split([len(v) for v in host.values()]), strict=True))
        x = self.embeddings.embed_patches(pixels)
        positions = self.embeddings.position_tables(shapes)
        if "positions" in index:
            positions = positions.index_select(0, index["positions"])
        x = x + positions
        runs: list[tuple[int, int]] = []
        for h, w in grid:
            if runs and runs[-1][1] == h * w:
                runs[-1] = (runs[-1][0] + 1, h * w)
            else:
                runs.append((1, h * w))
        for layer in self.encoder.layers:
            x = layer(x, runs)
        x = self.post_layernorm(x)
        if r > 1:
            # Each output row is one r×r neighbourhood's rows, side by side.
            x = x.index_select(0, index["shuffle"]).view(-1, x.shape[1] * r * r)
        return x


def _position_index(grid: Sequence[tuple[int, int]], shapes: list[tuple[int, int]]) -> np.ndarray:
    """Rows of the concatenated distinct-size position tables, for each image in order."""
    starts, start = {}, 0
    for h, w in shapes:
        starts[h, w] = start
        start += h * w
    return np.concatenate([starts[h, w] + np.arange(h * w) for h, w in grid])


@lru_cache(maxsize=256)
def _shuffle_block(h: int, w: int, r: int) -> np.ndarray:
    """Row order that groups one ``h×w`` image's rows by ``r×r`` neighbourhood (neighbourhoods
    in raster order, rows in raster order within each)."""
    order = np.arange(h * w).reshape(h // r, r, w // r, r).transpose(0, 2, 1, 3).reshape(-1)
    order.setflags(write=False)
    return order


def _shuffle_index(grid: Sequence[tuple[int, int]], r: int) -> np.ndarray:
    out, start = [], 0
    for h, w in grid:
        out.append(_shuffle_block(h, w, r) + start)
        start += h * w
    return np.concatenate(out)


class VisionEmbedding(nn.Sequential):
    """``model.vision_embedding``: the vision transformer (``0``), then the projector
    Linear (``1``) -> SiLU (``2``) -> Linear (``3``), both without bias."""

    def __init__(self, cfg: VisionConfig) -> None:
        shuffled = cfg.hidden_size * cfg.pixel_shuffle_scale_factor ** 2
        super().__init__(VisionTransformer(cfg), nn.Linear(shuffled, 4 * shuffled, bias=False),
                         nn.SiLU(), nn.Linear(4 * shuffled, cfg.text_hidden_size, bias=False))

    def forward(self, pixels: torch.Tensor, grid: Sequence[tuple[int, int]]) -> torch.Tensor:
        tower, fc1, act, fc2 = self
        return fc2(act(fc1(tower(pixels, grid))))


# -- the model ---------------------------------------------------------------------------

_PIXELS, _GRID = "pixel_values", "image_grid_thw"


def _grid_rows(grid: Any) -> list[tuple[int, int, int]]:
    """``image_grid_thw`` (a batch's ``[n, 3]`` tensor or a list of rows) as host ints."""
    if isinstance(grid, torch.Tensor | np.ndarray):
        if grid.ndim != 2:
            raise ContractError(f"expected [items, 3], got shape {list(grid.shape)}", field=_GRID)
        rows = grid.tolist()
    else:
        rows = [g.tolist() if isinstance(g, torch.Tensor) else list(g) for g in grid]
    if any(len(r) != 3 for r in rows):
        raise ContractError(f"expected rows of (t, h, w), got {rows}", field=_GRID)
    return [(int(t), int(h), int(w)) for t, h, w in rows]


class IsaacModel(nn.Module):
    """Isaac's image encoder as the runtime drives it (see
    :class:`mmferry.encoder.model.EncoderModel`).

    Build with :func:`mmferry.models.load`. Parameters live under ``vision_embedding.`` with
    the published checkpoint's names (``model.vision_embedding.`` there).
    """

    name = "isaac"
    modalities = ("image",)
    # vLLM's Isaac takes pixels only (no precomputed image embeddings).
    precomputed_fields = frozenset()
    checkpoint_prefixes: ClassVar[Mapping[str, str]] = MappingProxyType(
        {"model.vision_embedding.": "vision_embedding.", "vision_embedding.": "vision_embedding."})

    def __init__(self, config: VisionConfig = TINY,
                 processor_config: ProcessorConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.processor_config = processor_config or ProcessorConfig()
        self.hidden_size = config.text_hidden_size
        self.vision_embedding = VisionEmbedding(config)

    @property
    def normalize(self) -> Normalize:
        """What the processor's uint8 levels stand for (the reference's rescale and
        normalisation), declared on the pixel field's spec and folded into the patch
        embedding."""
        return self.vision_embedding[0].embeddings.normalize

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None,
                    folder: Path | None = None) -> IsaacModel:
        """The tiny encoder (``config=None``) or the one a ``config.json`` describes; a
        checkpoint folder's ``preprocessor_config.json`` sets the resize bounds."""
        vision = TINY if config is None else VisionConfig.from_dict(config)
        processor = ProcessorConfig()
        if folder is not None and (folder / "preprocessor_config.json").is_file():
            processor = ProcessorConfig.from_dict(read_json(folder, "preprocessor_config.json"),
                                                  vision)
        return cls(vision, processor)

    def processor(self, *, images: Any = None, videos: Any = None, audios: Any = None,
                  max_num_patches: int | None = None, min_num_patches: int | None = None,
                  pixel_dtype: str = DEFAULT_PIXEL_DTYPE, resize_mode: str = DEFAULT_RESIZE_MODE,
                  **kwargs: Any) -> dict[str, torch.Tensor]:
        """Images to ``pixel_values`` ``[Σ h·w, P·P·C]`` and ``image_grid_thw`` ``[n, 3]``
        int64 rows ``(1, h, w)`` in patches.

        ``images``: one image or a sequence, each anything :func:`mmferry.media.load_image`
        takes. ``max_num_patches`` / ``min_num_patches`` override the resize bounds (the
        reference's per-call options). ``pixel_dtype="uint8"`` (the default) gives the resized
        pixels' levels, not normalised (:meth:`field_specs` puts :attr:`normalize` on them);
        ``"float32"`` normalises them as the reference does. ``resize_mode`` is ``"fast"`` or
        ``"exact"``; both give the reference's pixels (see the module docstring). No images:
        an empty output.

        Raises:
            MediaError: a source cannot be decoded or has more than 60 megapixels; it names
                the file or ``item N``.
            ArgumentError: videos or audio, another option, a pixel option outside
                :func:`mmferry.media.resize.check_pixel_options`, or a bound outside
                :func:`check_patch_bounds`.
        """
        if kwargs:
            raise ArgumentError(f"unknown processor option(s) {sorted(kwargs)}; isaac takes "
                                "max_num_patches, min_num_patches, pixel_dtype and resize_mode",
                                argument=sorted(kwargs)[0])
        for name, value in (("videos", videos), ("audios", audios)):
            if value is not None:
                raise ArgumentError("isaac takes images only", argument=name)
        check_pixel_options(pixel_dtype, resize_mode)
        pc = self.processor_config
        max_n = pc.max_num_patches if max_num_patches is None else max_num_patches
        min_n = pc.min_num_patches if min_num_patches is None else min_num_patches
        check_patch_bounds(max_n, min_n, self.config.patch_size, argument="options")
        sources = as_images(images)
        loaded = [load_image(x, index=i, max_pixels=MAX_PIXELS) for i, x in enumerate(sources)]
        if not loaded:
            return {}
        cfg = self.config
        patch, r = cfg.patch_size, cfg.pixel_shuffle_scale_factor
        sizes = [target_size(img.height, img.width, patch, r, max_n, min_n) for img in loaded]
        rows = [(h // patch) * (w // patch) for h, w in sizes]
        dtype = torch.uint8 if pixel_dtype == "uint8" else torch.float32
        pixels = torch.empty((sum(rows), cfg.num_channels * patch * patch), dtype=dtype)
        flat, start = pixels.numpy(), 0
        for i, (img, (h, w), n) in enumerate(zip(loaded, sizes, rows, strict=True)):
            resized = _resize(img, h, w)
            if resized.shape[2] != cfg.num_channels:
                raise MediaError(f"has {resized.shape[2]} channels, the encoder takes "
                                 f"{cfg.num_channels}", source=source_name(sources[i], i))
            _patchify_into(flat[start:start + n], resized, patch)
            start += n
        grid = torch.tensor([(1, h // patch, w // patch) for h, w in sizes], dtype=torch.int64)
        return {_PIXELS: pixels, _GRID: grid}

    def field_specs(self, outputs: Mapping[str, Any]) -> dict[str, FieldSpec]:
        """Pixels split by the grid (``h·w`` rows per image), with :attr:`normalize` when they
        are uint8 levels; the grid per image, on the host (the encoder reads it only there).
        Names exactly the fields present."""
        if outputs.get(_GRID) is None:
            if outputs.get(_PIXELS) is not None:
                raise ContractError(f"{_GRID} is needed to split it", field=_PIXELS)
            return {}
        specs = {_GRID: FieldSpec.batched("image", placement="host")}
        if outputs.get(_PIXELS) is not None:
            patches = torch.as_tensor(outputs[_GRID]).reshape(-1, 3).prod(-1)
            levels = getattr(outputs[_PIXELS], "dtype", None) == torch.uint8
            specs[_PIXELS] = FieldSpec.flat_from_sizes(
                "image", patches, normalize=self.normalize if levels else None)
        return specs

    def _check_grid(self, grid: list[tuple[int, int, int]]) -> None:
        r = self.config.pixel_shuffle_scale_factor
        for t, h, w in grid:
            if t != 1 or h < 1 or w < 1 or h % r or w % r:
                raise ContractError(f"grid (t, h, w) = {(t, h, w)} must have t = 1 and positive "
                                    f"h, w multiples of the pixel shuffle scale {r}", field=_GRID)

    def check_item(self, item: Mapping[str, Any]) -> None:
        """One ``(1, h, w)`` grid row with ``h, w`` multiples of the shuffle scale; pixels
        ``[h·w, C·P·P]`` floating point, or uint8 levels whose spec (``item.specs``, an
        :class:`mmferry.Item`'s) carries :attr:`normalize`."""
        unknown = set(item) - {_PIXELS, _GRID}
        if unknown:
            raise ContractError("not an isaac field", field=sorted(unknown)[0])
        grid = item.get(_GRID)
        if not isinstance(grid, torch.Tensor) or grid.shape != (3,) or grid.is_floating_point():
            raise ContractError(f"expected one integer (t, h, w) row, got {describe(grid)}",
                                field=_GRID)
        ((t, h, w),) = _grid_rows([grid])
        self._check_grid([(t, h, w)])
        cfg = self.config
        rows, cols = h * w, cfg.num_channels * cfg.patch_size ** 2
        value = item.get(_PIXELS)
        if (not isinstance(value, torch.Tensor)
                or not (value.is_floating_point() or value.dtype == torch.uint8)
                or tuple(value.shape) != (rows, cols)):
            raise ContractError(f"expected uint8 or floating point [{rows}, {cols}] from "
                                f"{_GRID} {(t, h, w)}, got {describe(value)}", field=_PIXELS)
        if value.dtype == torch.uint8:
            check_normalize(item, _PIXELS, self.normalize)

    def tokens_per_item(self, item: Mapping[str, Any]) -> int:
        """``t·h·w / r²`` from the item's host grid."""
        if _GRID not in item:
            raise ContractError("an item needs it to count its tokens", field=_GRID)
        ((t, h, w),) = _grid_rows([host_and_device(item[_GRID])[0]])
        return t * h * w // self.config.pixel_shuffle_scale_factor ** 2

    def encode(self, **batch: Any) -> torch.Tensor:
        """One image batch (``pixel_values`` on the device, ``image_grid_thw`` on the host) to
        ``[Σ h·w / r², hidden_size]``. uint8 pixels are levels of :attr:`normalize` (which
        ``check_item`` has held each item's spec to) and meet the folded patch embedding;
        floating point ones are already normalised."""
        unknown = set(batch) - {_PIXELS, _GRID}
        if unknown:
            raise ContractError("not an isaac field", field=sorted(unknown)[0])
        for name in (_GRID, _PIXELS):
            if name not in batch:
                raise ContractError("missing from the batch", field=name)
        grid_host, _ = host_and_device(batch[_GRID])
        grid = _grid_rows(grid_host)
        self._check_grid(grid)
        pixels = batch[_PIXELS]
        cfg = self.config
        rows, cols = sum(h * w for _, h, w in grid), cfg.num_channels * cfg.patch_size ** 2
        if pixels.ndim != 2 or tuple(pixels.shape) != (rows, cols):
            raise ContractError(f"expected [{rows}, {cols}] from {_GRID}, got shape "
                                f"{list(pixels.shape)}", field=_PIXELS)
        if not rows:
            weight = self.vision_embedding[3].weight
            return torch.empty(0, self.hidden_size, dtype=weight.dtype, device=weight.device)
        return self.vision_embedding(pixels, [(h, w) for _, h, w in grid])

    def dummy_inputs(self) -> dict[str, torch.Tensor]:
        """Processor output for three seeded images at small bounds: one grown to the minimum,
        one shrunk to the maximum, one kept, two of them the same size (the position-table
        gather) and different aspect ratios."""
        rng = np.random.default_rng(0)
        p = self.config.patch_size * self.config.pixel_shuffle_scale_factor
        shapes = ((p, 2 * p), (5 * p, 3 * p), (7 * p, 4 * p), (p // 2, p))
        images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in shapes]
        return self.processor(images=images, max_num_patches=64, min_num_patches=32)
