"""Decode one audio clip into float32 mono samples at a model's rate, with limits.

Sources are encoded bytes, a file path, a binary file object, a 1-D array (taken as already
at the target rate) or an ``(array, rate)`` pair. WAV / FLAC / OGG and the other formats
libsndfile reads natively go through soundfile; MP3, M4A and anything else FFmpeg reads go
through PyAV. Channels are averaged to mono and the rate converted with soxr.

Limits (duration, bytes, channels) are checked from the header before decoding where the
format gives them, else while decoding, which stops as soon as a limit is passed. Anything
that cannot be decoded or breaks a limit raises :class:`~mmferry.errors.MediaError` naming
the file, or ``item N`` for in-memory sources. soundfile, soxr and PyAV are the ``audio``
extra; they are imported on first use.
"""

from __future__ import annotations

import io
import os
import stat
import struct
from typing import Any, BinaryIO

import numpy as np

from mmferry.errors import ArgumentError, MediaError

__all__ = [
    "MAX_AUDIO_BYTES",
    "MAX_AUDIO_SECONDS",
    "MAX_CHANNELS",
    "AudioSource",
    "decode_audio",
    "load_audio",
]

MAX_AUDIO_SECONDS = 600.0
# Ten minutes of 48 kHz stereo float32 WAV is 230 MB; anything bigger than this is not a clip.
MAX_AUDIO_BYTES = 256 << 20
MAX_CHANNELS = 32
# A header may claim any rate; a bound on it bounds the samples a short duration can hold.
_MAX_SOURCE_RATE = 768_000

AudioSource = (bytes | bytearray | memoryview | str | os.PathLike | BinaryIO | np.ndarray
               | tuple[np.ndarray, int])

# libsndfile formats soundfile decodes itself; MP3 (which newer libsndfile also reads) goes to
# FFmpeg, whose decoder handles gapless/Xing frames and truncated streams predictably.
# FFmpeg demuxers whose header states the exact length of the stream.
_EXACT_DURATION_FORMATS = frozenset({"mov", "mp4", "m4a", "matroska", "webm", "ogg", "wav",
                                     "flac", "aiff", "caf", "w64"})
_SNDFILE_FORMATS = frozenset({"WAV", "WAVEX", "FLAC", "OGG", "AIFF", "AU", "CAF", "W64", "RF64",
                              "RAW", "PAF", "SVX", "NIST", "VOC", "IRCAM", "MAT4", "MAT5",
                              "PVF", "XI", "HTK", "SDS", "AVR", "SD2", "WVE", "MPC2K"})


def _name(source: Any, index: int | None) -> str:
    if isinstance(source, str | os.PathLike):
        return os.fspath(source)
    file_name = getattr(source, "name", None)
    if isinstance(file_name, str) and not isinstance(source, np.ndarray | tuple):
        return file_name
    return "item" if index is None else f"item {index}"


def _read_path(path: str | os.PathLike, name: str, max_bytes: int) -> bytes:
    # Stat first: opening a FIFO would block and a device could stream forever.
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise MediaError("no such file", source=name) from None
    except OSError as e:
        raise MediaError(f"cannot read the file ({e.strerror or e})", source=name) from None
    if not stat.S_ISREG(st.st_mode):
        raise MediaError("not a regular file (a directory, FIFO or device)", source=name)
    _check_nbytes(st.st_size, name, max_bytes)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            # The path may have been swapped between stat and open; vet what was opened.
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise MediaError("not a regular file (a directory, FIFO or device)", source=name)
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise MediaError(f"cannot read the file ({e.strerror or e})", source=name) from None
    _check_nbytes(len(data), name, max_bytes)
    return data


def _check_nbytes(n: int, name: str, max_bytes: int) -> None:
    if n == 0:
        raise MediaError("empty audio (zero bytes)", source=name)
    if n > max_bytes:
        raise MediaError(f"audio is {n} bytes, above the limit of {max_bytes}", source=name)


