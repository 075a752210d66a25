"""The placement auditor: rules, example encoders, recommendations, torch state."""

from __future__ import annotations

import io
import json
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import mmferry as mf
from mmferry.audit import (
    KINDS,
    AuditReport,
    Finding,
    audit,
    explain,
    recommend,
    suggest_specs,
)
from mmferry.audit import examples as ex
from mmferry.audit.tracer import _ATTR
from mmferry.errors import ArgumentError

GRID = torch.tensor([[1, 4, 6], [1, 2, 2]])
X = torch.randn(12, 8, generator=torch.Generator().manual_seed(0))


def kinds_of(report: AuditReport) -> list[str]:
    return sorted(f.kind for f in report.findings)


def line(location: str) -> int:
    return int(location.rsplit(":", 1)[1])


def here() -> int:
    return sys._getframe(1).f_lineno


def run_snippet(body, grid="device", x="device") -> list[str]:
    def fn(g, x):
        body(g, x)

    report = audit(fn, {"g": GRID, "x": X}, {"g": grid, "x": x})
    assert report.error is None, report.error
    return kinds_of(report)


# -- the rules, one snippet each ----------------------------------------------------------

SYNCS = {
    "tolist": lambda g, x: g.tolist(),
    "item": lambda g, x: g[0, 0].item(),
    "int": lambda g, x: int(g[0, 0]),
    "float": lambda g, x: float(g[0, 0]),
    "bool": lambda g, x: bool(g.any()),
    "if": lambda g, x: 1 if g.sum() else 0,
    "index": lambda g, x: range(g[0, 1]),
    "cpu": lambda g, x: g.cpu(),
    "to_cpu": lambda g, x: g.to("cpu"),
    "numpy": lambda g, x: g.numpy(),
    "np.asarray": lambda g, x: np.asarray(g),
    "format": lambda g, x: f"{g.sum()}",
    "nonzero": lambda g, x: g.nonzero(),
    "where_1arg": lambda g, x: torch.where(g > 2),
    "unique": lambda g, x: torch.unique(g),
    "equal": lambda g, x: torch.equal(g, g),
    "bool_mask_index": lambda g, x: g[g > 2],
    "bool_mask_assign": lambda g, x: g.__setitem__(g > 2, 0),
    "masked_select": lambda g, x: g.masked_select(g > 2),
    "repeat_interleave": lambda g, x: torch.repeat_interleave(x[:2], g[:, 0], dim=0),
    "split_by_0dim_sizes": lambda g, x: torch.split(x, [g[0, 2] * 2, g[0, 0] * 0]),  # 12 + 0
    "copy_to_host_buffer": lambda g, x: torch.zeros(2, 3, dtype=torch.long).copy_(g),
    "assign_into_host_slice": lambda g, x: torch.zeros(3, 8).__setitem__(slice(0, 2), x[:2]),
}


@pytest.mark.parametrize("name", sorted(SYNCS))
def test_device_value_read_on_host_is_one_sync(name):
    body = SYNCS[name]
    assert run_snippet(body, grid="device") == ["host_sync"]
    if name not in ("copy_to_host_buffer", "assign_into_host_slice"):
        # The same read on the host is free.
        assert run_snippet(body, grid="host", x="host") == []


CLEAN_ON_DEVICE = {
    "metadata": lambda g, x: (g.shape, g.dtype, len(g), g.size(0), g.dim(), g.numel(),
                              g.ndim, g.stride(), g.is_contiguous(), g.device, g.is_cuda),
    "repeat_interleave_output_size": lambda g, x: torch.repeat_interleave(
        x[:2], g[:, 0], dim=0, output_size=2),
    "integer_index": lambda g, x: x[g[:, 0]],
    "arange_on_same_device": lambda g, x: g.prod(-1) + torch.arange(2, device=g.device),
    "device_context": lambda g, x: _in_device_context(g),
    "zero_dim_host_scalar": lambda g, x: x * torch.tensor(2.0),
    "as_tensor_in_place": lambda g, x: torch.as_tensor(g, dtype=torch.int32, device=g.device),
}


def _in_device_context(g):
    with torch.device("cuda"):
        t = torch.zeros(2, dtype=torch.long)
    return g[:, 0] + t


@pytest.mark.parametrize("name", sorted(CLEAN_ON_DEVICE))
def test_no_false_positive_on_device(name):
    assert run_snippet(CLEAN_ON_DEVICE[name], grid="device") == []


