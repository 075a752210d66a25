"""vLLM's behaviours (reference/vllm-semantics.md §15), one test each, for the stages they
touch: contract, split, hashing, batching, transfer, encoder runtime."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

import mmferry as mf
from mmferry.fields import reduce_field

F = mf.FieldSpec


def qwen_like(grids: list[list[int]], dim: int = 8) -> tuple[dict, dict]:
    grid = torch.tensor(grids, dtype=torch.int64).reshape(-1, 3)
    n = int(grid.prod(-1).sum())
    outputs = {"pixel_values": torch.randn(n, dim), "image_grid_thw": grid}
    specs = {
        "pixel_values": F.flat_from_sizes("image", grid.prod(-1)),
        "image_grid_thw": F.batched("image", placement="host"),
    }
    return outputs, specs


# 1. Config-driven splitting -------------------------------------------------------------


def test_b01_only_configured_keys_and_equal_counts() -> None:
    outputs, specs = qwen_like([[1, 2, 2], [1, 2, 4]])
    items = mf.split_items({**outputs, "extra": torch.ones(1)}, specs, ignore_extra=True)
    assert set(items["image"][0]) == {"pixel_values", "image_grid_thw"}
    # A modality whose keys are all absent (or None) is skipped, not an error.
    audio = {"input_features": F.batched("audio")}
    items = mf.split_items({**outputs, "input_features": None}, {**specs, **audio})
    assert list(items) == ["image"]
    # A key splitting into zero elements drops the modality.
    empty, especs = qwen_like([])
    assert len(mf.split_items(empty, especs)) == 0
    # Counts must agree within a modality.
    outputs["image_grid_thw"] = torch.tensor([[1, 2, 2], [1, 2, 4], [1, 1, 1]])
    with pytest.raises(mf.ContractError, match="item counts disagree") as e:
        mf.split_items(outputs, specs)
    assert e.value.field in {"pixel_values", "image_grid_thw"}


# 2. batched -----------------------------------------------------------------------------


def test_b02_batched_split_and_merge() -> None:
    spec = F.batched("image")
    data = torch.arange(12).reshape(3, 4)
    items = mf.split_items({"x": data}, {"x": spec})["image"]
    assert [it["x"].shape for it in items] == [(4,)] * 3
    (batch,) = mf.batch_items(items)
    assert torch.equal(batch.data["x"], data)
    one = reduce_field("x", spec.for_item(), [items[0]["x"]])
    assert one.shape == (1, 4) and one.data_ptr() == items[0]["x"].data_ptr()  # a view
    ragged = [torch.ones(2), torch.ones(3)]
    assert isinstance(reduce_field("x", spec, ragged), list)
    assert reduce_field("x", spec, []) == []
    assert reduce_field("x", spec, [1, 2]) == [1, 2]


# 3. flat --------------------------------------------------------------------------------


def test_b03_flat_slices_sizes_dims_padding_and_lists() -> None:
    data = torch.arange(24).reshape(2, 12)
    spec = F.flat_from_sizes("audio", [5, 0, 7], dim=1)
    items = mf.split_items({"x": data}, {"x": spec})["audio"]
    assert [tuple(it["x"].shape) for it in items] == [(2, 5), (2, 0), (2, 7)]
    (batch,) = mf.batch_items(items)
    assert torch.equal(batch.data["x"], data)
    tuple_spec = F.flat("audio", [(slice(None), slice(0, 4)), (slice(None), slice(4, 12))], dim=1)
    assert [it["x"].shape[1] for it in mf.split_items({"x": data}, {"x": tuple_spec})["audio"]] == [4, 8]
    with pytest.raises(mf.ContractError, match="1-D"):
        F.flat_from_sizes("audio", torch.ones(2, 2, dtype=torch.int64))
    # Non-concat dims differ: zero-padded to the per-dimension maximum.
    a, b = torch.ones(3, 2), torch.full((2, 4), 2.0)
    padded = reduce_field("x", F.flat("audio", [slice(0, 1)]), [a, b])
    assert padded.shape == (5, 4)
    assert torch.equal(padded[:3, :2], a) and torch.equal(padded[3:, :], b)
    assert padded[:3, 2:].abs().sum() == 0
    # Lists flatten one level (dim 0 only).
    lspec = F.flat("audio", [slice(0, 2), slice(2, 3)])
    litems = mf.split_items({"x": [1, 2, 3]}, {"x": lspec})["audio"]
    assert [it["x"] for it in litems] == [[1, 2], [3]]
    assert mf.batch_items(litems)[0].data["x"] == [1, 2, 3]


# 4. shared ------------------------------------------------------------------------------


def test_b04_shared_same_object_and_batches_split_on_value() -> None:
    flag = torch.tensor([1])
    specs = {"x": F.batched("audio"), "flag": F.shared("audio", 2)}
    items = mf.split_items({"x": torch.ones(2, 3), "flag": flag}, specs)["audio"]
    assert items[0]["flag"] is items[1]["flag"]
    other = mf.split_items({"x": torch.ones(2, 3), "flag": torch.tensor([2])}, specs)["audio"]
    same = mf.split_items({"x": torch.ones(2, 3), "flag": torch.tensor([1])}, specs)["audio"]
    batches = mf.batch_items([*items, *other, *same])
    assert [b.num_items for b in batches] == [2, 2, 2]
    assert [int(b.data["flag"]) for b in batches] == [1, 2, 1]
    assert len(mf.batch_items([*items, *same])) == 1  # equal content joins


# 5. consecutive items of one modality, in order -------------------------------------------


def test_b05_consecutive_grouping_preserves_order() -> None:
    img, ispecs = qwen_like([[1, 2, 2]])
    image = mf.split_items(img, ispecs)["image"][0]
    audio = mf.split_items({"a": torch.ones(1, 4)}, {"a": F.batched("audio")})["audio"][0]
    batches = mf.batch_items([image, image, audio, image])
    assert [(b.modality, b.num_items) for b in batches] == [("image", 2), ("audio", 1), ("image", 1)]
    assert mf.batch_items([]) == []


# 6. host placement ------------------------------------------------------------------------


def test_b06_host_fields_never_move_and_batch_normally() -> None:
    outputs, specs = qwen_like([[1, 2, 2], [1, 2, 4]])
    (batch,) = mf.batch_items(mf.split_items(outputs, specs))
    moved = mf.Transfer("meta").to_device(batch)
    grid = moved["image_grid_thw"]
    assert grid.device.type == "cpu" and not grid.is_pinned()
    assert torch.equal(grid, outputs["image_grid_thw"])
    assert moved["pixel_values"].device.type == "meta"
    assert F.batched("image", keep_on_cpu=True).placement is mf.Placement.HOST


# 7. device movement, one copy; mixed field kinds in a key are an error --------------------


def test_b07_one_copy_per_batch_and_mixed_specs_rejected() -> None:
    outputs, specs = qwen_like([[1, 2, 2], [1, 2, 4]])
    specs = {**specs, "image_grid_thw": F.batched("image", placement="both")}
    (batch,) = mf.batch_items(mf.split_items(outputs, specs))
    transfer = mf.Transfer("meta")
    moved = transfer.to_device(batch)
    assert transfer.stats.copies == 1
    assert isinstance(moved["image_grid_thw"], mf.Mirrored)
    with pytest.raises(mf.ContractError):
        mf.Item("image", {"x": torch.ones(1)}, {"x": F.batched("audio")})
    a = mf.Item("image", {"x": torch.ones(2)}, {"x": F.batched("image")})
    b = mf.Item("image", {"x": torch.ones(2)}, {"x": F.flat("image", [slice(0, 2)]).for_item()})
    assert len(mf.batch_items([a, b])) == 2  # different kinds never meet in one reduction


# 8. dtypes --------------------------------------------------------------------------------


def test_b08_dtypes_kept_bf16_hashes_and_mixed_dtypes_rejected() -> None:
    spec = F.batched("image")
    x = torch.randn(2, 3).to(torch.bfloat16)
    items = mf.split_items({"x": x}, {"x": spec})["image"]
    (batch,) = mf.batch_items(items)
    assert batch.data["x"].dtype == torch.bfloat16
    assert items[0].hash != items[1].hash
    a = mf.Item("image", {"x": torch.ones(2)}, {"x": spec})
    b = mf.Item("image", {"x": torch.ones(2, dtype=torch.float64)}, {"x": spec})
    with pytest.raises(mf.ContractError, match="mixed dtypes") as e:
        mf.batch_items([a, b])
    assert e.value.field == "x"


# 9 and 11. encoder output per item; modalities batch separately ---------------------------


class Doubler(torch.nn.Module):
    """Two tokens per item row: output rows are the item's values, twice."""

    name = "doubler"
    modalities = ("image", "audio")
    hidden_size = 4
    precomputed_fields: ClassVar[frozenset[str]] = frozenset()
    checkpoint_prefixes: ClassVar[dict[str, str]] = {}

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def check_item(self, item) -> None:
        pass

    def tokens_per_item(self, item) -> int:
        return 2 * next(iter(item.values())).shape[0]

    def encode(self, **batch) -> torch.Tensor:
        self.calls += 1
        x = next(iter(batch.values()))
        return x.repeat_interleave(2, dim=0)


