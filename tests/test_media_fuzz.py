"""Issue 9, class 3: every exception a decoder raises on bad media is a MediaError naming
the file. A fixed-seed, bounded fuzzer over mutated files of every format Pillow opens."""

from __future__ import annotations

import io
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmferry.errors import MediaError
from mmferry.media import load_image

Image.init()
MUTATIONS = 80  # per format; a few seconds in all
SMALL = 1 << 16  # pixel limit while fuzzing: a mutated header must not make us decode MBs


def _saved() -> dict[str, bytes]:
    """A small valid file of every format Pillow both writes and reads here."""
    rng = np.random.default_rng(0)
    base = Image.fromarray(rng.integers(0, 256, (12, 10, 3), dtype=np.uint8))
    modes = {"XBM": "1", "MSP": "1", "SPIDER": "F", "BLP": "P"}
    out = {}
    for fmt in sorted(set(Image.SAVE) & set(Image.OPEN)):
        img = base.convert(modes.get(fmt, "RGB"))
        if fmt == "ICNS":
            img = img.resize((16, 16))
        buf = io.BytesIO()
        try:
            img.save(buf, format=fmt)
            load_image(buf.getvalue())
        except Exception:  # no encoder or decoder plugin here (EPS needs Ghostscript, ...)
            continue
        out[fmt] = buf.getvalue()
    return out


def _headers() -> dict[str, bytes]:
    """Read-only formats: their signature and header fields, then seeded bytes, so the
    fuzzer reaches each plugin's header parser."""
    rng = np.random.default_rng(1)
    tail = rng.integers(0, 256, 512, dtype=np.uint8).tobytes()
    return {
        "PSD": b"8BPS\x00\x01" + b"\x00" * 6 + b"\x00\x03\x00\x00\x00\x08\x00\x00\x00\x08"
               b"\x00\x08\x00\x03" + tail,
        "SUN": b"\x59\xa6\x6a\x95\x00\x00\x00\x08\x00\x00\x00\x08\x00\x00\x00\x18" + tail,
        "FITS": b"SIMPLE  =                    T".ljust(80) + b"BITPIX  =                    8"
                .ljust(80) + b"NAXIS   =                    2".ljust(80)
                + b"NAXIS1  =                    8".ljust(80)
                + b"NAXIS2  =                    8".ljust(80) + b"END".ljust(80) + tail,
        "XPM": b'/* XPM */\nstatic char *x[] = {\n"2 2 1 1",\n"a c #ff0000",\n"aa",\n"aa"};\n',
        "DCX": b"\xb1\x68\xde\x3a" + b"\x0c\x10\x00\x00" + b"\x00" * 4 + tail,
        "CUR": b"\x00\x00\x02\x00\x01\x00\x08\x08\x00\x00\x00\x00\x00\x00"
               b"\x28\x00\x00\x00\x16\x00\x00\x00" + tail,
        "PIXAR": b"\x80\xe8\x00\x00" + tail,
        "FTEX": b"FTEX" + b"\x00\x00\x00\x00" + tail,
        "XVTHUMB": b"P7 332\n#IMGINFO\n#END_OF_COMMENTS\n8 8 255\n" + tail,
        "FLI": b"\x00\x02\x00\x00\x11\xaf\x01\x00\x08\x00\x08\x00\x08\x00" + tail,
        "GBR": b"\x00\x00\x00\x1c\x00\x00\x00\x02\x00\x00\x00\x08\x00\x00\x00\x08"
               b"\x00\x00\x00\x01GIMP\x00\x00\x00\x0a" + tail,
        "DDS-DX10": b"DDS " + (124).to_bytes(4, "little") + b"\x07\x10\x00\x00"
                    + (8).to_bytes(4, "little") * 2 + b"\x00" * 56 + (32).to_bytes(4, "little")
                    + b"\x04\x00\x00\x00DX10" + b"\x00" * 40 + (98).to_bytes(4, "little")
                    + tail,
    }


def _mutate(data: bytes, rng: np.random.Generator) -> bytes:
    b = bytearray(data)
    kind = rng.integers(0, 5)
    if kind == 0:  # truncate
        return bytes(b[:rng.integers(0, len(b))])
    if kind == 1:  # flip bits
        for _ in range(rng.integers(1, 9)):
            i = rng.integers(0, len(b))
            b[i] ^= 1 << rng.integers(0, 8)
    elif kind == 2:  # overwrite a header field with an extreme 32-bit value
        i = rng.integers(0, max(1, min(len(b) - 4, 128)))
        value = [0xFFFFFFFF, 0x7FFFFFFF, 0x80000000, 0, 0xFFFF][rng.integers(0, 5)]
        b[i:i + 4] = value.to_bytes(4, ["little", "big"][rng.integers(0, 2)])
    elif kind == 3:  # random bytes over a run
        i = rng.integers(0, len(b))
        n = int(rng.integers(1, 33))
        b[i:i + n] = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    else:  # duplicate or drop a chunk
        i, j = sorted(rng.integers(0, len(b), 2))
        b = b[:j] + b[i:j] + b[j:] if rng.integers(0, 2) else b[:i] + b[j:]
    return bytes(b)


SEEDS = {**_saved(), **_headers()}


def test_the_fuzzer_covers_the_formats_pillow_writes_and_more() -> None:
    assert {"PNG", "JPEG", "GIF", "TIFF", "BMP", "WEBP", "DDS", "ICO"} <= set(SEEDS)
    assert {"PSD", "SUN", "FITS", "XPM"} <= set(SEEDS)


@pytest.mark.parametrize("fmt", sorted(SEEDS))
def test_mutated_files_decode_or_raise_a_media_error_naming_the_file(tmp_path: Path,
                                                                     fmt: str) -> None:
    rng = np.random.default_rng(sum(fmt.encode()))
    seed = SEEDS[fmt]
    started = time.perf_counter()
    outcomes = {"decoded": 0, "refused": 0}
    for n in range(MUTATIONS):
        path = tmp_path / f"{fmt.lower()}-{n}.bin"
        path.write_bytes(_mutate(seed, rng))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Pillow warns on some odd headers
            try:
                img = load_image(path, max_pixels=SMALL)
            except MediaError as e:
                assert e.source == str(path)
                assert str(e).startswith(str(path))
                outcomes["refused"] += 1
                continue
        assert img.mode == "RGB" and img.width * img.height <= SMALL
        outcomes["decoded"] += 1
    assert sum(outcomes.values()) == MUTATIONS
    assert time.perf_counter() - started < 20, "a mutated file made decoding slow"


def test_decoder_exceptions_of_every_kind_become_media_errors(tmp_path: Path,
                                                              monkeypatch) -> None:
    png = io.BytesIO()
    Image.new("RGB", (2, 2)).save(png, format="PNG")
    path = tmp_path / "x.png"
    path.write_bytes(png.getvalue())
    for exc in (NotImplementedError("dds"), OverflowError("psd"), ZeroDivisionError("x"),
                KeyError("k"), MemoryError(), RuntimeError("r"), AttributeError("a")):
        def broken(self, exc=exc):
            raise exc
        monkeypatch.setattr(Image.Image, "load", broken)
        with pytest.raises(MediaError) as e:
            load_image(path)
        assert e.value.source == str(path) and type(exc).__name__ in str(e.value)
