"""Every contract error path: the type, and a message that names the field."""

from __future__ import annotations

import pytest
import torch

import mmferry as mf

F = mf.FieldSpec


def raises_for(field: str, match: str):
    class _Check:
        def __enter__(self):
            self.ctx = pytest.raises(mf.ContractError, match=match)
            self.info = self.ctx.__enter__()
            return self

        def __exit__(self, *exc):
            handled = self.ctx.__exit__(*exc)
            assert self.info.value.field == field
            assert repr(field) in str(self.info.value)
            return handled

    return _Check()


def test_key_without_spec() -> None:
    with raises_for("stray", "no field spec"):
        mf.split_items({"stray": torch.ones(1)}, {})
    assert len(mf.split_items({"stray": torch.ones(1)}, {}, ignore_extra=True)) == 0


def test_missing_key_while_modality_present() -> None:
    specs = {"a": F.batched("image"), "b": F.batched("image")}
    with raises_for("b", "missing"):
        mf.split_items({"a": torch.ones(2, 1)}, specs)


def test_item_counts_disagree() -> None:
    specs = {"a": F.batched("image"), "b": F.flat_from_sizes("image", [1, 1, 1])}
    with raises_for("b", "item counts disagree"):
        mf.split_items({"a": torch.ones(2, 1), "b": torch.ones(3)}, specs)


def test_sizes_do_not_sum_to_dimension() -> None:
    with raises_for("x", "sum to 3 but dimension 0 has 4"):
        mf.split_items({"x": torch.ones(4, 2)}, {"x": F.flat_from_sizes("image", [1, 2])})
    with raises_for("x", "outside dimension 0 of size 4"):
        mf.split_items({"x": torch.ones(4, 2)}, {"x": F.flat("image", [slice(0, 5)])})


def test_dim_out_of_range() -> None:
    with raises_for("x", "dim 2 is out of range"):
        mf.split_items({"x": torch.ones(4, 2)}, {"x": F.flat_from_sizes("image", [4], dim=2)})
    with raises_for("x", "dim=0"):
        mf.split_items({"x": [1, 2]}, {"x": F.flat_from_sizes("image", [2], dim=1)})


def test_none_data_reaching_a_batch() -> None:
    item = mf.Item("image", {"x": None, "y": torch.ones(1)},
                   {"x": F.batched("image"), "y": F.batched("image")})
    with raises_for("x", "no data"):
        mf.batch_items([item])


def test_mixed_dtypes() -> None:
    spec = F.batched("image")
    items = [mf.Item("image", {"x": torch.ones(1, dtype=d)}, {"x": spec})
             for d in (torch.float32, torch.float16)]
    with raises_for("x", "mixed dtypes"):
        mf.batch_items(items)


def test_batched_scalar_and_wrong_type() -> None:
    with raises_for("x", "at least one dimension"):
        mf.split_items({"x": torch.tensor(1.0)}, {"x": F.batched("image")})
    with raises_for("x", "expected a tensor or a list"):
        mf.split_items({"x": 3}, {"x": F.batched("image")})


def test_spec_construction_errors() -> None:
    with pytest.raises(mf.ContractError, match="unknown placement"):
        F.batched("image", placement="gpu")
    with pytest.raises(mf.ContractError, match="contradicts"):
        F.batched("image", placement="both", keep_on_cpu=True)
    with pytest.raises(mf.ContractError, match="non-negative"):
        F.flat_from_sizes("image", [1, -1])
    with pytest.raises(mf.ContractError, match="integers"):
        F.flat_from_sizes("image", torch.ones(2))
    with pytest.raises(mf.ContractError, match="modality"):
        F.batched("")
    with pytest.raises(mf.ContractError, match="kind"):
        F("stacked", "image")


def test_spec_is_immutable_comparable_hashable_serialisable() -> None:
    spec = F.flat_from_sizes("image", torch.tensor([2, 3]), dim=1, keep_on_cpu=True)
    assert spec == F.flat_from_sizes("image", [2, 3], dim=1, placement="host")
    assert hash(spec) == hash(F.flat_from_sizes("image", [2, 3], dim=1, placement=mf.Placement.HOST))
    assert F.from_dict(spec.to_dict()) == spec
    flat = F.flat("image", [slice(0, 2), (slice(None), slice(1, 3))], dim=0)
    assert F.from_dict(flat.to_dict()) == flat
    assert {spec, spec.for_item()} == {spec, F("flat", "image", "host", 1)}
    with pytest.raises(AttributeError):
        spec.placement = mf.Placement.DEVICE  # type: ignore[misc]
    assert mf.Placement("host") == "host" and str(mf.Placement.BOTH) == "both"


def test_specs_validate_their_split_plan() -> None:
    with pytest.raises(mf.ContractError, match="cannot cut along dim 1"):
        F.flat("audio", [(slice(0, 2),), (slice(2, 4),)], dim=1)
    with pytest.raises(mf.ContractError, match="non-negative ints"):
        F.from_dict({"kind": "flat", "modality": "a", "sizes": [-3, 1]})
    with pytest.raises(mf.ContractError, match="slices must be"):
        F.from_dict({"kind": "flat", "modality": "a", "slices": [[[0, 1.5, None]]]})
