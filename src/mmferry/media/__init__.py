"""Media decoding with limits: every failure is a :class:`~mmferry.errors.MediaError`."""

from mmferry.media.image import MAX_PIXELS, ImageSource, load_image, load_images, source_name
from mmferry.media.video import MAX_FRAMES, load_video

__all__ = [
    "MAX_FRAMES",
    "MAX_PIXELS",
    "ImageSource",
    "load_image",
    "load_images",
    "load_video",
    "source_name",
]
