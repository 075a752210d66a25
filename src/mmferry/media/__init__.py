"""Media decoding with limits: every failure is a :class:`~mmferry.errors.MediaError`."""

from mmferry.media.arguments import as_images, as_videos
from mmferry.media.audio import (
    MAX_AUDIO_BYTES,
    MAX_AUDIO_SECONDS,
    MAX_CHANNELS,
    AudioSource,
    decode_audio,
    load_audio,
    load_audios,
)
from mmferry.media.image import MAX_PIXELS, ImageSource, load_image, load_images, source_name
from mmferry.media.video import MAX_FRAMES, load_video

__all__ = [
    "MAX_AUDIO_BYTES",
    "MAX_AUDIO_SECONDS",
    "MAX_CHANNELS",
    "MAX_FRAMES",
    "MAX_PIXELS",
    "AudioSource",
    "ImageSource",
    "as_images",
    "as_videos",
    "decode_audio",
    "load_audio",
    "load_audios",
    "load_image",
    "load_images",
    "load_video",
    "source_name",
]
