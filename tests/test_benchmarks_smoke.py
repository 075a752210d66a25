"""The data path benchmark runs end to end in its quick mode, without a peer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
