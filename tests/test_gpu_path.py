"""The CUDA path's edges, shown on the CPU (issue 13): inputs already on the device, values on
the wrong device, tensors that require grad, a consumer on another stream, the placeholder
merge, and upload(). `meta` stands in for the accelerator; fakes for streams and events."""

from __future__ import annotations

import pytest
import torch

import mmferry as mf
from mmferry.transfer import DeviceBatch, upload

F = mf.FieldSpec


def _batch(values: list[torch.Tensor], spec: F, extra: dict | None = None) -> mf.Batch:
    items = [mf.Item("image", {"x": v, **(extra or {})},
                     {"x": spec.for_item(), **{k: F.batched("image", placement="host")
                                               for k in (extra or {})}}, hash=f"h{i}")
             for i, v in enumerate(values)]
    (batch,) = mf.batch_items(items)
    return batch


@pytest.mark.parametrize("spec", [F.flat_from_sizes("image", [2, 3]), F.batched("image"),
                                  F.shared("image", 2)], ids=["flat", "batched", "shared"])
def test_device_values_already_on_the_target_are_reduced_there(spec: F) -> None:
    values = [torch.empty(2, 4, device="meta"), torch.empty(3 if spec.kind == "flat" else 2, 4,
                                                            device="meta")]
    if spec.kind == "shared":
        values = [values[0], values[0]]
    batch = _batch(values, spec)
    moved = mf.Transfer("meta").to_device(batch)
    assert moved["x"].device.type == "meta"
    want = {"flat": (5, 4), "batched": (2, 2, 4), "shared": (2, 4)}[spec.kind]
    assert tuple(moved["x"].shape) == want
    assert moved.nbytes == 0  # nothing staged: the values never left the device


def test_ragged_device_values_stay_a_list_on_the_device() -> None:
    batch = _batch([torch.empty(2, 4, device="meta"), torch.empty(3, 4, device="meta")],
                   F.batched("image"))
    moved = mf.Transfer("meta").to_device(batch)
    assert [t.device.type for t in moved["x"]] == ["meta", "meta"]


def test_values_on_another_device_are_a_contract_error() -> None:
    batch = _batch([torch.empty(2, 4, device="meta"), torch.empty(2, 4, device="meta")],
                   F.batched("image"))
    with pytest.raises(mf.ContractError, match="on meta") as e:
        mf.Transfer("cpu").to_device(batch)
    assert e.value.field == "x"
    grid = torch.empty(3, dtype=torch.int64, device="meta")
    for placement in ("both", "host"):
        batch = _batch([torch.zeros(2, 4), torch.zeros(2, 4)], F.batched("image"),
                       extra={"grid": grid})
        specs = {**batch.specs, "grid": F.batched("image", placement=placement)}
        items = [mf.Item("image", dict(it), specs, hash=it.hash) for it in batch.items]
        with pytest.raises(mf.ContractError, match=f"a {placement} field on meta") as e:
            mf.Transfer("meta").to_device(mf.batch_items(items)[0])
        assert e.value.field == "grid"


def test_hashing_a_device_tensor_is_refused_not_a_hidden_sync() -> None:
    item = mf.Item("image", {"x": torch.empty(2, device="meta")}, {"x": F.batched("image")})
    with pytest.raises(mf.ContractError, match="cannot hash a tensor on meta"):
        _ = item.hash
    given = mf.Item("image", {"x": torch.empty(2, device="meta")}, {"x": F.batched("image")},
                    hash="explicit")
    assert given.hash == "explicit"


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_tensors_that_require_grad_are_packed(device: str) -> None:
    values = [torch.randn(2, 3, requires_grad=True), torch.randn(2, 3, requires_grad=True)]
    batch = _batch(values, F.flat_from_sizes("image", [2, 2]))
    moved = mf.Transfer(device).to_device(batch)
    assert moved["x"].shape == (4, 3) and not moved["x"].requires_grad
    if device == "cpu":
        assert torch.equal(moved["x"], torch.cat(values).detach())


class _FakeStream:
    def __init__(self) -> None:
        self.waited: list[object] = []

    def wait_event(self, event: object) -> None:
        self.waited.append(event)


class _FakeBlock:
    def __init__(self) -> None:
        self.recorded: list[object] = []
        self.device = torch.device("cpu")

    def record_stream(self, stream: object) -> None:
        self.recorded.append(stream)


def test_wait_orders_another_stream_after_the_copy_and_keeps_the_block_alive() -> None:
    batch = _batch([torch.zeros(2, 4), torch.zeros(2, 4)], F.batched("image"))
    event, block, stream = object(), _FakeBlock(), _FakeStream()
    moved = DeviceBatch(batch, {}, event, 256, block)  # type: ignore[arg-type]
    moved.wait(stream)
    assert stream.waited == [event] and block.recorded == [stream]
    # Without a copy (cpu, meta) there is nothing to wait for.
    mf.Transfer("cpu").to_device(batch).wait(stream)
    assert stream.waited == [event]


def test_merge_takes_a_host_mask_counts_there_and_refuses_a_device_mask() -> None:
    embeds = torch.zeros(2, 5, 3)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[0, 3:5] = True
    mask[1, 0] = True
    rows = torch.arange(9, dtype=torch.float32).view(3, 3)
    mf.merge_embeddings(embeds, mask, rows)
    assert torch.equal(embeds[mask], rows) and embeds[~mask].abs().sum() == 0
    for n in (2, 4):  # fewer rows would drop, more would assert on a GPU: both refused
        with pytest.raises(mf.ContractError, match=f"3 placeholder tokens but {n}"):
            mf.merge_embeddings(torch.zeros(2, 5, 3), mask, torch.ones(n, 3))
    with pytest.raises(mf.ContractError, match="host tensor"):
        mf.merge_embeddings(torch.zeros(2, 5, 3, device="meta"), mask.to("meta"),
                            torch.ones(3, 3, device="meta"))
    # A non-contiguous destination is written in place too.
    wide = torch.zeros(5, 2, 3).transpose(0, 1)
    mf.merge_embeddings(wide, mask, rows)
    assert torch.equal(wide[mask], rows)


def test_upload_passes_values_on_the_device_and_densifies_host_sources() -> None:
    t = torch.arange(12).view(3, 4)
    assert upload(t, torch.device("cpu")) is t
    on_meta = torch.empty(3, device="meta")
    assert upload(on_meta, "meta") is on_meta


def test_upload_of_a_non_dense_slice_audits_as_one_async_copy() -> None:
    grid = torch.tensor([[1, 4, 6], [1, 8, 8]])

    def fn(w: torch.Tensor) -> torch.Tensor:
        return upload(grid[:, 1:3], w.device).sum() + w.sum()

    report = mf.audit.audit(fn, {"w": torch.ones(2)}, {})
    assert report.ok and not report.findings, report