def test_b09_b11_outputs_per_item_across_modalities() -> None:
    spec_i = {"x": F.flat_from_sizes("image", [1, 2])}
    spec_a = {"y": F.flat_from_sizes("audio", [3])}
    image = mf.split_items({"x": torch.randn(3, 4)}, spec_i)["image"]
    audio = mf.split_items({"y": torch.randn(3, 4)}, spec_a)["audio"]
    model = Doubler()
    runner = mf.EncoderRunner(model)
    outs = runner.encode([image[0], audio[0], image[1]])
    assert [o.shape[0] for o in outs] == [2, 6, 4]
    assert torch.equal(outs[1], audio[0]["y"].repeat_interleave(2, 0))
    assert model.calls == 3


# 12. precomputed embeddings -------------------------------------------------------------------


def test_b12_precomputed_embeds_bypass_and_never_batch_with_pixels() -> None:
    embeds = mf.split_items({"x_embeds": torch.randn(4, 4)},
                            {"x_embeds": F.flat_from_sizes("image", [4])})["image"][0]
    pixels = mf.split_items({"x": torch.randn(2, 4)}, {"x": F.flat_from_sizes("image", [2])})["image"][0]
    assert len(mf.batch_items([embeds, pixels])) == 2

    class Counting(Doubler):
        precomputed_fields = frozenset({"x_embeds"})

        def tokens_per_item(self, item) -> int:
            return item["x_embeds"].shape[0] if "x_embeds" in item else super().tokens_per_item(item)

    model = Counting()
    out = mf.EncoderRunner(model).encode([embeds, pixels])
    assert torch.equal(out[0], embeds["x_embeds"]) and out[1].shape[0] == 4
    assert model.calls == 1