HOST_FIELD = {
    # grid on the host, x (activations) on the device
    "elementwise": (lambda g, x: x[:2, :1] * g[:, :1], ["device_mismatch"]),
    "zero_dim_scalar_is_fine": (lambda g, x: x * g[0, 0], []),
    "linear": (lambda g, x: F.linear(g.float(), x[:, :3]), ["device_mismatch"]),
    "cat": (lambda g, x: torch.cat([x[:2, :3], g.float()]), ["device_mismatch"]),
    "host_index_into_device": (lambda g, x: x[g[:, 0]], ["implicit_h2d"]),
    "host_mask_into_device": (lambda g, x: x[:2][g[:, 1] > 2], ["implicit_h2d"]),
    "to_device": (lambda g, x: g.to(x.device), ["implicit_h2d"]),
    "cuda": (lambda g, x: g.cuda(), ["implicit_h2d"]),
    "as_tensor": (lambda g, x: torch.as_tensor(g, device="cuda"), ["implicit_h2d"]),
    "tensor_from_host": (lambda g, x: torch.tensor(g, device="cuda"), ["implicit_h2d"]),
    "copy_into_device": (lambda g, x: torch.empty(2, 3, dtype=torch.long, device="cuda")
                         .copy_(g), ["implicit_h2d"]),
    "non_blocking_pageable": (lambda g, x: g.to("cuda", non_blocking=True),
                              ["pageable_async_copy"]),
    "non_blocking_non_dense_pinned": (lambda g, x: g.pin_memory()[:, 1:].to(
        "cuda", non_blocking=True), ["pageable_async_copy"]),
    "non_blocking_pinned": (lambda g, x: g.pin_memory().to("cuda", non_blocking=True), []),
    "host_math": (lambda g, x: (g.prod(-1).tolist(), int(g[:, 1].max())), []),
    "device_split_points": (lambda g, x: torch.tensor_split(x, g[0]), []),
}


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")
@pytest.mark.parametrize("name", sorted(HOST_FIELD))
def test_host_field_meeting_the_device(name):
    body, expected = HOST_FIELD[name]
    assert run_snippet(body, grid="host") == expected


def test_blocking_uploads_of_python_data_are_implicit_h2d():
    def fn(x):
        torch.tensor([1, 2], device=x.device)
        torch.as_tensor(np.arange(3), device=x.device)
        x.new_tensor([1.0, 2.0])
        torch.arange(3, device=x.device)  # allocation, no copy
        torch.zeros(2, device="cuda")

    report = audit(fn, {"x": X}, {"x": "device"})
    assert kinds_of(report) == ["implicit_h2d"] * 3
    assert {f.op for f in report.findings} == {"torch.tensor", "torch.as_tensor",
                                              "Tensor.new_tensor"}


def test_device_tensor_where_the_host_is_required():
    assert run_snippet(lambda g, x: torch.tensor_split(x, g[0]), grid="device") == [
        "device_mismatch"]
    assert run_snippet(lambda g, x: g.pin_memory(), grid="device") == ["device_mismatch"]
    assert run_snippet(lambda g, x: g[torch.arange(1)].float() @ x[:3], grid="host",
                       x="device") == ["device_mismatch"]


def test_async_copy_races_and_syncs():
    def racy(g):
        staging = g.pin_memory()
        staging.to("cuda", non_blocking=True)
        staging.copy_(torch.zeros_like(staging))  # source rewritten while in flight
        out = g.to("cuda").to("cpu", non_blocking=True)
        return out + 1  # read before a sync

    def synced(g):
        staging = g.pin_memory()
        staging.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        staging.add_(1)
        out = g.to("cuda").to("cpu", non_blocking=True)
        torch.cuda.synchronize()
        return out + 1

    found = audit(racy, {"g": GRID}, {"g": "host"})
    assert [f.kind for f in found.findings] == ["async_copy_race", "implicit_h2d",
                                                "async_copy_race"]
    assert "fix:" in found.findings[0].message and "read" in found.findings[2].message
    assert kinds_of(audit(synced, {"g": GRID}, {"g": "host"})) == ["implicit_h2d"]