def _check_header(frames: int | None, rate: int, channels: int, name: str,
                  max_seconds: float, max_channels: int) -> None:
    if channels <= 0 or channels > max_channels:
        raise MediaError(f"audio has {channels} channels; 1 to {max_channels} are accepted",
                         source=name)
    if rate <= 0 or rate > _MAX_SOURCE_RATE:
        raise MediaError(f"audio sample rate {rate} Hz is outside 1..{_MAX_SOURCE_RATE}",
                         source=name)
    if frames is not None:
        if frames <= 0:
            raise MediaError("audio has no samples", source=name)
        _check_duration(frames, rate, name, max_seconds)


def _check_duration(frames: int, rate: int, name: str, max_seconds: float) -> None:
    if frames > max_seconds * rate:
        raise MediaError(f"audio lasts {frames / rate:.1f} s, above the limit of {max_seconds:g} s",
                         source=name)


def _wav_truncated(data: bytes) -> bool:
    """True when a RIFF/WAVE file's ``data`` chunk claims more bytes than the file holds.

    libsndfile silently shortens such a file to what is there; a cut-off upload must be an
    error instead. Streaming writers put 0 or 0xFFFFFFFF there (size unknown): not truncated.
    """
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return False
    pos = 12
    while pos + 8 <= len(data):
        chunk, size = data[pos:pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        if chunk == b"data":
            return size not in (0, 0xFFFFFFFF) and pos + 8 + size > len(data)
        pos += 8 + size + (size & 1)
    return False


def _ogg_truncated(data: bytes) -> bool:
    """True when an Ogg file's last page runs past the end of the data (a cut-off upload:
    the decoders play what is there without a word)."""
    if data[:4] != b"OggS":
        return False
    pos = 0
    while pos + 27 <= len(data):
        if data[pos:pos + 4] != b"OggS":
            return True
        nsegs = data[pos + 26]
        if pos + 27 + nsegs > len(data):
            return True
        pos += 27 + nsegs + sum(data[pos + 27:pos + 27 + nsegs])
    return pos != len(data)


def _mp3_xing_samples(data: bytes) -> int | None:
    """Samples an MP3's Xing / Info frame states (frames x samples per frame), else None.

    FFmpeg reports a duration for every MP3 but, without this frame, estimates it from the
    first frame's bit rate; only the frame count is exact enough to tell a cut-off file.
    """
    pos = 0
    if data[:3] == b"ID3" and len(data) >= 10:
        size = (data[6] << 21) | (data[7] << 14) | (data[8] << 7) | data[9]
        pos = 10 + size + (10 if data[5] & 0x10 else 0)
    if pos + 4 > len(data) or data[pos] != 0xFF or (data[pos + 1] & 0xE0) != 0xE0:
        return None
    version, layer = (data[pos + 1] >> 3) & 3, (data[pos + 1] >> 1) & 3
    per_frame = {1: 1152 if version == 3 else 576, 2: 1152, 3: 384}.get(layer)
    head = data[pos + 4:pos + 64]
    for tag in (b"Xing", b"Info"):
        at = head.find(tag)
        if per_frame and at >= 0 and at + 12 <= len(head):
            flags, frames = struct.unpack_from(">II", head, at + 4)
            return frames * per_frame if flags & 1 else None
    return None


def _decode_sndfile(data: bytes, name: str, max_seconds: float,
                    max_channels: int) -> tuple[np.ndarray, int] | None:
    """Decode with libsndfile; ``None`` when it is not a format libsndfile should handle."""
    import soundfile as sf

    try:
        f = sf.SoundFile(io.BytesIO(data))
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError):
        return None
    with f:
        if f.format not in _SNDFILE_FORMATS:
            return None
        _check_header(f.frames, f.samplerate, f.channels, name, max_seconds, max_channels)
        if f.format in ("WAV", "WAVEX") and _wav_truncated(data):
            raise MediaError("truncated WAV: its data chunk runs past the end of the file",
                             source=name)
        try:
            samples = f.read(dtype="float32", always_2d=True)
        except (sf.LibsndfileError, RuntimeError) as e:
            raise MediaError(f"cannot decode the audio ({e}); is the file truncated?",
                             source=name) from None
        if len(samples) < f.frames:
            raise MediaError(f"truncated audio: {len(samples)} of the header's {f.frames} frames "
                             "decoded", source=name)
        return samples, f.samplerate


