"""Audio decoding: every source kind and format decodes to float32 mono at the model's rate;
every bad input is a MediaError naming the file (or ``item N``); limits hold."""

from __future__ import annotations

import io
import os
import struct
from pathlib import Path

import numpy as np
import pytest

import mmferry as mf
from mmferry.errors import ArgumentError, MediaError
from mmferry.media import decode_audio, load_audio

av = pytest.importorskip("av")
sf = pytest.importorskip("soundfile")

RATE = 16_000


def _tone(seconds: float, rate: int, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    mono = 0.25 * np.sin(2 * np.pi * 220 * t) + 0.1 * np.sin(2 * np.pi * 660 * t)
    if channels == 1:
        return mono.astype(np.float32)
    # Channels differ so the downmix is visible: channel c is scaled by (c + 1) / channels.
    return np.stack([mono * (c + 1) / channels for c in range(channels)], axis=1).astype(np.float32)


def _sndfile(x: np.ndarray, rate: int, fmt: str, subtype: str) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def _ffmpeg(x: np.ndarray, rate: int, fmt: str, codec: str) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as out:
        stream = out.add_stream(codec, rate=rate, layout="mono")
        for i in range(0, len(x), 4096):
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(x[None, i:i + 4096]),
                                               format="fltp", layout="mono")
            frame.sample_rate, frame.pts = rate, i
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def _near(a: np.ndarray, b: np.ndarray, tol: float) -> None:
    """Equal up to codec loss and a small codec delay (cross-correlation aligned)."""
    n = min(len(a), len(b))
    lag = int(np.argmax(np.correlate(a[:n], b[:4096], mode="valid")[:3000])) if len(a) > 7000 else 0
    assert np.abs(a[lag:lag + n - 3000] - b[:n - 3000]).max() < tol


ENCODED = {
    "wav": lambda x, r: _sndfile(x, r, "WAV", "PCM_16"),
    "flac": lambda x, r: _sndfile(x, r, "FLAC", "PCM_16"),
    "ogg": lambda x, r: _sndfile(x, r, "OGG", "VORBIS"),
    "mp3": lambda x, r: _ffmpeg(x, r, "mp3", "libmp3lame"),
    "m4a": lambda x, r: _ffmpeg(x, r, "ipod", "aac"),
}


@pytest.mark.parametrize("fmt", sorted(ENCODED))
def test_each_format_decodes_to_float32_mono_at_the_rate(fmt: str, tmp_path: Path) -> None:
    x = _tone(1.0, 48_000)
    data = ENCODED[fmt](x, 48_000)
    path = tmp_path / f"clip.{fmt}"
    path.write_bytes(data)
    native, rate = decode_audio(path)
    assert rate == 48_000 and native.dtype == np.float32 and native.ndim == 1
    # Lossless formats are exact to 16-bit PCM; lossy ones near enough once aligned.
    if fmt in ("wav", "flac"):
        np.testing.assert_allclose(native, x, atol=1 / 32768)
    else:
        assert abs(len(native) - len(x)) < 2048
        _near(native, x, 0.05)
    out = load_audio(path, RATE)
    assert out.dtype == np.float32 and out.ndim == 1 and out.flags.c_contiguous
    assert abs(len(out) - RATE) <= 700


def test_every_source_kind_gives_the_same_samples(tmp_path: Path) -> None:
    x = _tone(0.5, 22_050)
    data = ENCODED["wav"](x, 22_050)
    path = tmp_path / "a.wav"
    path.write_bytes(data)
    ref = load_audio(path, RATE)
    with open(path, "rb") as f:
        from_file = load_audio(f, RATE)
    pcm = (np.clip(x, -1, 1) * 32767).astype(np.int16)
    for got in (load_audio(str(path), RATE), load_audio(data, RATE), load_audio(bytearray(data), RATE),
                load_audio(memoryview(data), RATE), from_file, load_audio((pcm, 22_050), RATE)):
        np.testing.assert_allclose(got, ref, atol=2e-4)
    # A bare array is taken as already at the target rate: returned as it is.
    np.testing.assert_array_equal(load_audio(x, 22_050), x)