def test_memory_recycled_after_a_pinned_source_is_freed_is_not_a_race(monkeypatch) -> None:
    # The simulation hands a freed host block out again at once; on a GPU the caching host
    # allocator waits for the block's copies first, so writing a new tensor there is safe.
    # Every storage made to share one address, so the recycling is certain here.
    from mmferry.audit import tracer

    monkeypatch.setattr(tracer, "_storage", lambda t: 1)

    def recycled(g):
        staging = torch.empty(4096, pin_memory=True)
        on_device = staging.to("cuda", non_blocking=True)
        del staging
        torch.empty(4096, pin_memory=True).fill_(1)
        return on_device

    def kept(g):  # the same, the source still alive: a race
        staging = torch.empty(4096, pin_memory=True)
        on_device = staging.to("cuda", non_blocking=True)
        torch.empty(4096, pin_memory=True).fill_(1)
        return on_device, staging

    assert kinds_of(audit(recycled, {"g": GRID}, {"g": "host"})) == []
    assert kinds_of(audit(kept, {"g": GRID}, {"g": "host"})) == ["async_copy_race"]


def test_any_host_sync_completes_pending_copies():
    def fn(g, x):
        staging = g.pin_memory()
        staging.to("cuda", non_blocking=True)
        x.sum().item()  # the host waits for the stream
        staging.zero_()

    report = audit(fn, {"g": GRID, "x": X}, {"g": "host", "x": "device"})
    assert kinds_of(report) == ["host_sync"]


# -- what a finding says ----------------------------------------------------------------


def test_finding_fields_op_location_and_count():
    def fn(grid, pixels):
        x = pixels * 2
        total = 0
        for i in range(3):
            total += int(grid[i % 2, 1])  # three calls, one site
        first = here() - 1
        y = x + grid.float().sum()
        return total, y, first

    captured = {}

    def wrapper(grid, pixels):
        captured["out"] = fn(grid, pixels)

    report = audit(wrapper, {"grid": GRID, "pixels": X}, {"grid": "device", "pixels": "device"})
    (f,) = report.findings
    assert f == Finding("host_sync", ("grid",), "Tensor.__int__", f.location, f.message, 3)
    assert f.location.endswith(f"test_audit.py:{captured['out'][2]}")
    assert "fix: place 'grid' on the host" in f.message


def test_location_skips_torch_frames():
    layer = nn.Linear(3, 4)

    def fn(g):
        return layer(g.float())  # the mismatch happens inside torch's Linear.forward

    report = audit(fn, {"g": GRID}, {"g": "host"}, module=layer)
    (f,) = report.findings
    assert f.kind == "device_mismatch" and f.fields == ("g",)
    assert line(f.location) == fn.__code__.co_firstlineno + 1


def test_the_run_continues_past_every_finding():
    def fn(g, x):
        a = x[:2, :3] * g  # mismatch
        b = g.tolist()  # fine on the host
        c = (a * 2).tolist()  # a derives from g and x, and is on the device
        return b, c

    report = audit(fn, {"g": GRID, "x": X}, {"g": "host", "x": "device"})
    assert report.error is None
    assert [(f.kind, f.fields) for f in report.findings] == [
        ("device_mismatch", ("g",)), ("host_sync", ("g", "x"))]


def test_values_and_devices_propagate():
    seen = {}

    def fn(g):
        p = g.prod(-1)
        a = torch.arange(3, device=g.device)
        seen.update(p=p.device, a=a.device, vals=p.tolist(), sum=(p + a[:2]).device,
                    is_cuda=p.is_cuda, index=p.get_device())

    audit(fn, {"g": GRID}, {"g": "device"})
    cuda = torch.device("cuda", 0)
    assert seen == {"p": cuda, "a": cuda, "vals": [24, 4], "sum": cuda, "is_cuda": True,
                    "index": 0}
    audit(fn, {"g": GRID}, {"g": "host"})
    cpu = torch.device("cpu")
    assert (seen["p"], seen["a"], seen["sum"], seen["index"]) == (cpu, cpu, cpu, -1)


def test_input_kinds_untracked_both_lists_and_numbers():
    seen = {}

    def fn(grid, frames, scale, extra):
        seen.update(grid=type(grid).__name__, host=grid.host.device.type,
                    dev=grid.device.device.type, frames=[f.device.type for f in frames],
                    scale=scale, extra=extra.device.type)
        extra.tolist()
        frames[1].tolist()

    report = audit(fn, {"grid": GRID, "frames": [X, X[:2]], "scale": 3, "extra": X},
                   {"grid": "both", "frames": mf.FieldSpec.batched("image")})
    assert seen == {"grid": "Mirrored", "host": "cpu", "dev": "cuda", "frames": ["cuda"] * 2,
                    "scale": 3, "extra": "cuda"}
    assert [(f.kind, f.fields) for f in report.findings] == [("host_sync", ()),
                                                             ("host_sync", ("frames",))]
    assert report.placements == {"grid": "both", "frames": "device"}


