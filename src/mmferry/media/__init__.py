"""Media decoding with limits: every failure is a :class:`~mmferry.errors.MediaError`."""

from mmferry.media.audio import (
    MAX_AUDIO_BYTES,
    MAX_AUDIO_SECONDS,
    MAX_CHANNELS,
    AudioSource,
    decode_audio,
    load_audio,
)
from mmferry.media.image import (
    MAX_PIXELS,
    ImageSource,
    load_image,
    load_images,
    load_video,
    source_name,
)

__all__ = [
    "MAX_AUDIO_BYTES",
    "MAX_AUDIO_SECONDS",
    "MAX_CHANNELS",
    "MAX_PIXELS",
    "AudioSource",
    "ImageSource",
    "decode_audio",
    "load_audio",
    "load_image",
    "load_images",
    "load_video",
    "source_name",
]
