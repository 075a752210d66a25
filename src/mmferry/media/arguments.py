"""How a processor's ``images=`` / ``videos=`` arguments name their items, in one place for
every model (transformers' conventions, plus files)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from PIL import Image

__all__ = ["as_images", "as_videos"]

_ENCODED = (str, os.PathLike, bytes, bytearray, memoryview)


def _is_frame(x: Any) -> bool:
    return isinstance(x, Image.Image) or (isinstance(x, np.ndarray) and x.ndim <= 3)


def as_images(images: Any) -> list[Any]:
    """The images of ``images=``: ``None`` is none; one image (a PIL image, a path, encoded
    bytes, an ``H×W[×C]`` array) is one; an ``N×H×W×C`` array or any other sequence is one
    image per element."""
    if images is None:
        return []
    if _is_frame(images) or isinstance(images, _ENCODED):
        return [images]
    return list(images)


def as_videos(videos: Any) -> list[Any]:
    """The videos of ``videos=``: ``None`` is none; one video (a file path or folder of
    frames, encoded bytes, a ``T×H×W×C`` array, or a sequence of decoded frames: PIL images
    or arrays) is one; any other sequence is one video per element."""
    if videos is None:
        return []
    if isinstance(videos, _ENCODED) or (isinstance(videos, np.ndarray) and videos.ndim == 4):
        return [videos]
    videos = list(videos)
    if videos and _is_frame(videos[0]):
        return [videos]
    return videos
