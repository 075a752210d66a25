"""Issue 9, class 1: the encoder cache holds only what the model computes for that item."""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

import mmferry as mf
from mmferry.errors import CheckpointError

F = mf.FieldSpec


@pytest.fixture(scope="module")
def qwen() -> mf.EncoderModel:
    return mf.models.load("qwen2-vl")


def _images(model, sizes=((56, 84), (84, 112), (56, 56))) -> list[mf.Item]:
    rng = np.random.default_rng(1)
    pics = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
    out = model.processor(images=pics, min_pixels=56 * 56, max_pixels=28 * 28 * 16)
    return mf.split_items(out, model.field_specs(out))["image"]


def _alone(model, item) -> torch.Tensor:
    return mf.EncoderRunner(model).encode([item])[0]


def test_rows_that_disagree_with_their_grid_fail_alone_and_poison_nothing(qwen) -> None:
    a, b, honest = _images(qwen)
    # Swap the pixels of a and b: each grid now disagrees with its rows, the total adds up.
    specs = a.specs
    bad_a = mf.Item("image", {"pixel_values": b["pixel_values"],
                              "image_grid_thw": a["image_grid_thw"]}, specs)
    bad_b = mf.Item("image", {"pixel_values": a["pixel_values"],
                              "image_grid_thw": b["image_grid_thw"]}, specs)
    # Through the wire with hashes recomputed, as the wire docs advise for untrusted peers.
    received = mf.wire.decode(mf.wire.encode([bad_a, honest, bad_b])).in_order()
    received = [mf.Item(it.modality, dict(it), it.specs) for it in received]
    runner = mf.EncoderRunner(qwen)
    outs = runner.encode(received, request="peer")
    assert outs[0] is None and outs[2] is None
    assert runner.last.status == ["error", "miss", "error"]
    for i in (0, 2):
        error = runner.last.errors[i]
        assert isinstance(error, mf.ContractError) and error.field == "pixel_values"
        assert f"item {i}" in str(error)
    torch.testing.assert_close(outs[1], _alone(qwen, honest), rtol=1e-5, atol=1e-5)
    assert len(runner.cache) == 1 and runner.cache_key(honest) in runner.cache
    # The honest item's later requests get its own embedding.
    again = runner.encode([honest])[0]
    assert runner.last.status == ["hit"] and torch.equal(again, outs[1])


@pytest.mark.parametrize("field, value, why", [
    ("pixel_values", lambda it: it["pixel_values"][:, :-1], "width"),
    ("pixel_values", lambda it: it["pixel_values"].to(torch.int32), "integer pixels"),
    ("pixel_values", lambda it: it["pixel_values"], "levels without their normalisation"),
    ("pixel_values", lambda it: it["pixel_values"][None], "rank"),
    ("image_grid_thw", lambda it: it["image_grid_thw"].float(), "float grid"),
    ("image_grid_thw", lambda it: torch.tensor([1, 3, 4]), "odd grid"),
    ("image_grid_thw", lambda it: torch.tensor([0, 4, 6]), "empty grid"),
])
def test_every_malformed_field_is_rejected_alone(qwen, field, value, why) -> None:
    a, b, c = _images(qwen)
    specs = a.specs
    if why in ("integer pixels", "levels without their normalisation"):
        # A spec that declares no normalisation: the item may hold any dtype; only uint8
        # levels with the model's own normalisation, or floats, are the model's input.
        specs = {**specs, field: replace(specs[field], normalize=None)}
    broken = mf.Item("image", {**a, field: value(a)}, specs)
    runner = mf.EncoderRunner(qwen)
    outs = runner.encode([b, broken, c])
    assert outs[1] is None, why
    assert runner.last.errors[1].field == field and "item 1" in str(runner.last.errors[1])
    assert outs[0] is not None and outs[2] is not None
    assert len(runner.cache) == 2 and runner.cache_key(a) not in runner.cache


class Rows(torch.nn.Module):
    """Generic model: one output row per input row, mean over the row's width (so a
    zero-padded width would change the value)."""

    name = "rows"
    modalities = ("image",)
    hidden_size = 2
    precomputed_fields: ClassVar[frozenset[str]] = frozenset()
    checkpoint_prefixes: ClassVar[dict[str, str]] = {}

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(scale))
        self.widths: list[int] = []

    def check_item(self, item) -> None:
        if isinstance(item["x"], torch.Tensor) and not item["x"].is_floating_point():
            raise mf.ContractError("must be floating point", field="x")

    def tokens_per_item(self, item) -> int:
        return item["x"].shape[0]  # AttributeError on None: the runner names the item

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        self.widths.append(x.shape[1])
        m = x.mean(1, keepdim=True) * self.scale
        return torch.cat([m, -m], 1)


