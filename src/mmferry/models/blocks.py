"""Building blocks several models share: activations, 2-D rotary helpers, attention within
frames, the two-layer MLP, the pre-norm rotary transformer block built from them, the pixel
normalisation folded into a first layer, and how error messages describe a value. Not a
model: nothing here is registered."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mmferry.errors import ContractError
from mmferry.fields import Normalize
from mmferry.transfer import upload

__all__ = [
    "ACTIVATIONS",
    "Mlp",
    "PixelFold",
    "RotaryBlock",
    "check_normalize",
    "describe",
    "frame_attention",
    "frame_positions",
    "frame_rotary",
    "quick_gelu",
    "rotate_half",
]


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {
    "quick_gelu": quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


@lru_cache(maxsize=256)
def frame_positions(h: int, w: int, merge: int) -> np.ndarray:
    """(row, column) of each patch of one ``h×w`` frame, in merge-block order, ``[h*w, 2]``."""
    bh, bw = h // merge, w // merge
    r = np.arange(bh)[:, None, None, None] * merge + np.arange(merge)[None, None, :, None]
    c = np.arange(bw)[None, :, None, None] * merge + np.arange(merge)[None, None, None, :]
    shape = (bh, bw, merge, merge)
    pos = np.stack([np.broadcast_to(r, shape), np.broadcast_to(c, shape)], axis=-1)
    pos = pos.reshape(h * w, 2).astype(np.int32)
    pos.setflags(write=False)
    return pos


def frame_rotary(grid: Sequence[tuple[int, int, int]], merge: int, head_dim: int, theta: float,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """2-D rotary tables and attention runs for patches in merge-block order.

    ``grid`` holds host ints (t, h, w) per item. The (row, column) position of every patch is
    host math, uploaded once; rows and columns share the frequencies, a quarter of
    ``head_dim`` each, built on the device (a few tiny kernels) rather than kept as a buffer,
    so nothing but the checkpoint's tensors needs initialising. Returns ``cos`` and ``sin``
    (``[n, 1, head_dim]``, broadcast over heads) and the runs of equal-length frames that
    :func:`frame_attention` takes."""
    positions = np.concatenate([np.tile(frame_positions(h, w, merge), (t, 1)) for t, h, w in grid])
    runs: list[tuple[int, int]] = []
    for t, h, w in grid:
        if runs and runs[-1][1] == h * w:
            runs[-1] = (runs[-1][0] + t, h * w)
        else:
            runs.append((t, h * w))
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float, device=device) / half))
    pos = upload(torch.from_numpy(positions), device)
    freqs = (pos[:, :, None].float() * inv_freq).flatten(1)  # [n, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos(), emb.sin(), runs


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def frame_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    runs: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Attention within each frame (or image, window, slice): ``q, k, v`` are ``[n, heads,
    head_dim]``; ``runs`` are (frames, frame length) of consecutive equal-length frames
    covering the n rows. A run is a view of one ``[frames, heads, length, head_dim]`` batch,
    so it costs one SDPA call, and the boundaries are host ints: no ``cu_seqlens`` on the
    device. Returns ``[n, heads·head_dim]``."""
    outs, start = [], 0
    for count, length in runs:
        end = start + count * length
        q_, k_, v_ = (t[start:end].unflatten(0, (count, length)).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q_, k_, v_)
        outs.append(o.transpose(1, 2).flatten(0, 1))
        start = end
    return (outs[0] if len(outs) == 1 else torch.cat(outs)).flatten(1)


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
    return type(value).__name__


