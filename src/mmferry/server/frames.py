"""The frames body: several frames in one HTTP body, length-prefixed, never base64 or pickle.

Layout (little-endian)::

    u32 n | u64 len[0] ... u64 len[n-1] | frame 0 | frame 1 | ... | frame n-1

Frame 0 is a msgpack map of request or response metadata; the frames after it are, for
rendered items, exactly :func:`mmferry.wire.encode`'s frames (so the render server's
response body is a valid request body of the encode server, forwarded untouched), and for
embeddings one raw tensor buffer per item that the metadata describes.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from mmferry.errors import WireError

__all__ = ["MAX_BODY_FRAMES", "MEDIA_TYPE", "decode_body", "encode_body", "pack_meta", "unpack_meta"]

MEDIA_TYPE = "application/vnd.mmferry.frames"
#: More frames than one wire message may have (see :data:`mmferry.wire.MAX_FRAMES`) plus the meta.
MAX_BODY_FRAMES = (1 << 18) + 2
_MAX_META_BYTES = 16 << 20

_msgpack_encoder = msgspec.msgpack.Encoder()
_msgpack_decoder = msgspec.msgpack.Decoder()


def pack_meta(meta: Any) -> bytes:
    return _msgpack_encoder.encode(meta)


def unpack_meta(frame: bytes | memoryview) -> dict[str, Any]:
    """Frame 0 as a dict; a :class:`WireError` when it is not a msgpack map."""
    if len(frame) > _MAX_META_BYTES:
        raise WireError(f"metadata of {len(frame)} bytes is more than {_MAX_META_BYTES}", frame=0)
    try:
        meta = _msgpack_decoder.decode(frame)
    except msgspec.DecodeError as e:
        raise WireError(f"metadata is not msgpack ({e})", frame=0) from None
    if not isinstance(meta, dict):
        raise WireError(f"metadata must be a map, got {type(meta).__name__}", frame=0)
    return meta


def encode_body(frames: Sequence[bytes | bytearray | memoryview]) -> list[bytes | memoryview]:
    """The body as a list of chunks (the prefix, then each frame as it is: no copy)."""
    views = [memoryview(f).cast("B") for f in frames]
    prefix = struct.pack(f"<I{len(views)}Q", len(views), *(v.nbytes for v in views))
    return [prefix, *views]


def body_bytes(chunks: Iterable[bytes | memoryview]) -> bytes:
    return b"".join(chunks)


def decode_body(body: bytes | bytearray | memoryview) -> list[memoryview]:
    """The frames of a body, as views into it; :class:`WireError` naming the byte offset on
    a malformed, truncated or over-long body."""
    view = memoryview(body).cast("B")
    if view.nbytes < 4:
        raise WireError("a frames body starts with a u32 frame count", offset=0)
    (n,) = struct.unpack_from("<I", view, 0)
    if n < 1 or n > MAX_BODY_FRAMES:
        raise WireError(f"frame count {n} is not in 1..{MAX_BODY_FRAMES}", offset=0)
    start = 4 + 8 * n
    if view.nbytes < start:
        raise WireError(f"body of {view.nbytes} bytes cannot hold {n} frame lengths", offset=4)
    lengths = struct.unpack_from(f"<{n}Q", view, 4)
    if sum(lengths) != view.nbytes - start:
        raise WireError(f"frame lengths sum to {sum(lengths)} but {view.nbytes - start} bytes "
                        "follow them", offset=start)
    frames = []
    for length in lengths:
        frames.append(view[start:start + length])
        start += length
    return frames
