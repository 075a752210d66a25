"""Encoder runtime: runner, cache, scatter and merge, on a small deterministic encoder."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

import mmferry as mf

F = mf.FieldSpec


class PatchEncoder(torch.nn.Module):
    """Each item is a run of patches; every `merge` patches become one output row.

    Elementwise on purpose: a matmul's rounding may depend on the batch's row count, and these
    tests compare batched against per-item outputs exactly."""

    name = "patch-encoder"
    modalities = ("image",)
    hidden_size = 8
    precomputed_fields: ClassVar[frozenset[str]] = frozenset()
    checkpoint_prefixes: ClassVar[dict[str, str]] = {}

    def __init__(self, merge: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(4 * merge))
        self.bias = torch.nn.Parameter(torch.randn(4 * merge))
        self.merge = merge
        self.calls: list[int] = []

    def check_item(self, item) -> None:
        pass

    def tokens_per_item(self, item) -> int:
        return int(item["sizes"]) // self.merge

    def encode(self, pixels: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        self.calls.append(len(sizes))
        return pixels.reshape(-1, 4 * self.merge) * self.weight + self.bias


def images(sizes: list[int], seed: int = 0) -> list[mf.Item]:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(sum(sizes), 4, generator=g)
    specs = {"pixels": F.flat_from_sizes("image", sizes),
             "sizes": F.batched("image", placement="host")}
    return mf.split_items({"pixels": pixels, "sizes": torch.tensor(sizes)}, specs)["image"]


def test_outputs_equal_per_item_encoding_exactly() -> None:
    model = PatchEncoder()
    items = images([4, 2, 6])
    batched = mf.EncoderRunner(model).encode(items)
    for item, out in zip(items, batched, strict=True):
        alone = mf.EncoderRunner(PatchEncoder()).encode([item])[0]
        assert torch.equal(out, alone)
    assert model.calls == [3]


def test_cache_hits_skip_the_encoder() -> None:
    model = PatchEncoder()
    runner = mf.EncoderRunner(model, mf.EncoderCache(max_tokens=100))
    items = images([4, 2])
    first = runner.encode(items, request="r1")
    second = runner.encode(items, request="r2")
    assert model.calls == [2]
    assert runner.last.status == ["hit", "hit"] and runner.cache.stats.hits == 2
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_mixed_requests_encode_each_unique_item_once() -> None:
    model = PatchEncoder()
    a, b = images([4, 2])
    c = images([6], seed=1)[0]
    runner = mf.EncoderRunner(model)
    outs = runner.encode([a, c, a, b, c])
    assert sum(model.calls) == 3
    assert runner.last.status == ["miss", "miss", "repeat", "miss", "repeat"]
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[4])


def test_step_budget_splits_batches() -> None:
    model = PatchEncoder()
    runner = mf.EncoderRunner(model, max_tokens_per_step=3)
    runner.encode(images([4, 2, 2, 6]))  # tokens 2, 1, 1, 3
    assert model.calls == [2, 1, 1]
    # An item no step can hold fails alone; the call still encodes the others.
    outs = runner.encode(images([8, 2], seed=3))
    assert outs[0] is None and outs[1] is not None
    assert runner.last.status == ["error", "miss"]
    assert isinstance(runner.last.errors[0], mf.EncoderCacheError)
    assert "max_tokens_per_step" in str(runner.last.errors[0])


def test_eviction_under_pressure_keeps_referenced_items() -> None:
    model = PatchEncoder()
    runner = mf.EncoderRunner(model, mf.EncoderCache(max_tokens=6))
    held = images([4], seed=1)  # 2 tokens, referenced by r-held throughout
    runner.encode(held, request="r-held")
    for seed in range(2, 6):
        runner.encode(images([4], seed=seed), request=f"r{seed}")
        runner.release(f"r{seed}")
    assert runner.cache_key(held[0]) in runner.cache
    assert runner.cache.stats.evictions >= 2
    assert runner.cache.stats.tokens <= 6
    runner.encode(held, request="again")
    assert runner.last.status == ["hit"]


def test_item_larger_than_cache_is_refused() -> None:
    runner = mf.EncoderRunner(PatchEncoder(), mf.EncoderCache(max_tokens=2))
    (out,) = runner.encode(images([8]))
    assert out is None and runner.last.status == ["error"]
    assert isinstance(runner.last.errors[0], mf.EncoderCacheError)
    assert "more than the cache" in str(runner.last.errors[0])


def test_token_count_mismatch_names_model_and_items() -> None:
    class Wrong(PatchEncoder):
        def tokens_per_item(self, item) -> int:
            return int(item["sizes"])

    runner = mf.EncoderRunner(Wrong())
    # The batch's mismatch is retried item by item: each item fails alone, named.
    assert runner.encode(images([4, 2])) == [None, None]
    assert runner.last.status == ["error", "error"] and len(runner.cache) == 0
    for i, rows, want in ((0, 2, 4), (1, 1, 2)):
        error = runner.last.errors[i]
        assert isinstance(error, mf.ContractError) and f"item {i}" in str(error)
        assert f"model patch-encoder returned {rows} rows" in str(error)
        assert f"sum to {want}" in str(error)


def test_runner_receives_fields_where_their_placement_says() -> None:
    seen = {}

    class Probe(PatchEncoder):
        def encode(self, pixels, sizes):
            seen.update(pixels=pixels.device.type, sizes=sizes.device.type)
            return torch.zeros(int(sizes.sum()) // 2, self.hidden_size, device=pixels.device)

    mf.EncoderRunner(Probe(), device="meta").encode(images([4, 2]))
    assert seen == {"pixels": "meta", "sizes": "cpu"}


def test_scatter_output_slices_views_and_clones() -> None:
    output = torch.arange(12.0).reshape(6, 2)
    dest: dict[str, torch.Tensor] = {}
    mf.scatter_output_slices(output, ["a", "b"], [2, 4], dest)
    assert torch.equal(dest["b"], output[2:]) and dest["b"].data_ptr() == output[2:].data_ptr()
    cloned: list = [None, None]
    mf.scatter_output_slices(output, [1, 0], [2, 4], cloned, clone=True)
    assert torch.equal(cloned[1], output[:2]) and cloned[1].data_ptr() != output.data_ptr()
    with pytest.raises(ValueError, match="6 rows"):
        mf.scatter_output_slices(output, ["a"], [5], dest)


def test_merge_embeddings_places_rows_and_rejects_count_mismatch() -> None:
    embeds = torch.zeros(2, 5, 3)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[0, 1:3] = True
    mask[1, 4] = True
    rows = [torch.ones(2, 3), torch.full((1, 3), 2.0)]
    out = mf.merge_embeddings(embeds, mask, rows)
    assert out is embeds
    assert torch.equal(out[0, 1:3], torch.ones(2, 3)) and torch.equal(out[1, 4], torch.full((3,), 2.0))
    assert out[0, 0].abs().sum() == 0
    with pytest.raises(mf.ContractError, match="3 placeholder tokens but 2"):
        mf.merge_embeddings(torch.zeros(2, 5, 3), mask, torch.ones(2, 3))
    with pytest.raises(mf.ContractError, match="hidden size"):
        mf.merge_embeddings(torch.zeros(2, 5, 3), mask, torch.ones(3, 4))


def test_qwen2_vl_end_to_end_with_cache_merge_and_precomputed_embeds() -> None:
    from PIL import Image

    model = mf.models.load("qwen2-vl")
    rng = torch.Generator().manual_seed(0)
    pics = [Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=rng, dtype=torch.uint8).numpy())
            for h, w in [(56, 84), (112, 56)]]
    outputs = model.processor(images=pics)
    items = mf.split_items(outputs, model.field_specs(outputs))["image"]
    runner = mf.EncoderRunner(model, mf.EncoderCache(max_tokens=1000))
    embeds = runner.encode(items, request="r1")
    assert [e.shape for e in embeds] == [(model.tokens_per_item(it), model.hidden_size) for it in items]
    for item, got in zip(items, embeds, strict=True):
        alone = model.encode(**mf.Transfer("cpu").to_device(mf.batch_items([item])[0]))
        # Row-count-dependent matmul blocking moves float32 results by a few ulps.
        torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)
    calls_before = runner.last.encoder_calls
    runner.encode(items[::-1], request="r2")
    assert runner.last.status == ["hit", "hit"] and calls_before == 1

    # Precomputed embeddings: ordinary items of the same modality that skip the encoder.
    grid = outputs["image_grid_thw"][:1]
    given = {"image_embeds": embeds[0].clone(), "image_grid_thw": grid}
    pre = mf.split_items(given, model.field_specs(given))["image"]
    fresh = mf.EncoderRunner(model)
    (out,) = fresh.encode(pre)
    assert torch.equal(out, given["image_embeds"]) and fresh.last.encoder_calls == 0

    # Merge into a language-model input at the placeholder positions.
    n = sum(e.shape[0] for e in embeds)
    inputs = torch.zeros(1, n + 3, model.hidden_size)
    mask = torch.zeros(1, n + 3, dtype=torch.bool)
    mask[0, 1:n + 1] = True
    merged = mf.merge_embeddings(inputs, mask, embeds)
    assert torch.equal(merged[0, 1:n + 1], torch.cat(embeds)) and merged[0, 0].abs().sum() == 0


def test_cache_entries_own_their_rows() -> None:
    runner = mf.EncoderRunner(PatchEncoder(), mf.EncoderCache(max_tokens=100))
    outs = runner.encode(images([4, 2, 6]))
    for out in outs:  # an entry must not pin the whole batch output when others are evicted
        assert out.untyped_storage().nbytes() == out.nbytes
    assert runner.cache.stats.bytes == sum(o.nbytes for o in outs)


def test_output_width_must_be_the_hidden_size() -> None:
    class Wide(PatchEncoder):
        hidden_size = 4

    runner = mf.EncoderRunner(Wide())
    assert runner.encode(images([4])) == [None]
    assert "width 8, expected its hidden size 4" in str(runner.last.errors[0])


def test_cache_evicts_least_recently_used_first() -> None:
    cache = mf.EncoderCache(max_tokens=6)
    for key in "abc":
        cache.put(key, torch.zeros(2, 1), request="r")
    cache.get("a", request="r2")  # a is now the most recently used
    cache.release("r")
    cache.release("r2")
    cache.put("d", torch.zeros(4, 1))
    assert "a" in cache and "b" not in cache and "c" not in cache
    assert cache.stats.evictions == 2 and cache.stats.tokens == 6