def _rows(*shapes, dtype=torch.float32, seed=0) -> list[mf.Item]:
    g = torch.Generator().manual_seed(seed)
    return [mf.Item("image", {"x": torch.rand(s, generator=g).to(dtype)},
                    {"x": F.flat("image", [slice(None)])}) for s in shapes]


def test_isolation_is_generic_and_mismatched_widths_are_never_zero_padded() -> None:
    model = Rows()
    good1, wide, good2 = _rows((2, 3), (2, 5), (1, 3))
    (ints,) = _rows((2, 3), dtype=torch.int64)
    runner = mf.EncoderRunner(model)
    outs = runner.encode([good1, ints, wide, good2])
    assert runner.last.status == ["miss", "error", "miss", "miss"]
    assert runner.last.errors[1].field == "x"
    # The width-5 item ran in a call of its own: nothing was padded to width 5.
    assert model.widths == [3, 5, 3]
    for item, out in zip([good1, wide, good2], [outs[0], outs[2], outs[3]], strict=True):
        assert torch.equal(out, _alone(Rows(), item))


def test_mixed_dtypes_and_missing_data_fail_per_item() -> None:
    model = Rows()
    (half,) = _rows((2, 3), dtype=torch.float16)
    a, b = _rows((1, 3), (3, 3), seed=2)
    empty = mf.Item("image", {"x": None}, a.specs)
    runner = mf.EncoderRunner(model)
    outs = runner.encode([a, half, empty, b])
    assert runner.last.status[:2] == ["miss", "miss"] and runner.last.status[3] == "miss"
    assert outs[2] is None and runner.last.status[2] == "error"
    assert isinstance(runner.last.errors[2], mf.ContractError) and "item 2" in str(
        runner.last.errors[2])
    assert all(outs[i] is not None for i in (0, 1, 3))


def test_two_models_sharing_a_cache_never_share_entries(qwen) -> None:
    cache = mf.EncoderCache(max_tokens=1000)
    items = _rows((2, 3), (1, 3))
    one = mf.EncoderRunner(Rows(1.0), cache)
    two = mf.EncoderRunner(Rows(2.0), cache)  # same name and config, other weights
    half = mf.EncoderRunner(Rows(1.0).to(torch.float64), cache)  # other dtype
    a = one.encode(items)
    b = two.encode(items)
    c = half.encode(items)
    assert two.last.status == ["miss", "miss"] and half.last.status == ["miss", "miss"]
    assert torch.equal(b[0], 2 * a[0]) and torch.equal(c[0], a[0])
    assert len({one.model_id, two.model_id, half.model_id}) == 3
    # The same model (even another instance) shares: the id follows name, config, weights.
    same = mf.EncoderRunner(Rows(1.0), cache)
    same.encode(items)
    assert same.last.status == ["hit", "hit"]
    # Another model name with identical weights does not.
    other = Rows(1.0)
    other.name = "rows-2"
    assert mf.EncoderRunner(other, cache).model_id != one.model_id


def test_editing_a_result_in_place_changes_no_later_request() -> None:
    runner = mf.EncoderRunner(Rows())
    a, b = _rows((2, 3), (1, 3))
    first = runner.encode([a, b, a])  # miss, miss, repeat
    want = [t.clone() for t in first]
    for e in first:
        e /= e.norm()
        e.add_(100.0)
    hits = runner.encode([a, b, a])  # hit, hit, hit
    assert runner.last.status == ["hit", "hit", "hit"]
    assert all(torch.equal(x, y) for x, y in zip(hits, want, strict=True))
    for e in hits:
        e.zero_()
    assert all(torch.equal(x, y) for x, y in zip(runner.encode([a, b, a]), want, strict=True))
    assert hits[0].data_ptr() != first[0].data_ptr() != hits[2].data_ptr()


def test_precomputed_embeddings_are_copied_from_the_callers_tensor(qwen) -> None:
    grid = torch.tensor([[1, 4, 6]])
    embeds = torch.randn(6, qwen.hidden_size)
    given = {"image_embeds": embeds, "image_grid_thw": grid}
    items = mf.split_items(given, qwen.field_specs(given))["image"]
    runner = mf.EncoderRunner(qwen)
    runner.encode(items)
    want = embeds.clone()
    embeds.zero_()  # the caller reuses its buffer
    assert torch.equal(runner.encode(items[:1])[0], want) and runner.last.status == ["hit"]


