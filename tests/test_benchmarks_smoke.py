"""The benchmarks run end to end in their quick modes: the data path without a peer, image
preprocessing on one tiny size."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("split", "encode", "decode", "batch", "transfer", "batch+transfer", "end_to_end")
CASES = ("qwen2vl_f32", "qwen2vl_bf16", "qwen2vl_small64", "qwen2audio")


def test_datapath_quick_runs_every_stage() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "datapath.py"), "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "peer: none" in out
    assert "exactness: every input tensor reproduced" in out
    lines = out.splitlines()
    for case in CASES:
        start = next(i for i, line in enumerate(lines) if line.startswith(f"{case}:"))
        table = lines[start + 2 : start + 2 + len(STAGES)]
        assert [row.split()[0] for row in table] == list(STAGES), (case, table)
        # every stage has an mmferry figure (a number, not "-")
        assert all(row.split()[1].replace(",", "").isdigit() for row in table), table
        assert lines[start + 2 + len(STAGES)].startswith("header bytes")
    assert "targets" in out
    assert "foreign CPU:" in out


def test_every_encoder_reference_names_a_registered_model() -> None:
    import importlib
    import pkgutil

    import mmferry as mf

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import encoder_refs

        modules = [importlib.import_module(f"encoder_refs.{m.name}")
                   for m in pkgutil.iter_modules(encoder_refs.__path__)]
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    names = [m.NAME for m in modules]
    assert "qwen2-vl" in names and len(set(names)) == len(names)
    for module in modules:
        assert module.NAME in mf.models.names() and module.REFERENCE and callable(module.build)


def test_preprocess_quick_reports_every_table() -> None:
    """The preprocessing benchmark on one tiny size: every table has qwen2-vl's figures, and
    its uint8 pixels are a quarter (or less) of the float32 ones on the wire."""
    import importlib.util

    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "preprocess.py"), "--quick", "--only",
         "qwen2-vl", "--sizes", "64x48", "--e2e-images", "2", "--e2e-size", "64x48"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    rows = [line.split() for line in out.splitlines() if line.startswith("qwen2-vl ")]
    timing, pixels, wire, e2e = rows  # one row per table, in this order

    def number(text: str) -> float:
        return float(text.rstrip("x").replace(",", ""))

    has_torchvision = importlib.util.find_spec("torchvision") is not None
    # size, PIL, torchvision, exact, fast ms, then exact/PIL and fast/tv
    assert timing[1] == "64x48"
    pil, tv, exact, fast = timing[2:6]
    assert number(pil) > 0 and number(exact) > 0 and number(fast) > 0, timing
    assert (tv != "-") == has_torchvision, timing
    assert number(timing[6]) == pytest.approx(number(exact) / number(pil), abs=0.01)
    # fast-exact "max / mean" levels; float32 exact is transformers' PIL output bit for bit
    assert number(pixels[2]) >= 0 and pixels[3] == "/" and number(pixels[4]) >= 0, pixels
    assert "yes" in pixels, pixels
    # float32 and uint8 frame bytes and ratio, then the pixel field's
    f32, u8, ratio = (number(v) for v in wire[2:5])
    assert 0 < u8 <= f32 / 4 + 1024 and ratio == pytest.approx(u8 / f32, abs=0.001), wire
    assert 0 < number(wire[7]) <= 0.25, wire
    # float32 exact, float32 fast, uint8 fast ms and the two ratios
    assert all(number(v) > 0 for v in e2e[1:6]), e2e
    assert "NOT CONVERTED" not in out and "ERROR" not in out
    targets = out[out.index("\ntargets\n"):]
    assert "qwen2-vl 64x48 exact <= 0.5x Qwen2VLImageProcessorPil" in targets
    assert "uint8 pixel bytes <= 0.25x float32" in targets
    assert "foreign CPU:" in out