class RotaryAttention(nn.Module):
    """Fused-qkv attention with rotary positions (applied in float32 whatever the weights'
    dtype, as the references do), within the frames ``runs`` describe."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                runs: Sequence[tuple[int, int]]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)
        qf, kf = q.float(), k.float()
        q = (qf * cos + rotate_half(qf) * sin).to(v.dtype)
        k = (kf * cos + rotate_half(kf) * sin).to(v.dtype)
        return self.proj(frame_attention(q, k, v, runs))


class RotaryBlock(nn.Module):
    """Pre-norm block: LayerNorm, rotary attention within frames, LayerNorm, MLP (the
    checkpoint names ``norm1``, ``attn.qkv``, ``attn.proj``, ``norm2``, ``mlp.fc1/fc2``)."""

    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, act: str, eps: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.attn = RotaryAttention(dim, num_heads)
        self.mlp = Mlp(dim, mlp_hidden, act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                runs: Sequence[tuple[int, int]]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, runs)
        return x + self.mlp(self.norm2(x))



# -- uint8 pixels ------------------------------------------------------------------------


class PixelFold(nn.Module):
    """A first layer's weight and bias with a :class:`~mmferry.fields.Normalize` folded in,
    so the layer takes uint8 pixel levels (cast to its dtype) with no normalising pass:
    ``W·((x·scale − mean) / std) + b == (W·a)·x + (b + W·c)`` per channel.

    Folded once in float64 and kept until the weight changes (a checkpoint load, ``.to()``,
    an in-place edit: each changes its storage or version), so it costs nothing per call.
    The folded tensors are non-persistent buffers: derived from the checkpoint, never saved,
    and on the device with the model's other buffers (which is also how the audit sees them).
    """

    weight: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("weight", None, persistent=False)
        self.register_buffer("bias", None, persistent=False)
        self._key: tuple[Any, ...] | None = None

    def forward(self, weight: torch.Tensor, bias: torch.Tensor | None, normalize: Normalize,
                channel_dim: int, sum_dims: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """``weight`` ``[out, ...]`` whose dimension ``channel_dim`` is the input channel (a
        conv weight ``[out, C, ...]`` has it at 1; view or permute a weight so its dimensions
        follow the input's columns); returns the folded weight, contiguous, and a bias
        ``[out]``. ``sum_dims`` are weight dimensions the
        input repeats along (an image standing for the frames of a temporal patch): they are
        summed away, so the input is sent once."""
        key = (weight.data_ptr(), _version(weight), weight.shape, weight.dtype, weight.device,
               None if bias is None else (bias.data_ptr(), _version(bias)), normalize,
               channel_dim, sum_dims)
        if key != self._key or self.weight is None or self.bias is None:
            if weight.shape[channel_dim] != normalize.channels:
                raise ContractError(f"the first layer has {weight.shape[channel_dim]} input "
                                    f"channels, the normalisation {normalize.channels}")
            with torch.no_grad():
                a, c = (upload(v, weight.device) for v in normalize.affine())
                w64 = weight.double()
                if sum_dims:
                    w64 = w64.sum(dim=sum_dims)
                    channel_dim -= sum(d < channel_dim for d in sum_dims)
                shape = [1] * w64.ndim
                shape[channel_dim] = -1
                folded = w64 * a.view(shape)
                shift = (w64 * c.view(shape)).flatten(1).sum(1)
                if bias is not None:
                    shift = shift + bias.double()
                # Contiguous whatever view of the weight came in, so callers view it flat.
                self.weight = folded.to(weight.dtype).contiguous()
                self.bias = shift.to(weight.dtype)
            self._key = key
        return self.weight, self.bias


def _version(t: torch.Tensor) -> int | None:
    # Tensors made under torch.inference_mode() keep no version counter; such weights are
    # not edited in place after loading, so their storage alone identifies them.
    try:
        return t._version
    except RuntimeError:
        return None


def check_normalize(item: Mapping[str, Any], name: str, expected: Normalize) -> None:
    """uint8 pixels in field ``name`` of ``item`` are only read with the normalisation they
    were made for: the one ``item``'s spec of the field declares. A plain mapping has no
    specs, so nothing says what its levels stand for.

    Raises:
        ContractError: naming ``name``, when the spec has no or another normalisation.
    """
    specs = getattr(item, "specs", None)
    spec = specs.get(name) if isinstance(specs, Mapping) else None
    declared = None if spec is None else spec.normalize
    if declared != expected:
        raise ContractError(f"uint8 pixels need the spec's normalize to be the model's {expected}, "
                            f"got {declared}", field=name)
