"""`mmferry audit`, the pytest plugin, and the GPU cross-check's CPU-only path."""

from __future__ import annotations

import importlib.metadata
import io
import json
import runpy
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from mmferry.audit import audit
from mmferry.audit import examples as ex
from mmferry.cli import main

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_example_correct_case_passes():
    result = run("audit", "--example", "qwen2vl")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("== qwen2vl:correct\nplacement audit (cuda:0,")
    assert ": ok, 0 findings" in result.output


def test_wrong_case_fails_with_a_table_grouped_by_field():
    result = run("audit", "--example", "qwen2vl:grid_on_device", "--example", "minicpmv")
    assert result.exit_code == 1
    text = result.output
    assert "image_grid_thw (device)" in text and text.count("host_sync") == 4
    assert f"examples.py:{ex.line_of('qwen2vl.grid')}" in text
    assert "== minicpmv:correct" in text


def test_allow_makes_the_exit_code_zero():
    result = run("audit", "--example", "qwen2vl:grid_on_device", "--allow", "host_sync")
    assert result.exit_code == 0, result.output
    assert "(allowed)" in result.output


def test_json_output():
    result = run("audit", "--example", "isaac:shipped", "--json")
    assert result.exit_code == 1
    data = json.loads(result.output)
    assert data["ok"] is False
    (report,) = data["reports"]
    assert report["target"] == "isaac:shipped"
    assert {f["kind"] for f in report["findings"]} == {"pageable_async_copy", "host_sync"}
    assert all(f["fields"] == ["image_grid_thw"] for f in report["findings"])


@pytest.mark.parametrize(("args", "message"), [
    ((), "nothing to audit"),
    (("--example", "nope"), "unknown example 'nope'"),
    (("--example", "qwen2vl:nope"), "has no case 'nope'"),
    (("--allow", "syncs", "--example", "qwen2vl"), "'syncs' is not one of"),
    (("--device", "cpu", "--example", "qwen2vl"), "must be an accelerator"),
    (("no-such-model",), "unknown model 'no-such-model'"),
])
def test_bad_arguments_are_usage_errors(args, message):
    result = CliRunner().invoke(main, ["audit", *args])
    assert result.exit_code == 2
    assert message in result.output


def test_list_names_models_and_examples():
    result = run("audit", "--list")
    assert result.exit_code == 0
    assert all(name in result.output for name in ex.names())
    assert "grid_on_device" in result.output


def test_built_in_models_audit_clean():
    result = run("audit", "--all")
    assert result.exit_code == 0, result.output
    assert "ok, 0 findings" in result.output


# -- pytest plugin ------------------------------------------------------------------------


def test_plugin_is_registered_and_light():
    (entry,) = [e for e in importlib.metadata.entry_points(group="pytest11")
                if e.value == "mmferry.audit.pytest_plugin"]
    source = (ROOT / "src/mmferry/audit/pytest_plugin.py").read_text()
    assert "\nimport torch" not in source and "\nfrom mmferry" not in source
    assert entry.load().placement_audit is not None


def test_placement_audit_fixture(pytester):
    pytester.makepyfile(
        """
        import torch
        from mmferry.audit.examples import EXAMPLES

        def test_clean(placement_audit):
            example = EXAMPLES["minicpmv"]
            report = placement_audit(example.build("default"), example.inputs(),
                                     example.correct.specs)
            assert report.ok

        def test_sync(placement_audit):
            def fn(grid):
                return grid.tolist()
            placement_audit(fn, {"grid": torch.tensor([1, 2])}, {"grid": "device"})

        def test_sync_allowed(placement_audit):
            def fn(grid):
                return grid.tolist()
            placement_audit(fn, {"grid": torch.tensor([1, 2])}, {"grid": "device"},
                            allow=["host_sync"])
        """
    )
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*placement audit of *fn failed:*", "grid (device)",
                                 "*host_sync*Tensor.tolist*"])


# -- GPU cross-check, CPU-only path --------------------------------------------------------


def _crosscheck():
    return runpy.run_path(str(ROOT / "benchmarks/gpu_crosscheck.py"), run_name="crosscheck")


@pytest.mark.skipif(torch.cuda.is_available(), reason="exercises the CPU-only skip")
def test_gpu_crosscheck_skips_without_cuda():
    out = io.StringIO()
    with redirect_stdout(out):
        assert _crosscheck()["main"]([]) == 0
    assert "skipped, no CUDA device" in out.getvalue()


def test_gpu_crosscheck_prediction_and_comparison():
    module = _crosscheck()
    example = ex.EXAMPLES["isaac"]
    case = example.case("shipped")
    pred = module["predicted"](audit(example.build(case.variant), example.inputs(), case.specs))
    assert pred == {"sync": sorted(f"examples.py:{ex.line_of(m)}"
                                   for m in ("isaac.hw", "isaac.bounds")),
                    "mismatch": [], "race": [], "pageable": 1}
    compare = module["compare"]
    same = {"sync": pred["sync"], "mismatch": None, "pageable": 2}
    assert compare(pred, same) == []
    assert compare(pred, {**same, "sync": pred["sync"][:1]}) == [
        f"predicted syncs the GPU did not report: {pred['sync'][1:]}"]
    mismatch = {"sync": [], "mismatch": ["examples.py:7"], "race": [], "pageable": 0}
    assert compare(mismatch, {"sync": [], "mismatch": "examples.py:7", "pageable": 0}) == []
    assert compare(mismatch, {"sync": [], "mismatch": None, "pageable": 0})