def test_allow_and_options():
    def fn(g):
        g.tolist()

    report = audit(fn, {"g": GRID}, {"g": "device"}, allow=("host_sync",))
    assert report.findings and report.ok
    assert not audit(fn, {"g": GRID}, {"g": "device"}).ok
    with pytest.raises(ArgumentError, match="unknown finding kind"):
        audit(fn, {"g": GRID}, {"g": "device"}, allow=("syncs",))
    with pytest.raises(ArgumentError, match="accelerator"):
        audit(fn, {"g": GRID}, {"g": "device"}, device="cpu")
    assert audit(fn, {"g": GRID}, {"g": "device"}, device="xpu").device == "xpu:0"


def test_report_table_and_json():
    example = ex.EXAMPLES["qwen2audio"]
    case = example.case("mask_on_host")
    report = audit(example.build(case.variant), example.inputs(), case.specs)
    text = str(report)
    assert text.splitlines()[0].startswith("placement audit (cuda:0,")
    assert "feature_attention_mask (host)" in text and "device_mismatch" in text
    data = json.loads(report.to_json())
    assert data["ok"] is False and data["placements"]["feature_attention_mask"] == "host"
    assert {f["kind"] for f in data["findings"]} == {"device_mismatch"}
    assert all(set(f) == {"kind", "fields", "op", "location", "message", "count"}
               for f in data["findings"])
    assert set(KINDS) == {"device_mismatch", "host_sync", "implicit_h2d",
                          "pageable_async_copy", "async_copy_race"}


# -- the example encoders ---------------------------------------------------------------

CASES = [(name, case) for name, e in ex.EXAMPLES.items() for case in ["correct", *e.wrong]]


@pytest.mark.parametrize(("name", "case_name"), CASES)
def test_examples_find_exactly_the_expected_faults(name, case_name):
    example = ex.EXAMPLES[name]
    case = example.case(case_name)
    report = audit(example.build(case.variant), example.inputs(), case.specs)
    assert report.error is None, report.error
    found = {(f.kind, f.location.rsplit(":", 1)[0].endswith("examples.py"), line(f.location))
             for f in report.findings}
    assert found == {(kind, True, ex.line_of(marker)) for kind, marker in case.expected}
    assert report.ok is (case_name == "correct")


@pytest.mark.parametrize("name", list(ex.EXAMPLES))
def test_recommend_gives_the_correct_placement(name):
    example = ex.EXAMPLES[name]
    wrong = next(iter(example.wrong.values()))
    fn = example.build(example.correct.variant)
    assert recommend(fn, example.inputs(), wrong.specs) == example.recommended


def test_recommend_evidence_and_both():
    example = ex.EXAMPLES["isaac"]
    fn = example.build("shipped")
    evidence = explain(fn, example.inputs(), example.correct.specs)
    grid = evidence["image_grid_thw"]
    assert grid.placement is mf.Placement.BOTH and grid.current is mf.Placement.HOST
    assert {f.kind for f in grid.on_device} == {"host_sync"}
    assert {f.kind for f in grid.on_host} == {"pageable_async_copy", "host_sync"}
    assert "host sync" in grid.reason and "kernel use" in grid.reason


def test_suggest_specs_prints_code_that_builds_the_corrected_specs():
    example = ex.EXAMPLES["qwen2vl"]
    inputs = example.inputs()
    specs = {"pixel_values": mf.FieldSpec.flat_from_sizes("image", [24, 16]),
             "image_grid_thw": mf.FieldSpec.batched("image")}
    out = io.StringIO()
    code = suggest_specs(example.build("default"), inputs, specs, file=out)
    assert out.getvalue().strip() == code
    assert "# image_grid_thw: was 'device'" in code
    namespace = {"mf": mf}
    exec(code, namespace)
    assert namespace["specs"] == {
        "pixel_values": mf.FieldSpec.flat_from_sizes("image", [24, 16], placement="device"),
        "image_grid_thw": mf.FieldSpec.batched("image", placement="host")}


