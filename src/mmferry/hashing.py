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
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from blake3 import blake3
from PIL import Image

from mmferry.errors import MediaError

if TYPE_CHECKING:
    from mmferry.fields import FieldSpec

__all__ = ["hash_item", "hash_media", "payload_nbytes"]

# Above this many payload bytes blake3's multithreaded mode pays for its start-up.
_THREADED_BYTES = 1 << 20


def _frame(h: blake3, tag: bytes, payload: bytes | memoryview) -> None:
    h.update(tag)
    h.update(struct.pack("<Q", len(payload)))
    h.update(payload)


def _update_tensor(h: blake3, t: torch.Tensor) -> None:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
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
            raise TypeError("cannot hash object arrays")
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
        _frame(h, b"P", f"{value.mode}|{value.size}".encode())
        _frame(h, b"B", value.tobytes())
        palette = value.getpalette()
        if palette is not None:
            _update(h, palette)
    else:
        raise TypeError(f"cannot hash a value of type {type(value).__name__}")


def payload_nbytes(value: Any) -> int:
    """Tensor bytes in a field value (a tensor, or nested lists of them); 0 for plain values."""
    if isinstance(value, torch.Tensor):
        return value.nbytes
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


def hash_media(
    media: Any,
    *,
    model_id: str,
    modality: str,
    processor_kwargs: Mapping[str, Any] | None = None,
    sampling_rate: int | None = None,
) -> str:
    """Hex digest of raw media (file bytes, a PIL image, an array or tensor) together with
    the model id and the processor kwargs: the key for caching before processing.

    Encoded file bytes are hashed as they are (no decoding); a path (``str`` or
    ``os.PathLike``) is hashed by its file's bytes, so the key follows the content, not the
    name. kwargs are hashed by sorted key, so their order does not matter.

    Audio (``modality="audio"``) is hashed by its decoded content, as a PIL image is by its
    pixels: float32 mono samples plus their rate, so one clip as WAV, FLAC, a path or an
    ``(array, rate)`` pair has one key. A bare array is taken as being at ``sampling_rate``
    (the model's rate) when given, else hashed with no rate.

    Raises:
        MediaError: a path that cannot be read; audio that cannot be decoded.
    """
    if modality == "audio":
        return _hash_audio(media, model_id, processor_kwargs, sampling_rate)
    if isinstance(media, str | os.PathLike):
        try:
            media = Path(media).read_bytes()
        except OSError as e:
            raise MediaError(f"cannot read the file ({e.strerror})", source=os.fspath(media)) from None
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
