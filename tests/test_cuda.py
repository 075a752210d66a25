"""The CUDA transfer on a real GPU, with checks that fail when the promise is broken: the
staging block is pinned, a batch of many device fields is exactly one host-to-device memcpy,
a warm transfer never synchronises, a one-block pool never overwrites staging a copy still
reads, and a consumer on another stream sees the data after `wait`. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import mmferry as mf

F = mf.FieldSpec
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _many_fields_batch(seed: int, items: int = 8, fields: int = 6) -> mf.Batch:
    g = torch.Generator().manual_seed(seed)
    outputs = {f"f{k}": torch.randn(items, 16 + k, generator=g) for k in range(fields)}
    outputs["grid"] = torch.randint(1, 9, (items, 3), generator=g)
    specs = {name: F.batched("image") for name in outputs}
    specs["grid"] = F.batched("image", placement="host")
    (batch,) = mf.batch_items(mf.split_items(outputs, specs))
    return batch


def test_staging_is_pinned_and_a_batch_is_one_htod_memcpy_without_sync() -> None:
    transfer = mf.Transfer("cuda", max_staging_blocks=2)
    batch = _many_fields_batch(0)
    transfer.to_device(batch)  # warm the pool and both caching allocators
    torch.cuda.synchronize()
    assert all(b.buffer.is_pinned() for b in transfer._pool._blocks)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.set_sync_debug_mode("error")
        try:
            moved = [transfer.to_device(batch) for _ in range(3)]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    htod = [e for e in prof.events() if "Memcpy HtoD" in e.name]
    assert len(htod) == 3, [e.name for e in prof.events() if "Memcpy" in e.name]
    for m in moved:
        assert m["grid"].device.type == "cpu"
        for k in range(6):
            assert torch.equal(m[f"f{k}"].cpu(), batch.reduced(f"f{k}"))


def test_one_block_pool_never_overwrites_staging_a_copy_still_reads() -> None:
    transfer = mf.Transfer("cuda", max_staging_blocks=1)
    batches = [_many_fields_batch(seed) for seed in range(6)]
    moved = []
    for batch in batches:
        torch.cuda._sleep(20_000_000)  # keep the stream busy so copies are still queued
        moved.append(transfer.to_device(batch))
    torch.cuda.synchronize()
    assert transfer.stats.staging_blocks == 1 and transfer.stats.waits >= 1
    for batch, m in zip(batches, moved, strict=True):
        assert torch.equal(m["f0"].cpu(), batch.reduced("f0"))


def test_a_consumer_on_another_stream_waits_for_the_copy() -> None:
    transfer = mf.Transfer("cuda")
    batch = _many_fields_batch(7)
    side = torch.cuda.Stream()
    torch.cuda._sleep(50_000_000)  # the copy queues behind this on the current stream
    moved = transfer.to_device(batch)
    moved.wait(side)
    with torch.cuda.stream(side):
        got = moved["f3"] * 1
    torch.cuda.synchronize()
    assert torch.equal(got.cpu(), batch.reduced("f3"))


def test_device_resident_values_skip_the_copy_and_merge_on_the_device() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    embeds = [torch.randn(3, 8, device=device), torch.randn(2, 8, device=device)]
    items = [mf.Item("image", {"image_embeds": e}, {"image_embeds": F.flat_from_sizes(
        "image", [e.shape[0]]).for_item()}, hash=f"e{i}") for i, e in enumerate(embeds)]
    (batch,) = mf.batch_items(items)
    transfer = mf.Transfer("cuda")
    moved = transfer.to_device(batch)
    assert transfer.stats.copies == 0 and torch.equal(moved["image_embeds"], torch.cat(embeds))
    inputs = torch.zeros(1, 7, 8, device=device)
    mask = torch.zeros(1, 7, dtype=torch.bool)
    mask[0, 1:6] = True
    mf.merge_embeddings(inputs, mask, embeds)
    assert torch.equal(inputs[0, 1:6], torch.cat(embeds))
    assert mf.transfer.upload(embeds[0], torch.device("cuda")) is embeds[0]
