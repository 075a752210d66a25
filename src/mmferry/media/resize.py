"""Resizing decoded pixels for a processor, in one of two modes, and the pixel options every
image processor takes.

``exact`` gives the pixels of transformers' PIL processors (Pillow's resampling filters).
``fast`` gives the pixels of its torchvision processors, which vLLM uses by default: torch's
antialiased uint8 kernels (the ones ``torchvision.transforms.v2.functional.resize`` calls on
a uint8 image on the CPU), run on the ``H×W×C`` array in place of a channels-first copy.
Both return uint8 ``[H, W, C]``; a processor keeps them as uint8 levels
(``pixel_dtype="uint8"``, the default) or normalises them to float32 as transformers does.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
from PIL import Image

from mmferry.errors import ArgumentError

__all__ = [
    "DEFAULT_PIXEL_DTYPE",
    "DEFAULT_RESIZE_MODE",
    "PIXEL_DTYPES",
    "RESAMPLE_FILTERS",
    "RESIZE_MODES",
    "check_pixel_options",
    "resize",
]

RESIZE_MODES = ("fast", "exact")
PIXEL_DTYPES = ("uint8", "float32")
# vLLM's default processors are transformers' torchvision ones, whose pixels "fast" gives.
DEFAULT_RESIZE_MODE = "fast"
DEFAULT_PIXEL_DTYPE = "uint8"
RESAMPLE_FILTERS = {"bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR}
# The antialiased kernels F.interpolate(..., antialias=True) runs, called with an output buffer.
_AA_KERNELS = {"bicubic": torch.ops.aten._upsample_bicubic2d_aa,
               "bilinear": torch.ops.aten._upsample_bilinear2d_aa}


def check_pixel_options(pixel_dtype: Any, resize_mode: Any) -> None:
    """``pixel_dtype`` one of :data:`PIXEL_DTYPES`, ``resize_mode`` one of :data:`RESIZE_MODES`.

    Raises:
        ArgumentError: naming the option and the values it takes.
    """
    for name, value, allowed in (("pixel_dtype", pixel_dtype, PIXEL_DTYPES),
                                 ("resize_mode", resize_mode, RESIZE_MODES)):
        if not isinstance(value, str) or value not in allowed:
            raise ArgumentError(f"{name} must be one of {list(allowed)}, got {value!r}",
                                argument=name)


def resize(image: Image.Image | np.ndarray, height: int, width: int, *, mode: str,
           resample: str = "bicubic", channels_first: bool = False) -> np.ndarray:
    """``image`` (a PIL image or uint8 ``[H, W, C]`` array) resized to ``height×width`` as
    uint8 ``[height, width, C]``; the input as an array when it already has that size (it
    may be read-only).

    ``mode`` is ``"exact"`` (Pillow's filter, transformers' PIL processors) or ``"fast"``
    (torch's antialiased uint8 filter, transformers' torchvision processors).
    ``channels_first`` gives ``[C, height, width]`` instead, for a processor that patchifies
    channel by channel: ``fast`` spares the copy back to ``H×W×C`` (torch's filter writes
    channel planes), ``exact`` copies a PIL image's bands out one by one (a third of the time
    of the interleaved array plus a transposition); an array is a transposed view.
    """
    if resample not in RESAMPLE_FILTERS:
        raise ArgumentError(f"resample must be one of {sorted(RESAMPLE_FILTERS)}, got {resample!r}",
                            argument="resample")
    if mode == "exact":
        if isinstance(image, np.ndarray):
            if image.shape[:2] == (height, width):
                return _channels_first(image) if channels_first else image
            image = Image.fromarray(image)
        if image.size != (width, height):
            image = image.resize((width, height), RESAMPLE_FILTERS[resample])
        return _bands(image) if channels_first else np.asarray(image)
    if mode != "fast":
        raise ArgumentError(f"resize_mode must be one of {list(RESIZE_MODES)}, got {mode!r}",
                            argument="resize_mode")
    # A PIL image is copied out once (its array interface), read-only.
    pixels = np.asarray(image)
    if pixels.shape[:2] == (height, width):
        return _channels_first(pixels) if channels_first else pixels
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    with warnings.catch_warnings():
        # torch cannot guard a read-only array and says so; the kernel only reads it, so it
        # is not copied a second time.
        warnings.simplefilter("ignore", UserWarning)
        source = torch.from_numpy(pixels)
    # [1, C, H, W] with channels-last strides: the uint8 kernel's own layout, no copy in.
    batch = source.permute(2, 0, 1).unsqueeze(0)
    # F.interpolate's kernel, into a channels-last buffer: F.interpolate itself converts the
    # result to channels-first, a pass as long as half the filter; numpy's transposition into
    # planes costs half of that.
    out = torch.empty((1, batch.shape[1], height, width), dtype=torch.uint8,
                      memory_format=torch.channels_last)
    _AA_KERNELS[resample].out(batch, [height, width], False, None, None, out=out)
    pixels = out[0].permute(1, 2, 0).numpy()
    return np.ascontiguousarray(pixels.transpose(2, 0, 1)) if channels_first else pixels


def _channels_first(pixels: np.ndarray) -> np.ndarray:
    return pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)


def _bands(image: Image.Image) -> np.ndarray:
    """A PIL image as uint8 ``[C, H, W]`` planes, each band copied out by Pillow in one pass."""
    bands = image.getbands()
    if len(bands) > 1:
        planes = np.empty((len(bands), image.height, image.width), dtype=np.uint8)
        try:
            for plane, band in zip(planes, bands, strict=True):
                plane[...] = np.frombuffer(image.tobytes("raw", band),
                                           dtype=np.uint8).reshape(plane.shape)
            return planes
        except (ValueError, OSError):  # a mode without a packer per band
            pass
    return _channels_first(np.asarray(image))
