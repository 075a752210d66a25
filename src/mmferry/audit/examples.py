"""Small encoders that reproduce the placement patterns of real models (see
reference/models.md), each with its correct field specs and wrong ones.

They serve the tests, ``mmferry audit --example NAME`` and the benchmarks. Lines the
audit must point at carry a ``# at: NAME`` marker; :func:`line_of` finds them, so
expectations survive edits.

Encoders that take a ``both`` field accept either a :class:`~mmferry.transfer.Mirrored`
or a plain tensor (:func:`host_and_device`), so the same code runs under every placement.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mmferry.fields import FieldSpec, Placement
from mmferry.transfer import Mirrored, host_and_device, upload

__all__ = ["EXAMPLES", "Case", "Example", "line_of", "names"]


@functools.cache
def _source_lines() -> tuple[str, ...]:
    with open(__file__, encoding="utf-8") as f:
        return tuple(f.read().splitlines())


def line_of(marker: str) -> int:
    """The line number carrying ``# at: marker`` in this file."""
    tag = f"# at: {marker}"
    hits = [i + 1 for i, line in enumerate(_source_lines()) if line.rstrip().endswith(tag)]
    if len(hits) != 1:
        raise KeyError(f"marker {marker!r} found {len(hits)} times")
    return hits[0]


# -- building blocks --------------------------------------------------------------------


