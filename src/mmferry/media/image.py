"""Decode one image into an RGB PIL image, with limits.

Sources are encoded bytes, a file path, a PIL image or a uint8 array (``H×W`` or ``H×W×C``
with 1, 3 or 4 channels). Anything that cannot be decoded or breaks a limit raises
:class:`~mmferry.errors.MediaError` naming the file, or ``item N`` for in-memory sources.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from mmferry.errors import MediaError
from mmferry.files import FileRefused, read_regular

__all__ = ["MAX_PIXELS", "ImageSource", "load_image", "load_images", "source_name"]

# Pillow's own default: it warns above this and refuses twice this. We refuse anything above
# it from the header alone, before a pixel is decoded.
MAX_PIXELS = Image.MAX_IMAGE_PIXELS or 89_478_485

ImageSource = bytes | bytearray | memoryview | str | os.PathLike | Image.Image | np.ndarray

# What Pillow raises on corrupt, truncated or unsupported data is open-ended: besides
# OSError / SyntaxError / ValueError its plugins raise NotImplementedError (DDS, PSD),
# OverflowError, struct.error, ZeroDivisionError, KeyError, IndexError, MemoryError and more
# (see tests/test_media_fuzz.py). Any exception from decoding untrusted bytes is the media's
# fault, so each becomes a MediaError naming the source.
_DECODE_ERRORS = (Exception,)
_EXIF_ORIENTATION = 0x0112


def max_file_bytes(max_pixels: int = MAX_PIXELS) -> int:
    """The largest image file read: uncompressed 4-byte pixels at the pixel limit, plus
    room for headers and metadata; anything bigger cannot be an image within the limit."""
    return 4 * max_pixels + (16 << 20)


def source_name(source: Any, index: int | None = None) -> str:
    """How errors name a source: its path, else ``item N`` (``item`` without an index)."""
    if isinstance(source, str | os.PathLike):
        return os.fspath(source)
    return "item" if index is None else f"item {index}"


def _check_size(width: int, height: int, max_pixels: int, name: str) -> None:
    if width <= 0 or height <= 0:
        raise MediaError(f"zero-sized image ({width}x{height})", source=name)
    if width * height > max_pixels:
        raise MediaError(
            f"image is {width}x{height} = {width * height} pixels, above the limit of "
            f"{max_pixels} (a decompression bomb or an absurd size)",
            source=name,
        )


def _to_rgb(img: Image.Image) -> Image.Image:
    # Transparent pixels are composited onto white, as transformers' processors do, so an
    # image with alpha gives the same pixels here as there.
    if "A" in img.getbands() or "transparency" in img.info:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img if img.mode == "RGB" else img.convert("RGB")


def _from_array(array: np.ndarray, name: str) -> Image.Image:
    if array.dtype != np.uint8:
        raise MediaError(f"image arrays must be uint8, got {array.dtype}", source=name)
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    if array.ndim == 2:
        mode = "L"
    elif array.ndim == 3 and array.shape[-1] in (3, 4):
        mode = "RGB" if array.shape[-1] == 3 else "RGBA"
    else:
        raise MediaError(
            f"image arrays must be HxW or HxWxC with C in (1, 3, 4), got shape {array.shape}",
            source=name,
        )
    return Image.fromarray(np.ascontiguousarray(array), mode=mode)


def _open(data: bytes | bytearray | memoryview, name: str, max_pixels: int) -> Image.Image:
    try:
        img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise MediaError(f"decompression bomb: {e}", source=name) from None
    except Image.UnidentifiedImageError:
        raise MediaError("cannot identify an image format", source=name) from None
    except _DECODE_ERRORS as e:
        raise MediaError(f"cannot identify an image ({type(e).__name__}: {e})",
                         source=name) from None
    # The header gives the size; refuse before decoding a single pixel.
    _check_size(img.width, img.height, max_pixels, name)
    try:
        img.load()
        if img.getexif().get(_EXIF_ORIENTATION, 1) != 1:
            img = ImageOps.exif_transpose(img)
    except _DECODE_ERRORS as e:
        raise MediaError(f"cannot decode the image ({type(e).__name__}: {e}); is the file "
                         "truncated or corrupt?", source=name) from None
    return img


def _load(source: Any, name: str, max_pixels: int) -> Image.Image:
    if isinstance(source, Image.Image):
        _check_size(source.width, source.height, max_pixels, name)
        img = source
    elif isinstance(source, np.ndarray):
        if source.ndim >= 2:
            _check_size(source.shape[1], source.shape[0], max_pixels, name)
        img = _from_array(source, name)
    elif isinstance(source, bytes | bytearray | memoryview):
        img = _open(source, name, max_pixels)
    elif isinstance(source, str | os.PathLike):
        try:
            # Read whole: the compressed bytes are small next to the pixels, and no file
            # handle outlives the call (Pillow keeps multi-frame files open). Only regular
            # files, size-checked first: a FIFO or a device must not block or stream forever.
            data = read_regular(source, max_file_bytes(max_pixels))
        except FileRefused as e:
            raise MediaError(e.reason, source=name) from None
        img = _open(data, name, max_pixels)
    else:
        raise MediaError(
            f"unsupported image source {type(source).__name__}; expected bytes, a path, "
            "a PIL image or a uint8 array",
            source=name,
        )
    try:
        return _to_rgb(img)
    except _DECODE_ERRORS as e:
        raise MediaError(f"cannot convert the image to RGB ({type(e).__name__}: {e})",
                         source=name) from None


def load_image(source: ImageSource, *, index: int | None = None,
               max_pixels: int = MAX_PIXELS) -> Image.Image:
    """Decode ``source`` into an RGB PIL image.

    Files and bytes are decoded by Pillow (first frame of a multi-frame file, EXIF rotation
    applied); PIL images and arrays are taken as they are. Transparency is composited onto
    white. ``index`` names an in-memory source in errors (``item N``).

    Raises:
        MediaError: unreadable, truncated or unsupported data, a zero-sized image, or more
            than ``max_pixels`` pixels.
    """
    return _load(source, source_name(source, index), max_pixels)


def load_images(sources: Sequence[ImageSource], *,
                max_pixels: int = MAX_PIXELS) -> list[Image.Image]:
    """:func:`load_image` for each source; errors name the file or ``item N`` (its index)."""
    return [load_image(s, index=i, max_pixels=max_pixels) for i, s in enumerate(sources)]