def test_channels_are_averaged_and_rate_converted_with_soxr() -> None:
    import soxr

    stereo = _tone(0.5, 44_100, channels=2)
    mono = stereo.mean(axis=1)
    got = load_audio((stereo, 44_100), RATE)
    np.testing.assert_allclose(got, soxr.resample(mono, 44_100, RATE), atol=1e-6)
    np.testing.assert_allclose(load_audio(_sndfile(stereo, 44_100, "FLAC", "PCM_24"), 44_100), mono,
                               atol=1e-6)


def _wav_header(frames: int, rate: int, channels: int) -> bytes:
    """A 16-bit PCM WAV header claiming ``frames`` frames, with those bytes following as zeros
    (or none, when ``frames`` is huge: callers cut it)."""
    data_len = frames * channels * 2
    fmt = struct.pack("<HHIIHH", 1, channels, rate, rate * channels * 2, channels * 2, 16)
    return (b"RIFF" + struct.pack("<I", 36 + data_len) + b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt
            + b"data" + struct.pack("<I", data_len))


def _bad_inputs(tmp: Path) -> dict[str, tuple[object, str]]:
    """name -> (source, what the message says); files are written under ``tmp``."""
    x = _tone(2.0, RATE)
    files = {
        "empty.wav": b"",
        "text.wav": b"this is not audio at all\n" * 40,
        "image.png": bytes.fromhex("89504e470d0a1a0a") + os.urandom(400),
        "noise.mp3": np.random.default_rng(1).integers(0, 256, 3000, dtype=np.uint8).tobytes(),
        "cut.wav": ENCODED["wav"](x, RATE)[:20_000],
        "cut.flac": ENCODED["flac"](x, RATE)[:3_000],
        "cut.ogg": ENCODED["ogg"](x, RATE)[:2_000],
        "cut.mp3": ENCODED["mp3"](x, RATE)[:4_000],
        "cut.m4a": ENCODED["m4a"](x, RATE)[:4_000],
        "header_only.wav": _wav_header(0, RATE, 1),
        "long.wav": _wav_header(RATE * 20, RATE, 1) + bytes(RATE * 40),
        "many_channels.wav": _wav_header(100, RATE, 40) + bytes(100 * 40 * 2),
        "absurd_rate.wav": _wav_header(10, 10**9, 1) + bytes(20),
        "long.mp3": ENCODED["mp3"](_tone(20.0, 8000), 8000),
    }
    out: dict[str, tuple[object, str]] = {}
    expect = {"empty.wav": "zero bytes", "text.wav": "cannot identify", "image.png": "audio",
              "noise.mp3": "cannot identify", "cut.wav": "truncated", "cut.flac": "truncated",
              "cut.ogg": "truncated", "cut.mp3": "truncated", "cut.m4a": "cannot identify",
              "header_only.wav": "no samples", "long.wav": "above the limit of 10 s",
              "many_channels.wav": "40 channels", "absurd_rate.wav": "sample rate",
              "long.mp3": "above the limit of 10 s"}
    for name, data in files.items():
        path = tmp / name
        path.write_bytes(data)
        out[name] = (path, expect[name])
    out["directory"] = (tmp, "not a regular file")
    out["missing.wav"] = (tmp / "missing.wav", "no such file")
    if hasattr(os, "mkfifo"):
        fifo = tmp / "pipe.wav"
        os.mkfifo(fifo)
        out["fifo"] = (fifo, "not a regular file")
    if os.path.exists("/dev/zero"):
        out["device"] = ("/dev/zero", "not a regular file")
    return out


def test_every_bad_input_is_a_media_error_naming_the_file(tmp_path: Path) -> None:
    failures = []
    for label, (path, says) in _bad_inputs(tmp_path).items():
        try:
            load_audio(path, RATE, max_seconds=10.0)
        except MediaError as e:
            if e.source != os.fspath(path) or os.fspath(path) not in str(e) or says not in str(e):
                failures.append(f"{label}: {e}")
        else:
            failures.append(f"{label}: decoded without an error")
    assert not failures, "\n".join(failures)


