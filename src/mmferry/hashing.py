"""Stable content hashes: of processed items (encoder-cache keys) and of raw media plus
processor kwargs and model id (processor-cache keys, before any processing).

Every hash is blake3 over a canonical byte stream in which each value is framed by a type
tag and its length, so different structures cannot produce the same stream. Tensors
contribute dtype, shape and raw bytes (bfloat16 by its bytes), never a pickle.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from blake3 import blake3
from PIL import Image

from mmferry.errors import ContractError, MediaError
from mmferry.files import FileRefused, read_regular

if TYPE_CHECKING:
    from mmferry.fields import FieldSpec

__all__ = ["hash_item", "hash_media", "hash_model", "payload_nbytes"]

# Above this many payload bytes blake3's multithreaded mode pays for its start-up.
_THREADED_BYTES = 1 << 20


def _frame(h: blake3, tag: bytes, payload: bytes | memoryview) -> None:
    h.update(tag)
    h.update(struct.pack("<Q", len(payload)))
    h.update(payload)


def _update_tensor(h: blake3, t: torch.Tensor) -> None:
    if t.layout is not torch.strided:
        raise ContractError(f"cannot hash a {t.layout} tensor; give a dense one")
    if t.device.type != "cpu":
        # Reading it back would be a hidden blocking sync in the hot path (and a meta tensor
        # has no data): hash where the processor ran, on the host, or give the item its hash.
        raise ContractError(
            f"cannot hash a tensor on {t.device}: hash items on the host (where they are "
            "processed) or build the Item with hash=...")
    t = t.detach()
    # A lazily conjugated or negated view hashes by the values it stands for, not the bytes
    # underneath (which the uint8 view below would read).
    t = t.resolve_conj().resolve_neg()
    _frame(h, b"T", f"{t.dtype}|{tuple(t.shape)}".encode())
    flat = t.contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
    _frame(h, b"B", memoryview(raw.numpy()))


def _update(h: blake3, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        _update_tensor(h, value)
    elif isinstance(value, np.ndarray):
        arr = np.ascontiguousarray(value)
        if arr.dtype.hasobject:
            raise ContractError("cannot hash object arrays")
        _frame(h, b"N", f"{arr.dtype.str}|{arr.shape}".encode())
        _frame(h, b"B", memoryview(arr).cast("B"))
    elif isinstance(value, bytes | bytearray | memoryview):
        _frame(h, b"b", memoryview(value).cast("B"))
    elif isinstance(value, str):
        _frame(h, b"s", value.encode())
    elif isinstance(value, bool) or value is None:
        _frame(h, b"o", repr(value).encode())
    elif isinstance(value, int):
        _frame(h, b"i", str(value).encode())
    elif isinstance(value, float):
        _frame(h, b"f", struct.pack("<d", value))
    elif isinstance(value, list | tuple):
        _frame(h, b"L", str(len(value)).encode())
        for v in value:
            _update(h, v)
    elif isinstance(value, Mapping):
        _frame(h, b"M", str(len(value)).encode())
        for k in sorted(value, key=str):
            _frame(h, b"k", str(k).encode())
            _update(h, value[k])
    elif isinstance(value, Image.Image):
        _update_image(h, value)
    else:
        raise ContractError(f"cannot hash a value of type {type(value).__name__}")


# PIL ``info`` keys that change the pixels a processor sees (transparency is composited
# onto white); the rest (dpi, comments, ICC profile as passed through) do not.
_PIXEL_INFO = ("transparency",)


def _update_image(h: blake3, img: Image.Image) -> None:
    """Everything that decides the processed pixels: mode, size, raw bytes, the palette in
    its own mode (alpha included) and the transparency key."""
    _frame(h, b"P", f"{img.mode}|{img.size}".encode())
    _frame(h, b"B", img.tobytes())
    if img.palette is not None:
        mode = img.palette.mode
        _frame(h, b"p", mode.encode())
        _frame(h, b"B", bytes(img.getpalette(mode) or ()))
    for key in _PIXEL_INFO:
        if key in img.info:
            _frame(h, b"k", key.encode())
            value = img.info[key]
            _update(h, bytes(value) if isinstance(value, bytes | bytearray) else value)


def payload_nbytes(value: Any) -> int:
    """Tensor bytes in a field value (a tensor, or nested lists of them); 0 for plain values."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(payload_nbytes(v) for v in value)
    return 0