# 15. no data reaching a batch -------------------------------------------------------------------


def test_b15_none_data_refused_with_field_name() -> None:
    item = mf.Item("image", {"x": None}, {"x": F.batched("image")})
    with pytest.raises(mf.ContractError, match="no data") as e:
        mf.batch_items([item])
    assert e.value.field == "x"


# 16. hash keys ------------------------------------------------------------------------------------


def test_b16_hash_keys_deterministic_over_model_content_and_kwargs() -> None:
    raw = b"\x89PNG fake bytes"
    h = mf.hash_media(raw, model_id="m", modality="image", processor_kwargs={"a": 1, "b": 2})
    assert h == mf.hash_media(raw, model_id="m", modality="image", processor_kwargs={"b": 2, "a": 1})
    assert h != mf.hash_media(raw, model_id="m2", modality="image", processor_kwargs={"a": 1, "b": 2})
    assert h != mf.hash_media(raw, model_id="m", modality="image", processor_kwargs={"a": 1})
    assert h != mf.hash_media(raw + b"!", model_id="m", modality="image",
                              processor_kwargs={"a": 1, "b": 2})
    from PIL import Image

    pixels = torch.randint(0, 256, (8, 8, 3), dtype=torch.uint8).numpy()
    pil = mf.hash_media(Image.fromarray(pixels), model_id="m", modality="image")
    assert pil == mf.hash_media(Image.fromarray(pixels.copy()), model_id="m", modality="image")
    pixels[0, 0, 0] ^= 1
    assert pil != mf.hash_media(Image.fromarray(pixels), model_id="m", modality="image")
    # The same image at another position of another request has the same item key.
    o1, s1 = qwen_like([[1, 2, 2], [1, 2, 4]])
    o2, s2 = qwen_like([[1, 2, 4]])
    o2["pixel_values"] = o1["pixel_values"][4:].clone()
    assert mf.split_items(o1, s1)["image"][1].hash == mf.split_items(o2, s2)["image"][0].hash


# 18. encoder-cache accounting ---------------------------------------------------------------


def test_b18_cache_refcounts_and_evicts_oldest_unreferenced() -> None:
    cache = mf.EncoderCache(max_tokens=10)
    assert cache.put("a", torch.zeros(4, 2), request="r1")
    assert cache.put("b", torch.zeros(4, 2), request="r2")
    cache.release("r1")
    assert cache.put("c", torch.zeros(4, 2), request="r3")  # evicts a, keeps referenced b
    assert "a" not in cache and "b" in cache and cache.stats.evictions == 1
    assert not cache.put("d", torch.zeros(4, 2), request="r4")  # b and c referenced: no room
    with pytest.raises(mf.EncoderCacheError, match="more than the cache"):
        cache.put("e", torch.zeros(11, 2))


# 19. nested lists -------------------------------------------------------------------------------


def test_b19_nested_lists_stay_lists() -> None:
    data = [[torch.ones(2), torch.zeros(1)], [torch.ones(3)]]
    items = mf.split_items({"x": data}, {"x": F.batched("video")})["video"]
    assert isinstance(items[0]["x"], list)
    (batch,) = mf.batch_items(items)
    assert mf.items.values_equal(batch.data["x"], data)
    moved = mf.Transfer("cpu").to_device(batch)
    assert mf.items.values_equal(moved["x"], data)


# 20. no media ---------------------------------------------------------------------------------


def test_b20_no_media_no_work() -> None:
    outputs, specs = qwen_like([])
    items = mf.split_items(outputs, specs)
    assert len(items) == 0 and mf.batch_items(items) == []
    model = Doubler()
    assert mf.EncoderRunner(model).encode(items) == [] and model.calls == 0


def test_b16_paths_hash_by_content(tmp_path) -> None:
    path = tmp_path / "a.png"
    path.write_bytes(b"one")
    first = mf.hash_media(path, model_id="m", modality="image")
    assert first == mf.hash_media(b"one", model_id="m", modality="image")
    path.write_bytes(b"two")
    assert mf.hash_media(str(path), model_id="m", modality="image") != first
    with pytest.raises(mf.MediaError, match=r"missing\.png"):
        mf.hash_media(tmp_path / "missing.png", model_id="m", modality="image")