class Block(nn.Module):
    """Pre-norm transformer block over ``(batch, length, dim)`` with an optional mask."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, d = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, n, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def _seeded(build: Callable[[], nn.Module]) -> nn.Module:
    # Deterministic weights without touching the caller's RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return build().eval()


# -- Qwen2-VL: the grid is read on the host --------------------------------------------


class Qwen2VLLike(nn.Module):
    """``image_grid_thw`` drives host loops (position ids, per-frame attention windows,
    split sizes); derived index tensors are uploaded once, pinned and asynchronously.
    Correct: ``pixel_values`` on the device, ``image_grid_thw`` on the host."""

    def __init__(self, dim: int = 32, heads: int = 2, depth: int = 2, patch_dim: int = 48,
                 merge: int = 2, out_dim: int = 64) -> None:
        super().__init__()
        self.merge = merge
        self.patch_embed = nn.Linear(patch_dim, dim, bias=False)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.merger = nn.Sequential(nn.LayerNorm(dim * merge * merge),
                                    nn.Linear(dim * merge * merge, out_dim))
        rot = dim // heads // 2
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, rot, 2) / rot))

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        grid = image_grid_thw.tolist()  # at: qwen2vl.grid
        x = self.patch_embed(pixel_values)  # at: qwen2vl.embed
        pos = torch.cat([_hw_positions(t, h, w) for t, h, w in grid])
        pos = upload(pos, x.device)
        side = int(image_grid_thw[:, 1:].max())  # at: qwen2vl.side
        freqs = torch.outer(torch.arange(side, device=x.device, dtype=torch.float32),
                            self.inv_freq)
        rot = freqs[pos].flatten(1)
        x = x + rot.repeat(1, x.shape[-1] // rot.shape[-1])
        t, h, w = image_grid_thw.unbind(-1)
        frames = torch.repeat_interleave(h * w, t)  # at: qwen2vl.frames
        cu_seqlens = F.pad(frames.cumsum(0), (1, 0))
        bounds = cu_seqlens.tolist()  # at: qwen2vl.bounds
        outs = []
        for start, end in itertools.pairwise(bounds):
            s = x[start:end][None]
            for blk in self.blocks:
                s = blk(s)
            outs.append(s[0])
        x = torch.cat(outs).reshape(-1, x.shape[-1] * self.merge**2)
        return self.merger(x)


def _hw_positions(t: int, h: int, w: int) -> torch.Tensor:
    rows = torch.arange(h).unsqueeze(1).expand(-1, w)
    cols = torch.arange(w).unsqueeze(0).expand(h, -1)
    return torch.stack([rows.flatten(), cols.flatten()], -1).repeat(t, 1)


def _qwen2vl_inputs() -> dict[str, Any]:
    grid = torch.tensor([[1, 4, 6], [2, 2, 4]])
    n = int(grid.prod(-1).sum())
    return {"pixel_values": torch.randn(n, 48, generator=torch.Generator().manual_seed(1)),
            "image_grid_thw": grid}


# -- MiniCPM-V: sizes build a device mask and position ids -----------------------------


class MiniCPMVLike(nn.Module):
    """``tgt_sizes`` (patch rows, cols per image) builds the patch mask and bucketised
    position ids on the device (NaViT style). Correct: both fields on the device."""

    def __init__(self, dim: int = 32, heads: int = 2, depth: int = 2, patch_dim: int = 48,
                 side: int = 8, queries: int = 4) -> None:
        super().__init__()
        self.side = side
        self.patch_embed = nn.Linear(patch_dim, dim)
        self.pos_embed = nn.Embedding(side * side, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.query = nn.Parameter(torch.randn(queries, dim))
        self.kv = nn.Linear(dim, 2 * dim)

    def forward(self, pixel_values: torch.Tensor, tgt_sizes: torch.Tensor) -> torch.Tensor:
        b, length, _ = pixel_values.shape
        idx = torch.arange(length, device=pixel_values.device)[None, :]
        h, w = tgt_sizes[:, :1], tgt_sizes[:, 1:]
        valid = idx < h * w  # at: minicpmv.mask
        row, col = idx // w, idx % w  # at: minicpmv.rowcol
        pos = (row * self.side // h) * self.side + col * self.side // w  # at: minicpmv.bucket
        pos = torch.where(valid, pos, 0)
        x = self.patch_embed(pixel_values) + self.pos_embed(pos)
        mask = valid[:, None, None, :]
        for blk in self.blocks:
            x = blk(x, mask)
        k, v = self.kv(x).chunk(2, -1)
        q = self.query.expand(b, -1, -1)
        out = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], attn_mask=mask)
        return out[:, 0].flatten(0, 1)


def _minicpmv_inputs() -> dict[str, Any]:
    return {"pixel_values": torch.randn(2, 24, 48, generator=torch.Generator().manual_seed(2)),
            "tgt_sizes": torch.tensor([[4, 6], [3, 3]])}


# -- Qwen2-Audio: the mask is summed to lengths used on the device and on the host -----


class Qwen2AudioLike(nn.Module):
    """``feature_attention_mask`` masks the features and, summed to lengths, builds the
    padding mask on the device; the per-item output sizes come from the host side.
    Correct: ``input_features`` on the device, the mask ``both``."""

    def __init__(self, mels: int = 16, dim: int = 32, heads: int = 2, depth: int = 2,
                 out_dim: int = 48) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(mels, dim, 3, padding=1)
        self.conv2 = nn.Conv1d(dim, dim, 3, stride=2, padding=1)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.proj = nn.Linear(dim, out_dim)

    def forward(self, input_features: torch.Tensor,
                feature_attention_mask: torch.Tensor | Mirrored) -> torch.Tensor:
        mask_host, mask = host_and_device(feature_attention_mask)
        x = input_features * mask[:, None, :].to(input_features.dtype)  # at: audio.features
        out_lengths = (mask.sum(-1) - 1) // 2 + 1
        x = F.gelu(self.conv2(F.gelu(self.conv1(x)))).transpose(1, 2)
        frames = torch.arange(x.shape[1], device=x.device)[None, :]
        pad = frames >= out_lengths[:, None]  # at: audio.pad
        for blk in self.blocks:
            x = blk(x, ~pad[:, None, None, :])
        feats = self.proj(x)
        sizes = ((mask_host.sum(-1) - 1) // 2 + 1).tolist()  # at: audio.sizes
        return torch.cat([feats[i, :n] for i, n in enumerate(sizes)])


def _audio_inputs() -> dict[str, Any]:
    mask = torch.zeros(2, 40, dtype=torch.long)
    mask[0, :40], mask[1, :23] = 1, 1
    return {"input_features": torch.randn(2, 16, 40, generator=torch.Generator().manual_seed(3)),
            "feature_attention_mask": mask}


# -- FireRedLID: lengths compared with a device arange ---------------------------------


class FireRedLIDLike(nn.Module):
    """``speech_lengths`` is moved with ``torch.as_tensor(..., device=)`` and compared with a
    device ``arange`` to build the padding mask; the encoder output is pooled over valid
    frames into language logits. Correct: both fields on the device (on the host the
    ``as_tensor`` is a blocking copy, as after vLLM #52827)."""

    def __init__(self, idim: int = 16, dim: int = 32, heads: int = 2, vocab: int = 16) -> None:
        super().__init__()
        self.sub1 = nn.Conv1d(idim, dim, 3, stride=2, padding=1)
        self.sub2 = nn.Conv1d(dim, dim, 3, stride=2, padding=1)
        self.block = Block(dim, heads)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_features: torch.Tensor, speech_lengths: torch.Tensor) -> torch.Tensor:
        device = input_features.device
        lengths = torch.as_tensor(speech_lengths, dtype=torch.int32, device=device)  # at: lid.lengths
        frames = torch.arange(input_features.shape[1], device=device)
        mask = frames[None, :] < lengths[:, None]
        x = F.relu(self.sub1(input_features.transpose(1, 2)))
        x = F.relu(self.sub2(x)).transpose(1, 2)
        mask = mask[:, ::2][:, ::2]
        x = self.block(x, mask[:, None, None, :])
        valid = mask.unsqueeze(-1).to(x.dtype)
        pooled = (x * valid).sum(1) / valid.sum(1).clamp(min=1)
        return self.head(pooled)