def _hash(img: Image.Image) -> str:
    return mf.hash_media(img, model_id="m", modality="image")


def test_media_hash_covers_everything_that_changes_the_pixels() -> None:
    base = Image.new("P", (4, 4))
    base.putpalette([0, 0, 0, 255, 255, 255] * 128)
    seen = {_hash(base)}
    variants = []
    transparent = base.copy()
    transparent.info["transparency"] = 0
    variants.append(transparent)
    rgba_palette = base.copy()
    rgba_palette.putpalette([0, 0, 0, 0] * 256, rawmode="RGBA")
    variants.append(rgba_palette)
    alpha_palette = base.copy()
    alpha_palette.putpalette([0, 0, 0, 255] * 256, rawmode="RGBA")
    variants.append(alpha_palette)
    variants.append(base.convert("L"))
    la = Image.new("LA", (4, 4))
    variants.append(la)
    variants.append(Image.new("RGBA", (4, 4)))
    rgb = Image.new("RGB", (4, 4))
    rgb_t = rgb.copy()
    rgb_t.info["transparency"] = (0, 0, 0)
    variants += [rgb, rgb_t]
    for img in variants:
        seen.add(_hash(img))
    assert len(seen) == len(variants) + 1
    # What does not change the pixels does not change the key.
    dpi = base.copy()
    dpi.info["dpi"] = (72, 72)
    assert _hash(dpi) == _hash(base)


def test_complex_views_hash_by_value() -> None:
    x = torch.randn(4, dtype=torch.complex64)
    for lazy, plain in ((x.conj(), x.conj().resolve_conj()), (-x, torch._neg_view(x))):
        assert mf.hash_media(lazy, model_id="m", modality="a") == mf.hash_media(
            plain, model_id="m", modality="a")
    item = mf.Item("audio", {"x": x.conj()}, {"x": F.batched("audio")})
    assert item.hash == mf.Item("audio", {"x": x.conj().resolve_conj()}, item.specs).hash
    with pytest.raises(mf.ContractError):
        mf.Item("audio", {"x": x.to_sparse()}, item.specs).hash  # noqa: B018


# -- checkpoints -----------------------------------------------------------------------------


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)


PREFIXES = {"enc.": ""}


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"enc.lin.weight": torch.full((2, 2), value), "enc.lin.bias": torch.full((2,), value)}


def test_the_same_tensor_in_two_files_names_both(tmp_path) -> None:
    save_file(_state(1.0), tmp_path / "a.safetensors")
    save_file({"enc.lin.bias": torch.zeros(2)}, tmp_path / "b.safetensors")
    with pytest.raises(CheckpointError, match=r"a\.safetensors and b\.safetensors") as e:
        mf.models.checkpoint.load_safetensors(Tiny(), tmp_path, PREFIXES)
    assert e.value.parameter == "enc.lin.bias"


def test_an_index_beside_a_single_file_checkpoint_names_both(tmp_path) -> None:
    import json

    save_file(_state(1.0), tmp_path / "model-00001-of-00001.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": dict.fromkeys(_state(1.0), "model-00001-of-00001.safetensors")}))
    module = Tiny()
    mf.models.checkpoint.load_safetensors(module, tmp_path, PREFIXES)  # unambiguous: loads
    assert torch.equal(module.lin.bias, torch.ones(2))
    save_file(_state(2.0), tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors and model\.safetensors"
                       r"\.index\.json \(via model-00001-of-00001\.safetensors\)"):
        mf.models.checkpoint.load_safetensors(Tiny(), tmp_path, PREFIXES)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.bool, torch.uint8])
def test_non_floating_weights_are_an_error_not_a_cast(tmp_path, dtype) -> None:
    state = _state(1.0)
    state["enc.lin.weight"] = state["enc.lin.weight"].to(dtype)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="not floating point") as e:
        mf.models.checkpoint.load_safetensors(Tiny(), tmp_path, PREFIXES)
    assert e.value.parameter == "lin.weight"
    state["enc.lin.weight"] = state["enc.lin.weight"].to(torch.bfloat16)
    save_file(state, tmp_path / "model.safetensors")
    mf.models.checkpoint.load_safetensors(Tiny(), tmp_path, PREFIXES)  # floats cast fine
