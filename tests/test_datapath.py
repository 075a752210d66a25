"""Property tests of the whole host path: split -> wire -> batch -> transfer."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mmferry as mf
from mmferry.items import values_equal

F = mf.FieldSpec
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8,
          torch.bool]
PLACEMENTS = ["device", "host", "both"]


def _tensor(draw: Any, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


@st.composite
def processor_output(draw: Any) -> tuple[dict[str, Any], dict[str, mf.FieldSpec], int]:
    """One modality's processor output with 1-3 fields of random kinds and n items."""
    n = draw(st.integers(0, 4))
    outputs: dict[str, Any] = {}
    specs: dict[str, mf.FieldSpec] = {}
    for k in range(draw(st.integers(1, 3))):
        name = f"f{k}"
        kind = draw(st.sampled_from(["batched", "batched_list", "flat", "shared"]))
        dtype = draw(st.sampled_from(DTYPES))
        placement = draw(st.sampled_from(PLACEMENTS))
        if kind == "batched":
            tail = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
            outputs[name] = _tensor(draw, (n, *tail), dtype)
            specs[name] = F.batched("m", placement=placement)
        elif kind == "batched_list":
            outputs[name] = [_tensor(draw, (draw(st.integers(0, 3)), 2), dtype) for _ in range(n)]
            specs[name] = F.batched("m", placement=placement)
        elif kind == "flat":
            dim = draw(st.integers(0, 1))
            sizes = [draw(st.integers(0, 3)) for _ in range(n)]
            shape = [2, 2]
            shape[dim] = sum(sizes)
            outputs[name] = _tensor(draw, tuple(shape), dtype)
            specs[name] = F.flat_from_sizes("m", sizes, dim=dim, placement=placement)
        else:
            outputs[name] = _tensor(draw, (3,), dtype)
            specs[name] = F.shared("m", n, placement=placement)
    return outputs, specs, n


def _on(value: Any, device: str) -> bool:
    if isinstance(value, torch.Tensor):
        return value.device.type == device
    if isinstance(value, list):
        return all(_on(v, device) for v in value)
    return True


def _like(a: Any, b: Any) -> bool:
    """Same structure, shapes and dtypes (meta tensors have no values)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_like, a, b))
    return a == b


def _expected(value: Any) -> Any:
    """The batch value of one whole request's field: the processor output itself, except that
    a list of equally shaped tensors is stacked (vLLM's batched semantics)."""
    if isinstance(value, list) and value and len({v.shape for v in value}) == 1:
        return torch.stack(value)
    return value


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(processor_output())
def test_split_wire_batch_transfer_reproduces_the_processor_output(case: Any) -> None:
    outputs, specs, n = case
    items = mf.split_items(outputs, specs)
    assert items.num_items == n
    received = mf.wire.decode(mf.wire.encode(items))
    assert received == items
    batches = mf.batch_items(received)
    if n == 0:
        assert batches == []
        return
    (batch,) = batches  # one request, one modality, equal shared values: one batch
    for device in ("cpu", "meta"):
        moved = mf.Transfer(device).to_device(batch)
        for name, spec in specs.items():
            value = moved[name]
            if spec.placement is mf.Placement.BOTH:
                assert isinstance(value, mf.Mirrored)
                host, dev = value.host, value.device
            elif spec.placement is mf.Placement.HOST:
                host, dev = value, None
            else:
                host, dev = None, value
            expected = _expected(outputs[name])
            if host is not None:
                assert _on(host, "cpu") and values_equal(host, expected)
            if dev is not None:
                assert _on(dev, device)
                if device == "cpu":
                    assert values_equal(dev, expected)
                else:
                    assert _like(expected, dev)


def test_transfer_packs_device_fields_into_one_block() -> None:
    grid = torch.tensor([[1, 2, 2], [1, 4, 4]])
    outputs = {"pixel_values": torch.randn(20, 6), "image_grid_thw": grid,
               "mask": torch.ones(2, 5, dtype=torch.bool)}
    specs = {"pixel_values": F.flat_from_sizes("image", grid.prod(-1)),
             "image_grid_thw": F.batched("image", placement="host"),
             "mask": F.batched("image", placement="both")}
    (batch,) = mf.batch_items(mf.split_items(outputs, specs))
    moved = mf.Transfer("cpu").to_device(batch)
    pv, mask = moved["pixel_values"], moved["mask"].device
    assert pv.untyped_storage().data_ptr() == mask.untyped_storage().data_ptr()
    base = pv.untyped_storage().data_ptr()
    assert (pv.data_ptr() - base) % 256 == 0 and (mask.data_ptr() - base) % 256 == 0
    assert moved["image_grid_thw"] is batch.data["image_grid_thw"]  # host: untouched
    assert moved["mask"].host.untyped_storage().data_ptr() != mask.untyped_storage().data_ptr()
    assert moved.ready() and moved.nbytes >= pv.nbytes + mask.nbytes


class FakeEvent:
    """A copy that completes only when waited for (or when marked done)."""

    def __init__(self) -> None:
        self.done = False
        self.waited = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True


def test_staging_block_recycled_only_after_its_copy_completed() -> None:
    stats = mf.transfer.TransferStats()
    pool = mf.transfer.StagingPool(2, pin_memory=False, stats=stats)
    a = pool.acquire(1000)
    assert pool.in_use() == 1
    ea = FakeEvent()
    pool.release(a, ea)
    assert pool.in_use() == 1  # released, but its copy is still in flight
    b = pool.acquire(1000)  # a's copy is in flight: a new block
    assert b.buffer.data_ptr() != a.buffer.data_ptr()
    eb = FakeEvent()
    pool.release(b, eb)
    ea.done = True
    assert pool.in_use() == 1
    c = pool.acquire(1000)  # a completed: reused
    assert c.buffer.data_ptr() == a.buffer.data_ptr() and stats.waits == 0
    pool.release(c, FakeEvent())
    d = pool.acquire(1000)  # both in flight, pool full: waits for the oldest (b)
    assert d.buffer.data_ptr() == b.buffer.data_ptr() and eb.waited == 1 and stats.waits == 1
    assert stats.staging_blocks == 2 and pool.in_use() == 2
    pool.release(d, None)
    big = pool.acquire(1 << 20)  # d's block is free but small: replaced without waiting
    assert big.buffer.numel() >= 1 << 20 and stats.staging_blocks == 2 and stats.waits == 1
    pool.release(big, FakeEvent())
    # Both blocks in flight again: the next caller waits for the oldest, never allocates.
    pool.acquire(10)
    assert stats.waits == 2 and stats.staging_blocks == 2


def test_transfer_stats_count_blocks_in_flight() -> None:
    grid = torch.tensor([[1, 2, 2]])
    items = mf.split_items({"x": torch.ones(4, 3), "g": grid},
                           {"x": F.flat_from_sizes("image", [4]), "g": F.batched("image", placement="host")})
    (batch,) = mf.batch_items(items)
    transfer = mf.Transfer("meta", max_staging_blocks=1)
    for _ in range(3):
        transfer.to_device(batch)
    stats = transfer.stats
    assert (stats.batches, stats.copies, stats.staging_blocks, stats.staging_in_use) == (3, 3, 1, 0)
    assert stats.bytes == 3 * 256


def test_transfer_rejects_unsupported_device() -> None:
    with pytest.raises(mf.ArgumentError, match="device"):
        mf.Transfer("xpu")
    if not torch.cuda.is_available():
        with pytest.raises(mf.ArgumentError, match="CUDA is not available"):
            mf.Transfer("cuda")
