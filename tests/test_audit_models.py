"""Placement audit of the built-in models: their contracts audit clean, and the known wrong
placements are caught (issue: Qwen2-VL with its grid on the device syncs)."""

from __future__ import annotations

import mmferry as mf
from mmferry.cli import main


def qwen2_vl_batch():
    model = mf.models.load("qwen2-vl")
    outputs = model.dummy_inputs()
    batch = mf.batch_items(mf.split_items(outputs, model.field_specs(outputs)))[0]
    assert batch.modality == "image"
    return model, batch


def test_qwen2_vl_contract_audits_clean() -> None:
    model, batch = qwen2_vl_batch()
    report = mf.audit.audit(model.encode, batch.data, batch.specs)
    assert report.ok and report.findings == [], report


def test_qwen2_vl_grid_on_device_reports_host_syncs() -> None:
    model, batch = qwen2_vl_batch()
    wrong = {**batch.specs, "image_grid_thw": mf.FieldSpec.batched("image")}
    report = mf.audit.audit(model.encode, batch.data, wrong)
    assert not report.ok
    assert {f.kind for f in report.findings} == {"host_sync"}
    assert all(f.fields == ("image_grid_thw",) for f in report.findings)
    assert all("qwen2_vl.py" in f.location for f in report.findings)
    assert mf.audit.recommend(model.encode, batch.data, wrong) == {
        "pixel_values": mf.Placement.DEVICE, "image_grid_thw": mf.Placement.HOST}


def test_audit_cli_gates_on_the_real_model() -> None:
    from click.testing import CliRunner

    result = CliRunner().invoke(main, ["audit", "qwen2-vl", "--json"])
    assert result.exit_code == 0, result.output
    assert '"ok": true' in result.output
    assert CliRunner().invoke(main, ["audit", "nope"]).exit_code == 2