def _lid_inputs() -> dict[str, Any]:
    return {"input_features": torch.randn(2, 40, 16, generator=torch.Generator().manual_seed(4)),
            "speech_lengths": torch.tensor([40, 25])}


# -- Isaac: the grid is uploaded from a non-contiguous slice and read back ------------


class IsaacLike(nn.Module):
    """Siglip2-NaViT style: per-image position embeddings interpolated to (h, w), varlen
    attention over images. ``variant="shipped"`` is vLLM's code after #52881: it uploads
    ``image_grid_thw[:, 1:3]`` with ``non_blocking=True`` from unpinned, non-contiguous
    memory and reads the device copy back. ``variant="fixed"`` does all grid math on the
    host. Correct: ``image_grid_thw`` on the host with the fixed code."""

    def __init__(self, variant: str = "fixed", dim: int = 32, heads: int = 2,
                 patch_dim: int = 48, grid: int = 4) -> None:
        super().__init__()
        if variant not in ("fixed", "shipped"):
            raise ValueError(f"unknown variant {variant!r}")
        self.variant = variant
        self.patch_embed = nn.Linear(patch_dim, dim)
        self.pos_grid = nn.Parameter(torch.randn(1, dim, grid, grid))
        self.block = Block(dim, heads)

    def _positions(self, h: int, w: int) -> torch.Tensor:
        pos = F.interpolate(self.pos_grid, size=(h, w), mode="bilinear", align_corners=False)
        return pos[0].flatten(1).t()

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(pixel_values)
        if self.variant == "shipped":
            hw = image_grid_thw[:, 1:3]
            spatial = hw.to(x.device, torch.int32, non_blocking=True)  # at: isaac.upload
            sizes = [(int(spatial[i, 0]), int(spatial[i, 1]))  # at: isaac.hw
                     for i in range(spatial.shape[0])]
            bounds = F.pad(spatial.prod(-1).cumsum(0), (1, 0)).tolist()  # at: isaac.bounds
        else:
            sizes = [(h, w) for _, h, w in image_grid_thw.tolist()]  # at: isaac.grid
            bounds = [0]
            for h, w in sizes:
                bounds.append(bounds[-1] + h * w)
        x = x + torch.cat([self._positions(h, w) for h, w in sizes])
        outs = [self.block(x[a:b][None])[0] for a, b in itertools.pairwise(bounds)]
        return torch.cat(outs)