def _decode_ffmpeg(data: bytes, name: str, max_seconds: float,
                   max_channels: int) -> tuple[np.ndarray, int]:
    import av

    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, OSError, ValueError, UnicodeDecodeError) as e:
        raise MediaError(f"cannot identify an audio format ({e})", source=name) from None
    with container:
        streams = container.streams.audio
        if not streams:
            raise MediaError("no audio stream in the file", source=name)
        stream = streams[0]
        ctx = stream.codec_context
        rate = ctx.sample_rate or stream.sample_rate or 0
        _check_header(None, rate, ctx.channels, name, max_seconds, max_channels)
        # Containers with an exact length in their header refuse long files before decoding
        # and reveal a cut-off stream after; MP3 / ADTS only estimate it from the bit rate
        # (off by 2x for VBR without a Xing frame), so those are bounded while decoding alone.
        expected = None
        if _EXACT_DURATION_FORMATS.intersection(container.format.name.split(",")):
            if stream.duration is not None and stream.time_base is not None:
                expected = int(stream.duration * stream.time_base * rate)
            elif container.duration is not None:
                expected = int(container.duration * rate / av.time_base)
        elif "mp3" in container.format.name.split(","):
            expected = _mp3_xing_samples(data)
        if expected is not None:
            _check_duration(expected, rate, name, max_seconds)
        # Planar float keeps each channel's samples as decoded; the layout is left alone so
        # the downmix is ours (a plain mean), not FFmpeg's matrix.
        resampler = av.AudioResampler(format="fltp")
        chunks: list[np.ndarray] = []
        frames = 0
        try:
            for packet_frame in container.decode(stream):
                if packet_frame.sample_rate != rate:
                    raise MediaError(f"the sample rate changes mid-stream ({rate} -> "
                                     f"{packet_frame.sample_rate} Hz)", source=name)
                for out in resampler.resample(packet_frame):
                    block = out.to_ndarray()
                    if block.shape[0] != ctx.channels:
                        raise MediaError("the channel count changes mid-stream", source=name)
                    chunks.append(block)
                    frames += block.shape[1]
                    # Stop decoding the moment the stream passes the limit.
                    _check_duration(frames, rate, name, max_seconds)
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray())
                frames += chunks[-1].shape[1]
        except (av.FFmpegError, OSError, ValueError) as e:
            raise MediaError(f"cannot decode the audio ({e}); is the file truncated?",
                             source=name) from None
        _check_duration(frames, rate, name, max_seconds)
        if frames == 0:
            raise MediaError("audio has no samples", source=name)
        # Encoder priming and padding make the decoded length differ a little from the header's.
        if expected is not None and frames < 0.98 * expected - max(0.05 * rate, 4096):
            raise MediaError(f"truncated audio: {frames} of the header's {expected} samples decoded",
                             source=name)
        return np.concatenate(chunks, axis=1).T, rate


def _decode_bytes(data: bytes, name: str, max_seconds: float,
                  max_channels: int) -> tuple[np.ndarray, int]:
    if _ogg_truncated(data):
        raise MediaError("truncated Ogg: its last page runs past the end of the file", source=name)
    decoded = _decode_sndfile(data, name, max_seconds, max_channels)
    if decoded is None:
        decoded = _decode_ffmpeg(data, name, max_seconds, max_channels)
    return decoded


def _from_array(array: Any, rate: int, name: str, max_seconds: float,
                max_channels: int) -> tuple[np.ndarray, int]:
    if hasattr(array, "detach") and hasattr(array, "numpy"):  # a torch tensor, without importing torch
        array = array.detach().cpu().numpy()
    if not isinstance(array, np.ndarray):
        raise MediaError(f"unsupported audio source {type(array).__name__}", source=name)
    if array.ndim == 1:
        array = array[:, None]
    elif array.ndim != 2:
        raise MediaError(f"audio arrays must be 1-D (samples) or 2-D (samples x channels), got "
                         f"shape {array.shape}", source=name)
    if np.issubdtype(array.dtype, np.floating):
        samples = array.astype(np.float32, copy=False)
    elif array.dtype in (np.int16, np.int32):
        # PCM integers: full scale maps to [-1, 1), as soundfile decodes them.
        samples = array.astype(np.float32) / np.float32(np.iinfo(array.dtype).max + 1)
    else:
        raise MediaError(f"audio arrays must be float, int16 or int32, got {array.dtype}",
                         source=name)
    _check_header(samples.shape[0], rate, samples.shape[1], name, max_seconds, max_channels)
    if not np.isfinite(samples).all():
        raise MediaError("audio samples contain NaN or infinity", source=name)
    return samples, rate