def test_spec_code_round_trips_every_kind():
    from mmferry.audit.placement import spec_code

    specs = [mf.FieldSpec.batched("image"), mf.FieldSpec.shared("image", 3),
             mf.FieldSpec.flat_from_sizes("audio", [2, 3], dim=1),
             mf.FieldSpec.flat("video", [slice(0, 2), slice(2, 5)]),
             mf.FieldSpec.flat("video", [(slice(0, 1), slice(0, 2))], dim=1),
             mf.FieldSpec.flat_from_sizes("image", [1, 2]).for_item()]
    for spec in specs:
        rebuilt = eval(spec_code(spec, mf.Placement.HOST), {"mf": mf})
        assert rebuilt == spec.__class__(**{**_fields(spec), "placement": "host"})


def _fields(spec):
    return {k: getattr(spec, k) for k in ("kind", "modality", "placement", "dim", "slices",
                                          "sizes", "batch_size")}


# -- torch state, scale, custom ops -------------------------------------------------------


def _torch_state():
    return (len(_get_current_function_mode_stack()), len(_get_current_dispatch_mode_stack()),
            torch.is_grad_enabled(), torch.cuda.synchronize, torch.get_default_dtype(),
            torch.get_default_device())


def test_torch_state_is_restored_even_when_fn_raises():
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).eval()
    before = _torch_state()

    def fn(x):
        model(x).tolist()
        raise KeyError("boom")

    report = audit(fn, {"x": X}, {"x": "device"}, module=model)
    assert _torch_state() == before
    assert report.error.startswith("KeyError: 'boom' at ") and not report.ok
    assert kinds_of(report) == ["host_sync"]  # the partial report is kept
    assert all(not hasattr(t, _ATTR) for t in [*model.parameters(), *model.buffers()])
    assert not hasattr(X, _ATTR) and not hasattr(GRID, _ATTR)


def test_tags_from_an_earlier_audit_are_ignored():
    kept = []

    def first(g):
        kept.append(g.prod(-1))

    audit(first, {"g": GRID}, {"g": "device"})
    outside = kept[0]

    def second(x):
        return x[:2, 0] + outside  # a host tensor to this audit

    assert kinds_of(audit(second, {"x": X}, {"x": "device"})) == ["device_mismatch"]


def test_a_model_with_many_layers():
    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU())
                                        for _ in range(128))

        def forward(self, x, sizes, scale):
            for layer in self.layers:
                x = x + layer(x) * scale  # scale on the host: one site, 128 mismatches
            return x.split(sizes.tolist())

    model = Deep().eval()
    limit = sys.getrecursionlimit()
    inputs = {"x": X, "sizes": torch.tensor([5, 7]), "scale": torch.ones(8)}
    ok = audit(model, inputs, {"x": "device", "sizes": "host", "scale": "device"})
    assert ok.ok and ok.ops > 128 * 3, ok
    bad = audit(model, inputs, {"x": "device", "sizes": "host", "scale": "host"})
    assert [(f.kind, f.fields, f.count) for f in bad.findings] == [
        ("device_mismatch", ("scale",), 128)]
    assert sys.getrecursionlimit() == limit
    assert all(not hasattr(p, _ATTR) for p in model.parameters())


def test_custom_op_without_a_cpu_kernel_is_reported_not_raised():
    @torch.library.custom_op("mmferry_audit_test::varlen", mutates_args=(), device_types="cuda")
    def varlen(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        return x.clone()

    def fn(x, cu_seqlens):
        return torch.ops.mmferry_audit_test.varlen(x, cu_seqlens)

    inputs = {"x": X, "cu_seqlens": torch.tensor([0, 5, 12])}
    report = audit(fn, inputs, {"x": "device", "cu_seqlens": "device"})
    assert not report.ok and report.findings == []
    assert "custom op mmferry_audit_test::varlen has no CPU kernel" in report.error
    assert "torch.library.register_kernel('mmferry_audit_test::varlen', 'cpu'" in report.error

    torch.library.register_kernel("mmferry_audit_test::varlen", "cpu", lambda x, cu: x.clone())
    assert audit(fn, inputs, {"x": "device", "cu_seqlens": "device"}).ok
    report = audit(fn, inputs, {"x": "device", "cu_seqlens": "host"})
    assert [(f.kind, f.fields) for f in report.findings] == [("device_mismatch",
                                                              ("cu_seqlens",))]


def test_real_model_audits_clean_when_available():
    from mmferry import models
    from mmferry.audit import audit_model

    reports = audit_model(models.load(models.names()[0]))
    assert reports and all(r.ok for r in reports.values()), reports
