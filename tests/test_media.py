"""Media decoding: every source kind decodes to RGB; bad media is a MediaError naming it."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmferry.errors import MediaError
from mmferry.media import load_image, load_images, load_video


def _png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width×height`` RGB pixels, with no pixel data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"") + chunk(b"IEND", b"")


@pytest.fixture
def pixels() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (12, 20, 3), dtype=np.uint8)


def test_every_source_kind_decodes_to_the_same_rgb(pixels: np.ndarray, tmp_path: Path) -> None:
    data = _png(pixels)
    path = tmp_path / "a.png"
    path.write_bytes(data)
    for source in (data, bytearray(data), memoryview(data), path, str(path),
                   Image.fromarray(pixels), pixels):
        img = load_image(source)
        assert img.mode == "RGB" and img.size == (20, 12)
        np.testing.assert_array_equal(np.asarray(img), pixels)


def test_grey_and_alpha_become_rgb_with_alpha_on_white() -> None:
    grey = load_image(np.full((4, 5), 7, dtype=np.uint8))
    assert grey.mode == "RGB" and np.asarray(grey).tolist()[0][0] == [7, 7, 7]
    rgba = np.zeros((3, 3, 4), dtype=np.uint8)
    rgba[0, 0] = (10, 20, 30, 255)  # opaque keeps its colour; the rest is fully transparent
    out = np.asarray(load_image(rgba))
    assert out[0, 0].tolist() == [10, 20, 30]
    assert out[1, 1].tolist() == [255, 255, 255]


def test_exif_rotation_is_applied(pixels: np.ndarray) -> None:
    img = Image.fromarray(pixels)
    exif = img.getexif()
    exif[0x0112] = 6  # rotate 90° clockwise to display
    buf = io.BytesIO()
    img.save(buf, format="PNG", exif=exif)
    assert load_image(buf.getvalue()).size == (12, 20)


def test_unreadable_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "noise.jpg"
    path.write_bytes(b"not an image at all" * 10)
    with pytest.raises(MediaError, match="cannot identify") as e:
        load_image(path)
    assert e.value.source == str(path) and str(path) in str(e.value)


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(MediaError, match="no such file") as e:
        load_image(tmp_path / "absent.png")
    assert e.value.source == str(tmp_path / "absent.png")
    with pytest.raises(MediaError, match="a directory, not a file"):
        load_image(tmp_path)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_file_names_the_file(fmt: str, tmp_path: Path) -> None:
    array = np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format=fmt)
    path = tmp_path / f"cut.{fmt.lower()}"
    path.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    with pytest.raises(MediaError, match="truncated") as e:
        load_image(path)
    assert e.value.source == str(path)


def test_zero_sized_images_are_refused() -> None:
    with pytest.raises(MediaError, match="zero-sized") as e:
        load_image(Image.new("RGB", (0, 5)), index=3)
    assert e.value.source == "item 3"
    with pytest.raises(MediaError, match="zero-sized"):
        load_image(np.zeros((0, 4, 3), dtype=np.uint8))


def test_decompression_bomb_is_refused_from_the_header(tmp_path: Path) -> None:
    # 100000 x 100000 claimed by a 33-byte file: refused before any pixel is decoded.
    path = tmp_path / "bomb.png"
    path.write_bytes(_png_header(100_000, 100_000))
    with pytest.raises(MediaError, match="decompression bomb") as e:
        load_image(path)
    assert e.value.source == str(path)


def test_our_pixel_limit_applies_to_every_source(pixels: np.ndarray) -> None:
    for source in (_png(pixels), Image.fromarray(pixels), pixels):
        with pytest.raises(MediaError, match="above the limit of 100"):
            load_image(source, max_pixels=100)
    assert load_image(pixels, max_pixels=240).size == (20, 12)


def test_bad_arrays_and_types() -> None:
    with pytest.raises(MediaError, match="uint8"):
        load_image(np.zeros((4, 4, 3), dtype=np.float32), index=0)
    with pytest.raises(MediaError, match="HxW"):
        load_image(np.zeros((4, 4, 2), dtype=np.uint8))
    with pytest.raises(MediaError, match="unsupported image source int"):
        load_image(5)  # type: ignore[arg-type]


def test_one_bad_item_is_named_and_the_others_still_decode(pixels: np.ndarray,
                                                           tmp_path: Path) -> None:
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG garbage")
    sources = [pixels, bad, _png(pixels)]
    with pytest.raises(MediaError) as e:
        load_images(sources)
    assert e.value.source == str(bad)
    results = []
    for i, s in enumerate(sources):
        try:
            results.append(load_image(s, index=i).size)
        except MediaError as err:
            results.append(err.source)
    assert results == [(20, 12), str(bad), (20, 12)]
    with pytest.raises(MediaError) as e:
        load_images([pixels, b"junk"])
    assert e.value.source == "item 1"


def test_video_frames(pixels: np.ndarray) -> None:
    frames = load_video([pixels, _png(pixels), Image.fromarray(pixels)])
    assert len(frames) == 3 and all(f.mode == "RGB" and f.size == (20, 12) for f in frames)
    assert len(load_video(np.stack([pixels] * 4))) == 4
    with pytest.raises(MediaError, match="at least one frame") as e:
        load_video([], index=2)
    assert e.value.source == "item 2"
    with pytest.raises(MediaError, match="share a size"):
        load_video([pixels, pixels[:6]])
    with pytest.raises(MediaError) as e:
        load_video([pixels, b"junk"], index=0)
    assert e.value.source == "item 0, frame 1"
    with pytest.raises(MediaError, match="not one image"):
        load_video(Image.fromarray(pixels))
    with pytest.raises(MediaError, match="cannot decode the video") as e:
        load_video(b"junk" * 100, index=4)
    assert e.value.source == "item 4"


def _mp4(path: Path, frames: np.ndarray) -> Path:
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=8)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return path


def test_video_files_are_sampled_evenly_and_limited(tmp_path: Path) -> None:
    from mmferry.media import samples
    from mmferry.media.video import sample_indices

    assert sample_indices(3, 8) == [0, 1, 2]
    assert sample_indices(10, 4) == [0, 3, 6, 9]
    frames = samples.video_like(10, 32, 48, seed=1)
    path = _mp4(tmp_path / "v.mp4", frames)
    got = load_video(path, max_frames=4)
    assert len(got) == 4 and got[0].size == (48, 32)
    # The sampled frames are frames 0, 3, 6, 9 of the clip (lossy: compare coarsely).
    for frame, t in zip(got, [0, 3, 6, 9], strict=True):
        err = np.abs(np.asarray(frame, np.int16) - frames[t].astype(np.int16)).mean()
        assert err < 12, (t, err)
    assert len(load_video(path.read_bytes())) == 10
    with pytest.raises(MediaError, match="above the limit") as e:
        load_video(path, max_pixels=1000)
    assert e.value.source == str(path)
    with pytest.raises(MediaError, match="bytes, above the limit"):
        load_video(path, max_bytes=100)
    with pytest.raises(MediaError, match="no such file"):
        load_video(tmp_path / "absent.mp4")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(MediaError, match="holds no files"):
        load_video(empty)
