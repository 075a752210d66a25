"""What every registered model owes the runtime, checked for each name in the registry: a
new model gets these tests by adding its one registry line."""

from __future__ import annotations

import pytest
import torch

import mmferry as mf
from mmferry.encoder.model import EncoderModel

NAMES = mf.models.names()


@pytest.fixture(scope="module", params=NAMES)
def model(request: pytest.FixtureRequest) -> EncoderModel:
    return mf.models.load(request.param)


def test_declares_the_whole_protocol(model: EncoderModel) -> None:
    assert isinstance(model, EncoderModel)
    cls = mf.models.model_class(model.name)
    assert model.name in NAMES and type(model) is cls
    assert model.modalities and all(m in ("image", "video", "audio") for m in model.modalities)
    assert isinstance(model.precomputed_fields, frozenset)
    assert model.checkpoint_prefixes and all(
        isinstance(k, str) and isinstance(v, str | None)
        for k, v in model.checkpoint_prefixes.items())
    assert not model.training and not any(p.requires_grad for p in model.parameters())


def test_tiny_weights_are_seeded(model: EncoderModel) -> None:
    again = mf.models.load(model.name).state_dict()
    state = model.state_dict()
    assert state.keys() == again.keys()
    assert all(torch.equal(state[k], again[k]) for k in state)


def test_dummy_inputs_cover_every_modality_with_several_items(model: EncoderModel) -> None:
    outputs = model.dummy_inputs()
    items = mf.split_items(outputs, model.field_specs(outputs))
    assert set(items) == set(model.modalities)
    assert all(len(items[m]) >= 2 for m in items)


def test_encode_gives_the_host_counted_rows_batched_or_alone(model: EncoderModel) -> None:
    outputs = model.dummy_inputs()
    seq = mf.split_items(outputs, model.field_specs(outputs)).in_order()
    runner = mf.EncoderRunner(model, device="cpu")
    together = runner.encode(seq)
    for item, out in zip(seq, together, strict=True):
        assert out.shape == (model.tokens_per_item(item), model.hidden_size)
        assert torch.isfinite(out).all()
        alone = mf.EncoderRunner(model, device="cpu").encode([item])[0]
        # Batching must not change an item's embedding beyond float rounding.
        torch.testing.assert_close(alone, out, atol=1e-5, rtol=1e-4)


def test_contract_audits_clean(model: EncoderModel) -> None:
    reports = mf.audit.audit_model(model)
    assert reports and all(r.ok and not r.findings for r in reports.values()), reports


def test_render_side_needs_no_weights(model: EncoderModel) -> None:
    bare = mf.models.load(model.name, materialize=False)
    outputs = bare.dummy_inputs()
    items = mf.split_items(outputs, bare.field_specs(outputs)).in_order()
    assert [bare.tokens_per_item(i) for i in items] == [model.tokens_per_item(i) for i in items]
    assert all(p.is_meta for p in bare.parameters())