def test_bad_in_memory_sources_name_the_item() -> None:
    cases = [
        (b"", "zero bytes"),
        (b"RIFF", "cannot identify"),
        (np.zeros(0, np.float32), "no samples"),
        (np.array([0.0, np.nan], np.float32), "NaN"),
        (np.zeros((2, 3, 4), np.float32), "1-D"),
        (np.zeros(10, np.uint8), "float, int16 or int32"),
        ((np.zeros(10, np.float32), "16k"), "pair"),
        (np.zeros(RATE * 11, np.float32), "above the limit"),
        (12345, "unsupported audio source"),
        (io.StringIO("text"), "binary mode"),
    ]
    for i, (source, says) in enumerate(cases):
        with pytest.raises(MediaError, match=says) as e:
            load_audio(source, RATE, index=i, max_seconds=10.0)
        assert e.value.source == f"item {i}"


def test_byte_limit_is_checked_before_reading(tmp_path: Path) -> None:
    path = tmp_path / "big.wav"
    path.write_bytes(ENCODED["wav"](_tone(1.0, RATE), RATE))
    with pytest.raises(MediaError, match="above the limit of 1000") as e:
        load_audio(path, RATE, max_bytes=1000)
    assert e.value.source == str(path)
    with pytest.raises(MediaError, match="above the limit of 1000"), open(path, "rb") as f:
        load_audio(f, RATE, max_bytes=1000)


def test_decoding_stops_once_over_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """An MP3 states no exact duration up front: decoding stops at the first frame past it."""
    from mmferry.media import audio as audio_mod

    data = ENCODED["mp3"](_tone(30.0, 8000), 8000)
    monkeypatch.setattr(audio_mod, "_mp3_xing_samples", lambda _data: None)
    decoded = []
    real = av.AudioResampler

    class Counting:
        def __init__(self, **kw: object) -> None:
            self.inner = real(**kw)

        def resample(self, frame: object) -> list:
            out = self.inner.resample(frame)
            decoded.extend(f.samples for f in out)
            return out

    monkeypatch.setattr(av, "AudioResampler", Counting)
    with pytest.raises(MediaError, match="above the limit of 2 s"):
        load_audio(data, RATE, max_seconds=2.0)
    assert 2 * 8000 < sum(decoded) < 3 * 8000


def test_sampling_rate_must_be_a_positive_int() -> None:
    for bad in (0, -16000, 16000.0, True):
        with pytest.raises(ArgumentError, match="sampling_rate"):
            load_audio(np.zeros(10, np.float32), bad)  # type: ignore[arg-type]


def test_audio_hash_follows_decoded_content_and_rate(tmp_path: Path) -> None:
    x = _tone(0.5, RATE)
    pcm = (np.clip(x, -1, 1) * 32767).astype(np.int16)
    # Integer PCM so both writers store the same samples (their float rounding differs).
    wav, flac = ENCODED["wav"](pcm, RATE), ENCODED["flac"](pcm, RATE)
    path = tmp_path / "a.flac"
    path.write_bytes(flac)

    def key(media: object, **kw: object) -> str:
        return mf.hash_media(media, model_id="m", modality="audio", **kw)

    # One clip, losslessly encoded twice, or given as its path: one key.
    assert key(wav) == key(flac) == key(path)
    assert key((pcm, RATE)) == key(wav)
    # The rate is part of the content; so is each sample.
    assert key((pcm, RATE * 2)) != key(wav)
    changed = pcm.copy()
    changed[100] += 1
    assert key((changed, RATE)) != key(wav)
    assert key(x, sampling_rate=RATE) == key((x, RATE)) != key(x)
    with pytest.raises(MediaError, match="truncated") as e:
        key(tmp_path / "cut.wav" if (tmp_path / "cut.wav").write_bytes(wav[:1000]) else None)
    assert e.value.source == str(tmp_path / "cut.wav")