def _isaac_inputs() -> dict[str, Any]:
    grid = torch.tensor([[1, 4, 6], [1, 3, 3]])
    n = int(grid.prod(-1).sum())
    return {"pixel_values": torch.randn(n, 48, generator=torch.Generator().manual_seed(5)),
            "image_grid_thw": grid}


# -- engine-side transfers: a buffer reused while its copy is in flight ----------------


def prepare_batch(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, *,
                  synced: bool = False) -> torch.Tensor:
    """Engine-side preparation that does its own transfers. Unsynced, it zeroes the pinned
    staging buffer while its asynchronous copy may be in flight, and reads the result of
    an asynchronous device-to-host copy before any sync."""
    staging = pixel_values.pin_memory()
    pixels = staging.to("cuda", non_blocking=True)
    if synced:
        torch.cuda.synchronize()
    staging.zero_()  # at: race.reuse
    tokens = image_grid_thw.pin_memory().to("cuda", non_blocking=True).prod(-1)
    tokens_host = tokens.to("cpu", non_blocking=True)
    if synced:
        torch.cuda.synchronize()
    total = int(tokens_host.sum())  # at: race.read
    return pixels[:total]


def _race_inputs() -> dict[str, Any]:
    return {"pixel_values": torch.randn(36, 48, generator=torch.Generator().manual_seed(6)),
            "image_grid_thw": torch.tensor([[1, 4, 6], [1, 3, 4]])}


# -- the catalogue ----------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One way to run an example: field specs, code variant, and the expected findings as
    ``(kind, marker)`` pairs (see :func:`line_of`)."""

    specs: Mapping[str, FieldSpec]
    expected: frozenset[tuple[str, str]] = frozenset()
    variant: str = "default"


@dataclass(frozen=True)
class Example:
    """An encoder (``build(variant)`` returns the callable to audit), its inputs, the
    correct case, the wrong cases by name, and what ``recommend`` must return for the
    correct case's code."""

    name: str
    summary: str
    build: Callable[[str], Callable[..., Any]]
    inputs: Callable[[], dict[str, Any]]
    correct: Case
    wrong: Mapping[str, Case] = field(default_factory=dict)
    recommended: Mapping[str, Placement] = field(default_factory=dict)

    def case(self, name: str | None) -> Case:
        """``None`` or "correct" is the correct case; otherwise a wrong case by name."""
        if name in (None, "correct"):
            return self.correct
        return self.wrong[name]


def _specs(modality: str, **placements: str) -> dict[str, FieldSpec]:
    return {k: FieldSpec.batched(modality, placement=p) for k, p in placements.items()}


D, H, B = Placement.DEVICE, Placement.HOST, Placement.BOTH

