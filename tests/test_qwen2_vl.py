"""Qwen2-VL: processor and vision encoder against transformers, field contract, placement."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
)
from transformers.models.qwen2_vl.modeling_qwen2_vl import (
    Qwen2VisionTransformerPretrainedModel,
)

import mmferry as mf
import mmferry.models as models
from mmferry.errors import ContractError, MediaError
from mmferry.items import split_items
from mmferry.models.qwen2_vl import Qwen2VL, smart_resize

# Small but faithful: 2 blocks, 2 heads of 24 (head_dim/4 = 6 rotary frequencies per axis),
# the real patch 14 / temporal patch 2 / merge 2, and a non-default rotary base, so a wrong
# rope_theta read would show.
VISION = dict(depth=2, embed_dim=48, hidden_size=40, num_heads=2, mlp_ratio=2,
              patch_size=14, temporal_patch_size=2, spatial_merge_size=2,
              rope_parameters={"rope_type": "axial", "rope_theta": 5000.0})
SMALL = dict(min_pixels=28 * 28, max_pixels=28 * 28 * 64)
# transformers' PIL processor's pixels, normalised as it does: what the parity tests compare.
EXACT32 = dict(pixel_dtype="float32", resize_mode="exact")
F32 = dict(pixel_dtype="float32")

# float32 on both sides. The remaining differences are summation order only: our patch
# embedding is a matmul where the reference runs a Conv3d, and frames of one length share one
# batched SDPA call. Observed: max abs error ~6e-6 on outputs of magnitude ~9 (a few float32
# ulps), and ours is as close to a float64 run of the reference as the reference itself is.
# atol 1e-4 (1e-5 of the output scale) leaves room across BLAS builds, while a real mistake
# (rotary base, activation, position order) moves outputs by 1e-2 or more.
ATOL, RTOL = 1e-4, 1e-5


def _rgb(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def pair() -> tuple[Qwen2VisionTransformerPretrainedModel, Qwen2VL]:
    """transformers' vision tower with random weights everywhere (norms and biases too), and
    ours with the same weights copied by name."""
    ref = Qwen2VisionTransformerPretrainedModel(Qwen2VLVisionConfig(**VISION)).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if p.ndim == 1 else 0.0))
    ours = models.load("qwen2-vl", config={"model_type": "qwen2_vl", "vision_config": VISION})
    state = {f"visual.{k}": v for k, v in ref.state_dict().items()}
    assert set(state) == set(ours.state_dict())
    ours.load_state_dict(state)
    return ref, ours


def _reference(ref: Qwen2VisionTransformerPretrainedModel, pixels: torch.Tensor,
               grid: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return ref(pixels, grid_thw=grid).pooler_output


# -- processor ---------------------------------------------------------------------------


@pytest.mark.parametrize("bounds", [SMALL, {}], ids=["small-bounds", "default-bounds"])
def test_processor_matches_transformers_pil_bit_for_bit(bounds: dict[str, int]) -> None:
    model = models.load("qwen2-vl")
    # Up- and down-scaling, extreme aspect ratios, odd sizes, no-resize, grey and alpha input.
    images: list[object] = [_rgb(h, w, i) for i, (h, w) in enumerate(
        [(56, 56), (100, 60), (37, 211), (140, 84), (9, 13), (300, 17), (28, 28 * 9)])]
    images.append(Image.fromarray(_rgb(50, 70, 9)).convert("L"))
    rgba = np.dstack([_rgb(64, 48, 10), _rgb(64, 48, 11)[..., :1]])
    images.append(Image.fromarray(rgba, mode="RGBA"))
    size = {"shortest_edge": bounds["min_pixels"], "longest_edge": bounds["max_pixels"]} \
        if bounds else None
    ref = Qwen2VLImageProcessorPil(**({"size": size} if size else {}))(
        images=images, return_tensors="pt")
    out = model.processor(images=images, **bounds, **EXACT32)
    assert set(out) == {"pixel_values", "image_grid_thw"}
    assert out["pixel_values"].dtype == torch.float32
    assert out["image_grid_thw"].dtype == torch.int64
    assert torch.equal(out["image_grid_thw"], ref["image_grid_thw"])
    assert torch.equal(out["pixel_values"], ref["pixel_values"])


def test_video_layout_matches_transformers_frame_by_frame() -> None:
    # transformers 5.24 has no PIL video path (Qwen2VLVideoProcessor needs torchvision, and
    # resizes with torchvision's bicubic, which differs from Pillow's). So the reference is
    # built from the PIL *image* processor run per frame with temporal_patch_size=1 and
    # interleaved as the video processor's patchify does: rows (t, block row, block col,
    # row, col), columns (C, frame in temporal patch, P, P); odd frame counts repeat the last.
    model = models.load("qwen2-vl")
    frames = [_rgb(70, 100, 20 + i) for i in range(5)]
    out = model.processor(videos=[frames], **SMALL, **EXACT32)
    per_frame = Qwen2VLImageProcessorPil(
        size={"shortest_edge": SMALL["min_pixels"], "longest_edge": SMALL["max_pixels"]},
        temporal_patch_size=1)
    padded = [*frames, frames[-1]]
    patches = [per_frame(images=[f], return_tensors="pt")["pixel_values"] for f in padded]
    n = patches[0].shape[0]
    groups = [torch.stack([a.view(n, 3, 1, -1), b.view(n, 3, 1, -1)], 2).reshape(n, -1)
              for a, b in zip(patches[0::2], patches[1::2], strict=True)]
    grid = per_frame(images=[frames[0]], return_tensors="pt")["image_grid_thw"][0]
    assert out["video_grid_thw"].tolist() == [[3, int(grid[1]), int(grid[2])]]
    assert torch.equal(out["pixel_values_videos"], torch.cat(groups))
    # One frame is a still image repeated over the temporal patch: identical to the image path.
    still = model.processor(videos=[[frames[0]]], **SMALL, **EXACT32)
    image = model.processor(images=[frames[0]], **SMALL, **EXACT32)
    assert torch.equal(still["pixel_values_videos"], image["pixel_values"])


def test_processor_inputs_and_errors() -> None:
    model = models.load("qwen2-vl")
    one = model.processor(images=_rgb(56, 56, 0))
    assert one["image_grid_thw"].tolist() == [[1, 4, 4]]
    both = model.processor(images=[_rgb(56, 56, 0)], videos=[_rgb(56, 56, 1)[None]], **SMALL)
    assert set(both) == {"pixel_values", "image_grid_thw", "pixel_values_videos",
                         "video_grid_thw"}
    assert model.processor(images=[]) == {}
    with pytest.raises(MediaError, match="aspect ratio") as e:
        model.processor(images=[_rgb(56, 56, 0), _rgb(2, 500, 1)])
    assert e.value.source == "item 1"
    with pytest.raises(MediaError) as e:
        model.processor(images=[_rgb(56, 56, 0), b"junk"])
    assert e.value.source == "item 1"


def test_smart_resize_bounds() -> None:
    assert smart_resize(448, 448, 28, 56 * 56, 28 * 28 * 1280) == (448, 448)
    h, w = smart_resize(4000, 3000, 28, 56 * 56, 28 * 28 * 1280)
    assert h % 28 == 0 and w % 28 == 0 and h * w <= 28 * 28 * 1280
    h, w = smart_resize(10, 10, 28, 56 * 56, 28 * 28 * 1280)
    assert (h, w) == (56, 56)


# -- encoder -----------------------------------------------------------------------------


@pytest.mark.parametrize("sizes", [[(56, 56)], [(100, 60), (37, 211), (140, 84)],
                                   [(56, 84), (56, 84), (84, 56)]],
                         ids=["one", "three-sizes", "repeated-size"])
def test_encoder_matches_transformers_on_images(pair, sizes: list[tuple[int, int]]) -> None:
    ref, ours = pair
    out = ours.processor(images=[_rgb(h, w, i) for i, (h, w) in enumerate(sizes)], **SMALL, **F32)
    with torch.no_grad():
        got = ours.encode(**out)
    want = _reference(ref, out["pixel_values"], out["image_grid_thw"])
    assert got.shape == want.shape == (sum(ours.tokens_per_item({"image_grid_thw": g})
                                           for g in out["image_grid_thw"]), VISION["hidden_size"])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_encoder_matches_transformers_on_videos(pair) -> None:
    ref, ours = pair
    videos = [[_rgb(56, 84, 30 + i) for i in range(5)], [_rgb(84, 84, 40 + i) for i in range(2)]]
    out = ours.processor(videos=videos, **SMALL, **F32)
    assert out["video_grid_thw"][:, 0].tolist() == [3, 1]
    with torch.no_grad():
        got = ours.encode(**out)
    want = _reference(ref, out["pixel_values_videos"], out["video_grid_thw"])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_batch_equals_items_encoded_one_by_one(pair) -> None:
    _, ours = pair
    out = ours.processor(images=[_rgb(h, w, i) for i, (h, w) in
                                 enumerate([(56, 84), (140, 84), (56, 84)])], **SMALL)
    specs = ours.field_specs(out)
    items = split_items(out, specs)["image"]
    with torch.no_grad():
        batch = ours.encode(**out)
        singles = [ours.encode(pixel_values=it["pixel_values"],
                               image_grid_thw=it["image_grid_thw"][None]) for it in items]
    counts = [ours.tokens_per_item(it) for it in items]
    assert [s.shape[0] for s in singles] == counts
    # Not bit-equal: a GEMM's blocking depends on its row count, so rows of a batch can round
    # differently from the same rows alone (seen: ~2e-6).
    for got, want in zip(batch.split(counts), singles, strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_bfloat16_stays_close_to_float32(pair) -> None:
    _, ours = pair
    out = ours.processor(images=[_rgb(56, 84, 0)], **SMALL, **F32)
    half = models.load("qwen2-vl", config={"vision_config": VISION}, dtype="bfloat16")
    half.load_state_dict(ours.state_dict())
    assert half.visual.blocks[0].attn.qkv.weight.dtype == torch.bfloat16
    with torch.no_grad():
        got, want = half.encode(**out), ours.encode(**out)
    assert got.dtype == torch.bfloat16
    # bfloat16 keeps 8 mantissa bits; two blocks of rounding stay within a few percent.
    torch.testing.assert_close(got.float(), want, atol=0.1, rtol=0.05)


# -- contract ----------------------------------------------------------------------------


def test_field_specs_name_exactly_the_present_fields() -> None:
    model = models.load("qwen2-vl")
    out = model.processor(images=[_rgb(56, 84, 0), _rgb(84, 112, 1)], videos=[[_rgb(56, 56, 2)]],
                          **SMALL)
    specs = model.field_specs(out)
    assert set(specs) == set(out)
    assert specs["image_grid_thw"].placement == "host"
    assert specs["video_grid_thw"].placement == "host"
    assert specs["pixel_values"].sizes == (24, 48)
    assert specs["pixel_values"].placement == "device"
    embeds = {"image_embeds": torch.zeros(18, 64), "image_grid_thw": out["image_grid_thw"]}
    specs = model.field_specs(embeds)
    assert set(specs) == set(embeds) and specs["image_embeds"].sizes == (6, 12)
    with pytest.raises(ContractError, match="image_grid_thw"):
        model.field_specs({"pixel_values": out["pixel_values"]})


def test_tokens_per_item_from_the_host_grid() -> None:
    model = models.load("qwen2-vl")
    assert model.tokens_per_item({"image_grid_thw": torch.tensor([1, 4, 6])}) == 6
    assert model.tokens_per_item({"image_grid_thw": torch.tensor([1, 4, 8])}) == 8
    assert model.tokens_per_item({"video_grid_thw": torch.tensor([3, 4, 6])}) == 18
    with pytest.raises(ContractError):
        model.tokens_per_item({"pixel_values": torch.zeros(1)})


def test_precomputed_embeddings_pass_through_the_runner_only() -> None:
    model = models.load("qwen2-vl")
    grid = torch.tensor([[1, 4, 6], [1, 4, 8]])
    embeds = torch.randn(14, model.hidden_size)
    # One place for the bypass: the runner; encode itself refuses embeddings.
    with pytest.raises(ContractError, match="image_embeds"):
        model.encode(image_embeds=embeds, image_grid_thw=grid)
    given = {"image_embeds": embeds, "image_grid_thw": grid}
    items = mf.split_items(given, model.field_specs(given))["image"]
    runner = mf.EncoderRunner(model)
    outs = runner.encode(items)
    assert torch.equal(torch.cat(outs), embeds) and runner.last.encoder_calls == 0
    # Embeddings whose rows disagree with their own grid fail alone, in check_item.
    short = mf.Item("image", {"image_embeds": embeds[:5], "image_grid_thw": grid[0]},
                    items[0].specs)
    outs = runner.encode([short, items[1]])
    assert outs[0] is None and torch.equal(outs[1], embeds[6:])
    assert runner.last.errors[0].field == "image_embeds"


def test_encode_rejects_malformed_batches() -> None:
    model = models.load("qwen2-vl")
    d = {k: v for k, v in model.dummy_inputs().items() if k in ("pixel_values", "image_grid_thw")}
    with pytest.raises(ContractError, match="pixel_values"):
        model.encode(pixel_values=d["pixel_values"][:-1], image_grid_thw=d["image_grid_thw"])
    with pytest.raises(ContractError, match="one of image or video"):
        model.encode(**d, video_grid_thw=d["image_grid_thw"])
    with pytest.raises(ContractError, match="image_grid_thw"):
        model.encode(pixel_values=d["pixel_values"])
    empty = model.encode(pixel_values=torch.zeros(0, 1176),
                         image_grid_thw=torch.zeros(0, 3, dtype=torch.int64))
    assert empty.shape == (0, model.hidden_size)


def test_dummy_inputs_are_images_and_videos_of_different_sizes() -> None:
    model = models.load("qwen2-vl")
    d = model.dummy_inputs()
    for pixels, grid_name in (("pixel_values", "image_grid_thw"),
                              ("pixel_values_videos", "video_grid_thw")):
        grid = d[grid_name].tolist()
        assert len(grid) == 2 and grid[0] != grid[1]
        out = model.encode(**{pixels: d[pixels], grid_name: d[grid_name]})
        assert out.shape == (sum(t * h * w // 4 for t, h, w in grid), 64)
    assert [t for t, _, _ in d["video_grid_thw"].tolist()] == [2, 2]


def test_grid_stays_on_the_host_and_pixels_on_the_device() -> None:
    # `meta` stands in for the accelerator: mixing a CPU tensor into a device op raises, and
    # reading a device value on the host raises ("no data"), so a clean run shows the encoder
    # reads the grid only on the host and never mixes it with device tensors.
    model = models.load("qwen2-vl").to("meta")
    d = model.dummy_inputs()
    videos = model.processor(videos=[[_rgb(56, 56, i) for i in range(3)]], **SMALL)
    for pixels, grid in (("pixel_values", "image_grid_thw"),
                         ("pixel_values_videos", "video_grid_thw")):
        batch = d if pixels == "pixel_values" else videos
        out = model.encode(**{pixels: batch[pixels].to("meta"), grid: batch[grid]})
        assert out.device.type == "meta"
        with pytest.raises(NotImplementedError):
            model.encode(**{pixels: batch[pixels].to("meta"), grid: batch[grid].to("meta")})


def test_check_item_refuses_rows_that_disagree_with_the_grid() -> None:
    model = models.load("qwen2-vl")
    d = model.dummy_inputs()
    items = mf.split_items(d, model.field_specs(d))
    good = items["image"][0]
    model.check_item(good)
    model.check_item(items["video"][1])
    grid = good["image_grid_thw"]
    for field, data in (
        ("pixel_values", {**good, "pixel_values": good["pixel_values"][:-4]}),
        ("pixel_values", {**good, "pixel_values": good["pixel_values"].to(torch.int64)}),
        ("pixel_values", {**good, "image_grid_thw": grid * torch.tensor([1, 1, 3])}),
        ("image_grid_thw", {**good, "image_grid_thw": grid + torch.tensor([0, 0, 1])}),
        ("image_grid_thw", {**good, "image_grid_thw": grid.float()}),
    ):
        with pytest.raises(ContractError) as e:
            model.check_item(data)
        assert e.value.field == field


# -- uint8 levels ------------------------------------------------------------------------


def _normalised(levels: torch.Tensor, normalize: mf.Normalize, repeat: int) -> torch.Tensor:
    """Levels ``[N, k·C]`` (channel last) normalised as transformers does (rescale in float64,
    then float32), channel first and repeated ``repeat`` times per channel: the float32
    layout."""
    n, c = levels.shape[0], normalize.channels
    levels = levels.view(n, -1, c).transpose(1, 2)
    scaled = (levels.double() * normalize.scale).float().reshape(n, c, 1, -1)
    mean = torch.tensor(normalize.mean, dtype=torch.float32).view(1, c, 1, 1)
    std = torch.tensor(normalize.std, dtype=torch.float32).view(1, c, 1, 1)
    return ((scaled - mean) / std).expand(n, c, repeat, scaled.shape[-1]).reshape(n, -1)


@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_levels_are_the_float_pixels_before_normalising(mode: str) -> None:
    model = models.load("qwen2-vl")
    images = [_rgb(100, 60, 0), _rgb(37, 211, 1)]
    videos = [[_rgb(70, 100, 20 + i) for i in range(3)], [_rgb(56, 56, 9)]]
    levels = model.processor(images=images, videos=videos, **SMALL, resize_mode=mode)
    floats = model.processor(images=images, videos=videos, **SMALL, resize_mode=mode,
                             pixel_dtype="float32")
    assert levels["pixel_values"].dtype == levels["pixel_values_videos"].dtype == torch.uint8
    # An image is sent once: half the columns of the float layout, a quarter of its bytes each.
    assert levels["pixel_values"].shape == (floats["pixel_values"].shape[0], 3 * 14 * 14)
    assert levels["pixel_values_videos"].shape == floats["pixel_values_videos"].shape
    for name in ("image_grid_thw", "video_grid_thw"):
        assert torch.equal(levels[name], floats[name])
    specs = model.field_specs(levels)
    assert specs["pixel_values"].normalize == specs["pixel_values_videos"].normalize \
        == model.normalize == mf.Normalize(model.processor_config.image_mean,
                                           model.processor_config.image_std)
    assert model.field_specs(floats)["pixel_values"].normalize is None
    torch.testing.assert_close(_normalised(levels["pixel_values"], model.normalize, 2),
                               floats["pixel_values"], atol=1e-6, rtol=0)
    torch.testing.assert_close(_normalised(levels["pixel_values_videos"], model.normalize, 1),
                               floats["pixel_values_videos"], atol=1e-6, rtol=0)


def test_uint8_embeddings_equal_the_float32_path(pair) -> None:
    _, ours = pair
    images = [_rgb(h, w, i) for i, (h, w) in enumerate([(100, 60), (37, 211), (140, 84)])]
    videos = [[_rgb(56, 84, 30 + i) for i in range(5)], [_rgb(84, 84, 40)]]
    for mode in ("fast", "exact"):
        levels = ours.processor(images=images, videos=videos, **SMALL, resize_mode=mode)
        floats = ours.processor(images=images, videos=videos, **SMALL, resize_mode=mode,
                                pixel_dtype="float32")
        for pixels, grid in (("pixel_values", "image_grid_thw"),
                             ("pixel_values_videos", "video_grid_thw")):
            with torch.no_grad():
                got = ours.encode(**{pixels: levels[pixels], grid: levels[grid]})
                want = ours.encode(**{pixels: floats[pixels], grid: floats[grid]})
            assert (got - want).abs().max() < 1e-5, (mode, pixels)


def test_uint8_items_through_wire_and_runner_equal_float32(pair) -> None:
    _, ours = pair
    images = [_rgb(h, w, i) for i, (h, w) in enumerate([(100, 60), (56, 84)])]
    outs = {}
    for dtype in ("uint8", "float32"):
        out = ours.processor(images=images, **SMALL, pixel_dtype=dtype)
        items = mf.wire.decode(mf.wire.encode(mf.split_items(out, ours.field_specs(out))))
        with torch.no_grad():
            outs[dtype] = mf.EncoderRunner(ours).encode(items)
    for got, want in zip(outs["uint8"], outs["float32"], strict=True):
        assert (got - want).abs().max() < 1e-5


def test_fast_pixels_are_transformers_torchvision_pixels() -> None:
    pytest.importorskip("torchvision")
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    model = models.load("qwen2-vl")
    images = [_rgb(h, w, i) for i, (h, w) in enumerate([(100, 60), (37, 211), (300, 17), (56, 56)])]
    size = {"shortest_edge": SMALL["min_pixels"], "longest_edge": SMALL["max_pixels"]}
    ref = Qwen2VLImageProcessor(size=size)(images=images, return_tensors="pt")
    out = model.processor(images=images, **SMALL, **F32)
    assert torch.equal(out["image_grid_thw"], ref["image_grid_thw"])
    # Same uint8 resize; transformers normalises in one float32 pass where we look up a table
    # built as its PIL processor does, so values may differ in the last float32 bit.
    torch.testing.assert_close(out["pixel_values"], ref["pixel_values"], atol=1e-5, rtol=0)


def test_check_item_takes_levels_only_with_the_models_normalisation() -> None:
    model = models.load("qwen2-vl")
    out = model.processor(images=[_rgb(56, 84, 0)], **SMALL)
    (item,) = mf.split_items(out, model.field_specs(out))["image"]
    model.check_item(item)
    other = mf.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    specs = {**item.specs, "pixel_values": mf.FieldSpec.flat_from_sizes("image", [24],
                                                                         normalize=other).for_item()}
    for bad in (mf.Item("image", dict(item), specs), dict(item)):
        with pytest.raises(ContractError, match="normalize") as e:
            model.check_item(bad)
        assert e.value.field == "pixel_values"
    wide = {"pixel_values": torch.zeros(24, 1176, dtype=torch.uint8),
            "image_grid_thw": item["image_grid_thw"]}
    with pytest.raises(ContractError, match="uint8") as e:
        model.check_item(mf.Item("image", wide, item.specs))
    runner = mf.EncoderRunner(model)
    assert runner.encode([mf.Item("image", dict(item), specs)]) == [None]
    assert runner.last.errors[0].field == "pixel_values"


def test_pixel_options_are_checked_before_any_media() -> None:
    model = models.load("qwen2-vl")
    with pytest.raises(mf.ArgumentError) as e:
        model.processor(images=[b"not an image"], pixel_dtype="float16")
    assert e.value.argument == "pixel_dtype"
    with pytest.raises(mf.ArgumentError) as e:
        model.processor(images=[b"not an image"], resize_mode="lanczos")
    assert e.value.argument == "resize_mode"


def test_the_folded_weights_audit_clean_after_use_and_again() -> None:
    # The folded patch embedding is derived once and kept: as a buffer of the model it lives
    # on the device like its parameters, whether it was made before an audit or in one.
    model = models.load("qwen2-vl")
    d = model.dummy_inputs()
    model.encode(pixel_values=d["pixel_values"], image_grid_thw=d["image_grid_thw"])
    for _ in range(2):
        reports = mf.audit.audit_model(model)
        assert all(r.ok and not r.findings for r in reports.values()), reports
    assert not any("fold" in k for k in model.state_dict())