def decode_audio(source: AudioSource, *, sampling_rate: int | None = None, index: int | None = None,
                 max_seconds: float = MAX_AUDIO_SECONDS, max_bytes: int = MAX_AUDIO_BYTES,
                 max_channels: int = MAX_CHANNELS) -> tuple[np.ndarray, int]:
    """Decode ``source`` into float32 mono samples at its own rate: ``(samples, rate)``.

    A bare array is taken as being at ``sampling_rate`` (required for one). Limits and errors
    as :func:`load_audio`.
    """
    name = _name(source, index)
    if isinstance(source, tuple):
        if len(source) != 2 or isinstance(source[1], bool) or not isinstance(source[1], int | np.integer):
            raise MediaError("an audio pair must be (array, sampling rate as an int)", source=name)
        samples, rate = _from_array(source[0], int(source[1]), name, max_seconds, max_channels)
    elif isinstance(source, np.ndarray) or (hasattr(source, "detach") and hasattr(source, "numpy")):
        if sampling_rate is None:
            raise ArgumentError("a bare audio array needs its rate; pass (array, rate)",
                                argument="sampling_rate")
        samples, rate = _from_array(source, sampling_rate, name, max_seconds, max_channels)
    else:
        if isinstance(source, str | os.PathLike):
            data = _read_path(source, name, max_bytes)
        elif isinstance(source, bytes | bytearray | memoryview):
            data = bytes(source)
            _check_nbytes(len(data), name, max_bytes)
        elif hasattr(source, "read"):
            try:
                data = source.read(max_bytes + 1)
            except (OSError, ValueError) as e:
                raise MediaError(f"cannot read the file object ({e})", source=name) from None
            if not isinstance(data, bytes | bytearray):
                raise MediaError("the file object must be opened in binary mode", source=name)
            _check_nbytes(len(data), name, max_bytes)
            data = bytes(data)
        else:
            raise MediaError(
                f"unsupported audio source {type(source).__name__}; expected bytes, a path, a "
                "binary file object, a 1-D array or an (array, rate) pair",
                source=name,
            )
        samples, rate = _decode_bytes(data, name, max_seconds, max_channels)
    mono = samples[:, 0] if samples.shape[1] == 1 else samples.mean(axis=1, dtype=np.float32)
    return np.ascontiguousarray(mono, dtype=np.float32), rate


def load_audio(source: AudioSource, sampling_rate: int, *, index: int | None = None,
               max_seconds: float = MAX_AUDIO_SECONDS, max_bytes: int = MAX_AUDIO_BYTES,
               max_channels: int = MAX_CHANNELS) -> np.ndarray:
    """Decode ``source`` into float32 mono samples at ``sampling_rate`` (a 1-D array).

    ``source``: a path, encoded bytes, a binary file object, a 1-D float / int16 / int32 array
    (taken as already at ``sampling_rate``) or an ``(array, rate)`` pair (the array 1-D, or
    ``samples x channels``). Files are read only if they are regular files, and their size is
    checked before reading. Channels are averaged; the rate is converted with soxr (HQ).
    ``index`` names an in-memory source in errors (``item N``).

    Raises:
        MediaError: empty, truncated, non-audio or undecodable data; more than ``max_seconds``
            of audio, ``max_bytes`` of encoded data or ``max_channels`` channels.
        ArgumentError: ``sampling_rate`` is not a positive int.
    """
    if isinstance(sampling_rate, bool) or not isinstance(sampling_rate, int | np.integer) \
            or sampling_rate <= 0:
        raise ArgumentError(f"must be a positive int, got {sampling_rate!r}", argument="sampling_rate")
    samples, rate = decode_audio(source, sampling_rate=int(sampling_rate), index=index,
                                 max_seconds=max_seconds, max_bytes=max_bytes,
                                 max_channels=max_channels)
    if rate == sampling_rate:
        return samples
    import soxr

    out = soxr.resample(samples, rate, int(sampling_rate), quality="HQ")
    return np.ascontiguousarray(out, dtype=np.float32)