EXAMPLES: dict[str, Example] = {
    e.name: e
    for e in (
        Example(
            "qwen2vl",
            "Qwen2-VL-like: grid read on the host (loops, split sizes, cu_seqlens)",
            lambda variant: _seeded(Qwen2VLLike),
            _qwen2vl_inputs,
            Case(_specs("image", pixel_values="device", image_grid_thw="host")),
            {
                "grid_on_device": Case(
                    _specs("image", pixel_values="device", image_grid_thw="device"),
                    frozenset({("host_sync", "qwen2vl.grid"), ("host_sync", "qwen2vl.side"),
                               ("host_sync", "qwen2vl.frames"),
                               ("host_sync", "qwen2vl.bounds")})),
                "pixels_on_host": Case(
                    _specs("image", pixel_values="host", image_grid_thw="host"),
                    frozenset({("device_mismatch", "qwen2vl.embed")})),
            },
            {"pixel_values": D, "image_grid_thw": H},
        ),
        Example(
            "minicpmv",
            "MiniCPM-V-like: sizes build a device mask and position ids",
            lambda variant: _seeded(MiniCPMVLike),
            _minicpmv_inputs,
            Case(_specs("image", pixel_values="device", tgt_sizes="device")),
            {
                "sizes_on_host": Case(
                    _specs("image", pixel_values="device", tgt_sizes="host"),
                    frozenset({("device_mismatch", "minicpmv.mask"),
                               ("device_mismatch", "minicpmv.rowcol"),
                               ("device_mismatch", "minicpmv.bucket")})),
            },
            {"pixel_values": D, "tgt_sizes": D},
        ),
        Example(
            "qwen2audio",
            "Qwen2-Audio-like: mask summed to lengths, used on the device and the host",
            lambda variant: _seeded(Qwen2AudioLike),
            _audio_inputs,
            Case(_specs("audio", input_features="device", feature_attention_mask="both")),
            {
                "mask_on_device": Case(
                    _specs("audio", input_features="device", feature_attention_mask="device"),
                    frozenset({("host_sync", "audio.sizes")})),
                "mask_on_host": Case(
                    _specs("audio", input_features="device", feature_attention_mask="host"),
                    frozenset({("device_mismatch", "audio.features"),
                               ("device_mismatch", "audio.pad")})),
            },
            {"input_features": D, "feature_attention_mask": B},
        ),
        Example(
            "fireredlid",
            "FireRedLID-like: lengths compared with a device arange",
            lambda variant: _seeded(FireRedLIDLike),
            _lid_inputs,
            Case(_specs("audio", input_features="device", speech_lengths="device")),
            {
                "lengths_on_host": Case(
                    _specs("audio", input_features="device", speech_lengths="host"),
                    frozenset({("implicit_h2d", "lid.lengths")})),
            },
            {"input_features": D, "speech_lengths": D},
        ),
        Example(
            "isaac",
            "Isaac-like: grid uploaded non_blocking from a non-contiguous slice, read back",
            lambda variant: _seeded(lambda: IsaacLike("fixed" if variant == "default"
                                                      else variant)),
            _isaac_inputs,
            Case(_specs("image", pixel_values="device", image_grid_thw="host")),
            {
                "grid_on_device": Case(
                    _specs("image", pixel_values="device", image_grid_thw="device"),
                    frozenset({("host_sync", "isaac.grid")})),
                "shipped": Case(
                    _specs("image", pixel_values="device", image_grid_thw="host"),
                    frozenset({("pageable_async_copy", "isaac.upload"),
                               ("host_sync", "isaac.hw"), ("host_sync", "isaac.bounds")}),
                    variant="shipped"),
                "shipped_grid_on_device": Case(
                    _specs("image", pixel_values="device", image_grid_thw="device"),
                    frozenset({("host_sync", "isaac.hw"), ("host_sync", "isaac.bounds")}),
                    variant="shipped"),
            },
            {"pixel_values": D, "image_grid_thw": H},
        ),
        Example(
            "transfer_race",
            "engine-side transfers: pinned buffer reused and async result read before a sync",
            lambda variant: functools.partial(prepare_batch, synced=variant != "racy"),
            _race_inputs,
            Case(_specs("image", pixel_values="host", image_grid_thw="host")),
            {
                "racy": Case(
                    _specs("image", pixel_values="host", image_grid_thw="host"),
                    frozenset({("async_copy_race", "race.reuse"),
                               ("async_copy_race", "race.read")}),
                    variant="racy"),
            },
            {"pixel_values": H, "image_grid_thw": H},
        ),
    )
}


def names() -> list[str]:
    """Names of the examples."""
    return list(EXAMPLES)
