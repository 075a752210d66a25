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
# The antialiased uint8 kernels F.interpolate(..., antialias=True) runs, called with an output
# buffer of our choosing.
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
           resample: str = "bicubic", contiguous: bool = True) -> np.ndarray:
    """``image`` (a PIL image or uint8 ``[H, W, C]`` array) resized to ``height×width`` as
    uint8 ``[height, width, C]``; the input as an array when it already has that size.

    ``mode`` is ``"exact"`` (Pillow's filter, transformers' PIL processors) or ``"fast"``
    (torch's antialiased uint8 filter, transformers' torchvision processors).
    ``contiguous=False`` may return a strided ``[H, W, C]`` view of channel planes (``[C, H,
    W]`` memory), for a caller whose patchify reads channel by channel and copies the pixels
    anyway: ``"fast"`` transposes the kernel's output into planes (numpy, half the cost of
    the conversion F.interpolate makes), ``"exact"`` copies a PIL image's bands out one by
    one (a third of the cost of the interleaved array plus a transposition).
    """
    if resample not in RESAMPLE_FILTERS:
        raise ArgumentError(f"resample must be one of {sorted(RESAMPLE_FILTERS)}, got {resample!r}",
                            argument="resample")
    if mode == "exact":
        if isinstance(image, np.ndarray):
            if image.shape[:2] == (height, width):
                return image
            image = Image.fromarray(image)
        if image.size != (width, height):
            image = image.resize((width, height), RESAMPLE_FILTERS[resample])
        return np.asarray(image) if contiguous else _bands(image)
    if mode != "fast":
        raise ArgumentError(f"resize_mode must be one of {list(RESIZE_MODES)}, got {mode!r}",
                            argument="resize_mode")
    # np.asarray copies a PIL image out once, into a read-only array (np.array would copy
    # it twice).
    pixels = np.asarray(image)
    if pixels.shape[:2] == (height, width):
        return pixels
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    # [1, C, H, W] with channels-last strides: the uint8 kernel's own layout, no copy in.
    batch = _as_tensor(pixels).permute(2, 0, 1).unsqueeze(0)
    # F.interpolate's kernel, into a channels-last buffer: F.interpolate would convert the
    # result to channels-first (about half the filter's time) and interleaving that again
    # costs as much; here [H, W, C] is a plain view.
    out = torch.empty((1, batch.shape[1], height, width), dtype=torch.uint8,
                      memory_format=torch.channels_last)
    _AA_KERNELS[resample].out(batch, [height, width], False, None, None, out=out)
    hwc = out[0].permute(1, 2, 0).numpy()
    return hwc if contiguous else np.ascontiguousarray(hwc.transpose(2, 0, 1)).transpose(1, 2, 0)


def _bands(image: Image.Image) -> np.ndarray:
    """A PIL image as uint8 ``[H, W, C]``, a view of ``[C, H, W]`` planes, each band copied
    out by Pillow in one pass."""
    bands = image.getbands()
    if len(bands) > 1:
        planes = np.empty((len(bands), image.height, image.width), dtype=np.uint8)
        try:
            for plane, band in zip(planes, bands, strict=True):
                plane[...] = np.frombuffer(image.tobytes("raw", band),
                                           dtype=np.uint8).reshape(plane.shape)
            return planes.transpose(1, 2, 0)
        except (ValueError, OSError):  # a mode without a packer per band
            pass
    return np.asarray(image)


def _as_tensor(pixels: np.ndarray) -> torch.Tensor:
    """The array as a tensor sharing its memory, read-only or not: the resize only reads it,
    so torch's warning about non-writable arrays does not apply."""
    if pixels.flags.writeable:
        return torch.from_numpy(pixels)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(pixels)