def _hasher(nbytes: int) -> blake3:
    return blake3(max_threads=blake3.AUTO) if nbytes >= _THREADED_BYTES else blake3()


def hash_item(modality: str, data: Mapping[str, Any], specs: Mapping[str, FieldSpec]) -> str:
    """Hex digest of one item: modality, then per field (sorted) name, spec and value."""
    h = _hasher(sum(payload_nbytes(v) for v in data.values()))
    _frame(h, b"m", modality.encode())
    for name in sorted(data):
        _frame(h, b"k", name.encode())
        _update(h, specs[name].to_dict())
        _update(h, data[name])
    return h.hexdigest()


def hash_model(model: Any) -> str:
    """Hex digest of what makes an encoder's output: its ``name``, class, ``config`` (its
    repr, when it has one), and every parameter and buffer by name, dtype, shape and bytes.

    Two models share a digest only when they compute the same function, so encoder-cache
    keys built on it never mix models. Device tensors are read back once, here; an engine
    that knows its checkpoint can pass its own identity to the runner instead.
    """
    h = blake3(max_threads=blake3.AUTO)
    _frame(h, b"n", str(getattr(model, "name", "")).encode())
    _frame(h, b"c", f"{type(model).__module__}.{type(model).__qualname__}".encode())
    _frame(h, b"C", repr(getattr(model, "config", None)).encode())
    state = model.state_dict() if hasattr(model, "state_dict") else {}
    for name in sorted(state):
        value = state[name]
        _frame(h, b"k", name.encode())
        if isinstance(value, torch.Tensor) and value.is_meta:
            _frame(h, b"T", f"{value.dtype}|{tuple(value.shape)}|meta".encode())
        else:
            _update(h, value)
    return h.hexdigest()


def hash_media(
    media: Any,
    *,
    model_id: str,
    modality: str,
    processor_kwargs: Mapping[str, Any] | None = None,
    max_bytes: int = 1 << 30,
    sampling_rate: int | None = None,
) -> str:
    """Hex digest of raw media (file bytes, a PIL image, an array or tensor) together with
    the model id and the processor kwargs: the key for caching before processing.

    Encoded file bytes are hashed as they are (no decoding); a path (``str`` or
    ``os.PathLike``) is hashed by its file's bytes, so the key follows the content, not the
    name; only a regular file of at most ``max_bytes`` is read. kwargs are hashed by sorted
    key, so their order does not matter.

    Audio (``modality="audio"``) is hashed by its decoded content, as a PIL image is by its
    pixels: float32 mono samples plus their rate, so one clip as WAV, FLAC, a path or an
    ``(array, rate)`` pair has one key. A bare array is taken as being at ``sampling_rate``
    (the model's rate) when given, else hashed with no rate.

    Raises:
        MediaError: a path that is not a readable regular file within ``max_bytes``; audio
            that cannot be decoded.
        ContractError: a value of a type that cannot be hashed.
    """
    if modality == "audio":
        return _hash_audio(media, model_id, processor_kwargs, sampling_rate)
    if isinstance(media, str | os.PathLike):
        try:
            media = read_regular(media, max_bytes)
        except FileRefused as e:
            raise MediaError(e.reason, source=os.fspath(media)) from None
    h = _hasher(payload_nbytes(media))
    _frame(h, b"id", model_id.encode())
    _frame(h, b"m", modality.encode())
    _update(h, media)
    _update(h, dict(processor_kwargs or {}))
    return h.hexdigest()


def _hash_audio(media: Any, model_id: str, processor_kwargs: Mapping[str, Any] | None,
                sampling_rate: int | None) -> str:
    from mmferry.media.audio import decode_audio

    if isinstance(media, torch.Tensor):
        media = media.detach().cpu().numpy()
    if isinstance(media, np.ndarray) and sampling_rate is None:
        # Already in memory, and without a rate there is no duration to limit.
        samples, rate = decode_audio(media, sampling_rate=1, max_seconds=float("inf"))[0], None
    else:
        samples, rate = decode_audio(media, sampling_rate=sampling_rate)
    h = _hasher(samples.nbytes)
    _frame(h, b"id", model_id.encode())
    _frame(h, b"m", b"audio")
    _update(h, rate)
    _update(h, samples)
    _update(h, dict(processor_kwargs or {}))
    return h.hexdigest()
