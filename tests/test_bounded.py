"""Issue 9, class 2: no input makes mmferry allocate without limit or wait forever."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import mmferry as mf
from mmferry.errors import ArgumentError, CheckpointError, MediaError
from mmferry.files import FileRefused, read_regular
from mmferry.media import load_image


def _finishes(fn, seconds: float = 5.0):
    """Run ``fn`` in a thread; fail (instead of hanging the suite) if it blocks."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn} blocked for {seconds} s"
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("value")


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    path = tmp_path / "pipe.png"
    os.mkfifo(path)
    return path


def test_a_fifo_is_refused_without_blocking(fifo: Path) -> None:
    with pytest.raises(MediaError, match="not a regular file") as e:
        _finishes(lambda: load_image(fifo))
    assert e.value.source == str(fifo)
    with pytest.raises(MediaError, match="not a regular file"):
        _finishes(lambda: mf.hash_media(fifo, model_id="m", modality="image"))
    (fifo.parent / "config.json").unlink(missing_ok=True)
    os.mkfifo(fifo.parent / "config.json")
    with pytest.raises(CheckpointError, match="not a regular file"):
        _finishes(lambda: mf.models.checkpoint.read_json(fifo.parent, "config.json"))


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="no /dev/zero on this system")
def test_a_device_file_is_refused_without_reading_forever() -> None:
    with pytest.raises(MediaError, match="not a regular file"):
        _finishes(lambda: load_image("/dev/zero"))
    with pytest.raises(MediaError, match="not a regular file"):
        _finishes(lambda: mf.hash_media("/dev/zero", model_id="m", modality="image"))


def test_sizes_are_checked_before_reading(tmp_path: Path) -> None:
    big = tmp_path / "big.png"
    with open(big, "wb") as f:  # sparse: costs no disk, claims 64 GiB
        f.truncate(64 << 30)
    started = time.perf_counter()
    with pytest.raises(MediaError, match="above the limit") as e:
        load_image(big)
    with pytest.raises(MediaError, match="above the limit"):
        mf.hash_media(big, model_id="m", modality="image", max_bytes=1 << 20)
    assert time.perf_counter() - started < 1.0 and e.value.source == str(big)
    with pytest.raises(FileRefused, match="above the limit"):
        read_regular(big, 10)
    small = tmp_path / "small.bin"
    small.write_bytes(b"0123456789")
    assert read_regular(small, 10) == b"0123456789"
    with pytest.raises(FileRefused, match="a directory"):
        read_regular(tmp_path, 10)


@pytest.fixture(scope="module")
def qwen():
    return mf.models.load("qwen2-vl")


@pytest.mark.parametrize("options, key", [
    ({"min_pixels": 10 ** 8}, "min_pixels"),
    ({"max_pixels": 10 ** 9}, "max_pixels"),
    ({"min_pixels": 0}, "min_pixels"),
    ({"min_pixels": -5}, "min_pixels"),
    ({"max_pixels": True}, "max_pixels"),
    ({"max_pixels": 3.5e6}, "max_pixels"),
    ({"min_pixels": "3136"}, "min_pixels"),
    ({"min_pixels": 200_000, "max_pixels": 100_000}, "min_pixels"),
])
def test_resize_options_are_bounded_before_any_pixel_is_made(qwen, options, key) -> None:
    one = np.zeros((1, 1, 3), dtype=np.uint8)
    with pytest.raises(ArgumentError) as e:
        qwen.processor(images=[one], **options)
    assert e.value.argument == key


def test_the_largest_upscale_of_a_tiny_image_is_small(qwen) -> None:
    from mmferry.models.qwen2_vl import MAX_MIN_PIXELS

    one = np.zeros((1, 1, 3), dtype=np.uint8)
    out = qwen.processor(images=[one], min_pixels=MAX_MIN_PIXELS)
    assert out["pixel_values"].nbytes < 32 << 20  # a megapixel floor, not hundreds of MB


@pytest.mark.parametrize("values, key", [
    ({"min_pixels": "big"}, "min_pixels"),
    ({"max_pixels": 0}, "max_pixels"),
    ({"size": {"shortest_edge": 10 ** 9}}, "min_pixels"),
    ({"image_mean": [0.5, "x", 0.5]}, "image_mean"),
    ({"image_std": [0.5, 0.0, 0.5]}, "image_std"),
    ({"size": "huge"}, "size"),
])
def test_preprocessor_config_values_are_checked(tmp_path: Path, values, key) -> None:
    from mmferry.models.qwen2_vl import ProcessorConfig

    with pytest.raises(ArgumentError, match=key):
        ProcessorConfig.from_dict(values)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(values))
    with pytest.raises(ArgumentError, match=key):
        mf.models.model_class("qwen2-vl").from_config(None, tmp_path)
