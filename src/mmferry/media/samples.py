"""Deterministic, realistic sample media: photo-like images, moving-scene videos and
speech-like audio, for ``mmferry encode --samples``, dummy inputs and benchmarks.

Random noise is a poor stand-in for real media: it flatters or punishes resamplers, codecs
and feature extractors. Photo-like images are smooth gradients with a few hard-edged shapes
and mild sensor noise; speech-like audio is a voiced source (a harmonic series on a gliding
pitch) shaped by formant-like resonances, in syllables separated by pauses.
"""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np
from PIL import Image

__all__ = ["photo_like", "speech_like", "video_like", "write_audio", "write_image", "write_video"]


def photo_like(height: int, width: int, seed: int = 0) -> np.ndarray:
    """A ``height×width×3`` uint8 image: two-axis colour gradients, three shapes, mild noise."""
    rng = np.random.default_rng(seed)
    y = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None, None]
    x = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :, None]
    a, b, c = (rng.uniform(0.2, 0.9, 3).astype(np.float32) for _ in range(3))
    img = 255 * (a * y + b * x + c * (1 - x) * (1 - y)) / 2
    yy, xx = np.mgrid[0:height, 0:width]
    for _ in range(3):
        cy, cx = rng.uniform(0, height), rng.uniform(0, width)
        r = rng.uniform(0.1, 0.3) * min(height, width)
        inside = (yy - cy) ** 2 + (xx - cx) ** 2 < r * r
        img[inside] = rng.uniform(0, 255, 3).astype(np.float32)
    img += rng.normal(0.0, 3.0, img.shape).astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)


def video_like(frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """``frames×height×width×3`` uint8: a photo-like scene panning one pixel per frame
    diagonally, so consecutive frames differ as real footage does."""
    scene = photo_like(height + frames, width + frames, seed)
    return np.stack([scene[t:t + height, t:t + width] for t in range(frames)])


def speech_like(seconds: float, rate: int = 16000, seed: int = 0) -> np.ndarray:
    """Mono float32 in [-1, 1]: syllables of a voiced harmonic source with a gliding pitch
    and formant-like resonances, separated by short pauses, at ``rate`` Hz."""
    rng = np.random.default_rng(seed)
    n = round(seconds * rate)
    t = np.arange(n, dtype=np.float64) / rate
    pitch = 120 + 30 * np.sin(2 * np.pi * 0.7 * t + rng.uniform(0, np.pi))
    phase = 2 * np.pi * np.cumsum(pitch) / rate
    formants = rng.uniform([500, 1200, 2400], [800, 1800, 3000])
    voice = np.zeros(n)
    for k in range(1, 30):
        freq = k * pitch
        gain = sum(np.exp(-((freq - f) / 150.0) ** 2) for f in formants) / k
        voice += gain * np.sin(k * phase)
    syllable = 0.25  # seconds of voice, then a pause of up to 0.15 s
    envelope = np.clip(np.sin(np.pi * (t % (syllable + 0.15)) / syllable), 0, None)
    envelope[(t % (syllable + 0.15)) > syllable] = 0.0
    audio = voice * envelope + rng.normal(0, 0.003, n)
    peak = np.abs(audio).max() or 1.0
    return (0.5 * audio / peak).astype(np.float32)


def write_image(path: Path, pixels: np.ndarray) -> Path:
    Image.fromarray(pixels).save(path)
    return path


def write_video(folder: Path, frames: np.ndarray) -> Path:
    """A video as a folder of PNG frames (what :func:`mmferry.media.load_video` reads
    without PyAV)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, frame in enumerate(frames):
        Image.fromarray(frame).save(folder / f"frame-{i:04d}.png")
    return folder


def write_audio(path: Path, audio: np.ndarray, rate: int) -> Path:
    """16-bit PCM WAV, with the standard library alone."""
    pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(pcm.tobytes())
    return path
