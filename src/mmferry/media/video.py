"""Decode one video into RGB PIL frames of one size, with limits.

A video is its frames (a sequence of image sources, or a ``T×H×W[×C]`` uint8 array), a
folder of frame images (sorted by name), or an encoded file (a path or bytes) decoded with
PyAV (the ``media`` extra). Frames of a file are sampled evenly down to ``max_frames``, as
engines' video loaders do. Every failure is a :class:`~mmferry.errors.MediaError` naming the
file, or ``item N`` for in-memory sources.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mmferry.errors import MediaError
from mmferry.media.image import MAX_PIXELS, ImageSource, load_image, source_name

__all__ = ["MAX_FRAMES", "MAX_VIDEO_BYTES", "load_video", "sample_indices"]

MAX_FRAMES = 32
MAX_VIDEO_BYTES = 1 << 30

VideoSource = Sequence[ImageSource] | np.ndarray | str | os.PathLike | bytes | bytearray | memoryview


def sample_indices(total: int, count: int) -> list[int]:
    """``min(total, count)`` frame indices spread evenly over ``total`` frames, first and
    last included."""
    if total <= count:
        return list(range(total))
    return np.linspace(0, total - 1, count).round().astype(int).tolist()


def _frame_files(folder: Path, name: str) -> list[Path]:
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    if not files:
        raise MediaError("a folder of frames holds no files", source=name)
    return files


def _decode_file(data: bytes | bytearray | memoryview | Path, name: str, max_frames: int,
                 max_pixels: int) -> list[Image.Image]:
    try:
        import av
    except ImportError:
        raise MediaError("decoding video files needs PyAV: pip install 'mmferry[media]'",
                         source=name) from None
    source = data if isinstance(data, Path) else io.BytesIO(data)
    try:
        with av.open(source, metadata_errors="ignore") as container:
            if not container.streams.video:
                raise MediaError("no video stream", source=name)
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            if width * height > max_pixels:
                raise MediaError(f"frames are {width}x{height}, above the limit of {max_pixels} "
                                 "pixels", source=name)
            frames = _sampled(container.decode(stream), stream.frames, max_frames)
    except MediaError:
        raise
    except Exception as e:  # PyAV raises its own FFmpeg error tree, and OSError / ValueError
        raise MediaError(f"cannot decode the video ({type(e).__name__}: {e})", source=name) from None
    if not frames:
        raise MediaError("the video has no frames", source=name)
    return frames


def _sampled(decoded: Any, total: int, count: int) -> list[Image.Image]:
    """At most ``count`` frames spread over the stream, holding at most ``2·count`` at once.

    With a frame count from the header, exactly :func:`sample_indices`; without one (or when
    the stream runs longer), every frame is kept at a stride that doubles whenever ``2·count``
    are held, then the result is thinned evenly."""
    wanted = set(sample_indices(total, count)) if total > 0 else None
    kept: list[Image.Image] = []
    stride = 1
    for i, frame in enumerate(decoded):
        if wanted is not None:
            if i in wanted:
                kept.append(frame.to_image())
            continue
        if i % stride == 0:
            kept.append(frame.to_image())
            if len(kept) >= 2 * count:
                kept, stride = kept[::2], stride * 2
    return [kept[i] for i in sample_indices(len(kept), count)]


def load_video(source: VideoSource, *, index: int | None = None, max_pixels: int = MAX_PIXELS,
               max_frames: int = MAX_FRAMES, max_bytes: int = MAX_VIDEO_BYTES) -> list[Image.Image]:
    """Decode a video into RGB PIL frames of one size.

    ``source``: the frames (a sequence of image sources, or a ``T×H×W[×C]`` uint8 array),
    a folder of frame files (sorted by name), or an encoded video (a path or bytes, decoded
    with PyAV, sampled evenly to at most ``max_frames`` frames). ``max_pixels`` limits each
    frame, ``max_bytes`` an encoded file.

    Raises:
        MediaError: no frames, frames of different sizes, a frame that fails
            :func:`~mmferry.media.load_image`, or a file that cannot be decoded or breaks a
            limit; it names the file or ``item N``.
    """
    name = source_name(source, index)
    if isinstance(source, str | os.PathLike):
        path = Path(source)
        if path.is_dir():
            source = _frame_files(path, name)
        elif not path.exists():
            raise MediaError("no such file", source=name)
        elif not path.is_file():
            raise MediaError("not a regular file", source=name)
        elif path.stat().st_size > max_bytes:
            raise MediaError(f"{path.stat().st_size} bytes, above the limit of {max_bytes}",
                             source=name)
        else:
            return _same_size(_decode_file(path, name, max_frames, max_pixels), name)
    elif isinstance(source, bytes | bytearray | memoryview):
        if len(source) > max_bytes:
            raise MediaError(f"{len(source)} bytes, above the limit of {max_bytes}", source=name)
        return _same_size(_decode_file(source, name, max_frames, max_pixels), name)
    elif isinstance(source, Image.Image):
        raise MediaError("a video needs a sequence of frames, a folder or a file, not one image",
                         source=name)
    if isinstance(source, np.ndarray):
        if source.ndim not in (3, 4):
            raise MediaError(f"a video array must be TxHxW or TxHxWxC, got shape {source.shape}",
                             source=name)
        source = list(source)
    if len(source) == 0:
        raise MediaError("a video needs at least one frame", source=name)
    frames = []
    for t, frame in enumerate(source):
        where = os.fspath(frame) if isinstance(frame, str | os.PathLike) else f"{name}, frame {t}"
        frames.append(_load_frame(frame, where, max_pixels))
    return _same_size(frames, name)


def _load_frame(frame: Any, where: str, max_pixels: int) -> Image.Image:
    try:
        return load_image(frame, max_pixels=max_pixels)
    except MediaError as e:
        # Name the frame, not just the video.
        raise MediaError(str(e).removeprefix(f"{e.source}: ") if e.source else str(e),
                         source=where) from None


def _same_size(frames: list[Image.Image], name: str) -> list[Image.Image]:
    for t, frame in enumerate(frames):
        if frame.size != frames[0].size:
            raise MediaError(
                f"frame {t} is {frame.width}x{frame.height} but frame 0 is "
                f"{frames[0].width}x{frames[0].height}; frames of one video must share a size",
                source=name,
            )
    return frames
