"""MiniCPM-V 4.6: processor and encoder against transformers, checkpoint loading, contract,
placement."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import MiniCPMV4_6Config
from transformers.models.minicpmv4_6.image_processing_pil_minicpmv4_6 import (
    MiniCPMV4_6ImageProcessorPil,
)
from transformers.models.minicpmv4_6.modeling_minicpmv4_6 import (
    MiniCPMV4_6ForConditionalGeneration,
)

import mmferry as mf
import mmferry.models as models
from mmferry.errors import ArgumentError, ContractError, MediaError
from mmferry.media.samples import photo_like
from mmferry.models import minicpm_v4_6
from mmferry.models.minicpm_v4_6 import MiniCPMV46, ProcessorConfig, VisionConfig

# Small but faithful: 2 layers of 2 heads of 16, the window merger after layer 0, the real
# patch 14, a position table of 5×5 (image_size 70) so bucketing is not the identity.
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
              image_size=70, patch_size=14)
TEXT = dict(model_type="qwen3_5_text", hidden_size=40, intermediate_size=64,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=20,
            vocab_size=64, layer_types=["full_attention"])
SMALL = 112  # scale_resolution for most cases: slices of at most 8×8 patches
# Pixels compared with transformers' PIL processor: its resize, its float32 values.
FLOAT_EXACT = {"pixel_dtype": "float32", "resize_mode": "exact"}
# Embeddings compared with it: its resize, uint8 levels (the default) through the folded
# patch embedding, so the default path is the one checked against transformers.
EXACT = {"resize_mode": "exact"}

# float32 on both sides; the differences are summation order only (a matmul patch embedding
# against a Conv2d, slices of one size batched into one attention call, windows batched).
# Observed max abs error ~1e-6 on outputs of magnitude ~1; a real mistake (a window order, a
# bucket, an activation) moves outputs by 1e-2 or more.
ATOL, RTOL = 1e-4, 1e-5

# name -> ((height, width), slice grid (rows, columns) at scale_resolution 112; (0, 0): none).
IMAGES = {
    "upscaled-unsliced": ((60, 90), (0, 0)),
    "downscaled-unsliced": ((130, 90), (0, 0)),
    "sliced-1x2": ((120, 230), (1, 2)),
    "sliced-2x2-square": ((230, 220), (2, 2)),
    "sliced-4x1-tall": ((400, 130), (4, 1)),
    "sliced-1x5-wide": ((90, 500), (1, 5)),
    "sliced-at-max_slice_nums": ((700, 600), (2, 2)),  # with max_slice_nums=4
}

def _rgb(h: int, w: int, seed: int) -> np.ndarray:
    """Photo-like: a gradient, a disc and mild noise (flat noise hides resize differences)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([x * 255 / max(w - 1, 1), y * 255 / max(h - 1, 1),
                    np.full((h, w), 40 + 10 * seed)], -1)
    img[(y - h / 2) ** 2 + (x - w / 3) ** 2 < (min(h, w) / 4) ** 2] = (220, 60, 90)
    img += rng.normal(0, 12, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def _hf_config() -> MiniCPMV4_6Config:
    return MiniCPMV4_6Config(vision_config=VISION, text_config=TEXT, insert_layer_id=0)


@pytest.fixture(scope="module")
def pair() -> tuple[MiniCPMV4_6ForConditionalGeneration, MiniCPMV46]:
    """transformers' model with random weights everywhere (norms and biases too), and ours
    with the same vision and merger weights copied by name."""
    ref = MiniCPMV4_6ForConditionalGeneration(_hf_config()).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if p.ndim == 1 else 0.0))
    ours = models.load("minicpm-v-4.6", config=_hf_config().to_dict())
    state = {k.removeprefix("model."): v for k, v in ref.state_dict().items()
             if k.startswith(("model.vision_tower.", "model.merger."))}
    assert set(state) == set(ours.state_dict())
    ours.load_state_dict(state)
    return ref, ours


def _hf_processor(**kwargs: object) -> MiniCPMV4_6ImageProcessorPil:
    return MiniCPMV4_6ImageProcessorPil(**kwargs)


def _vllm_layout(hf_out: dict, patch: int = 14) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM 0.33's re-layout of one call's fused output: slices split by h·w·P and zero-padded
    to the longest, ``(n, C, P, L_max)``; sizes as int64."""
    sizes = hf_out["target_sizes"].long()
    fused = hf_out["pixel_values"][0]
    parts = torch.split(fused, (sizes[:, 0] * sizes[:, 1] * patch).tolist(), dim=-1)
    out = torch.zeros(len(parts), *fused.shape[:2], max(p.shape[-1] for p in parts))
    for i, p in enumerate(parts):
        out[i, ..., :p.shape[-1]] = p
    return out, sizes


def _reference(ref: MiniCPMV4_6ForConditionalGeneration, frames: list[np.ndarray],
               mode: str, **kwargs: object) -> torch.Tensor:
    """transformers end to end: its PIL processor, then get_image_features (one call)."""
    hf = _hf_processor()([Image.fromarray(f) for f in frames], downsample_mode=mode,
                         return_tensors="pt", **kwargs)
    with torch.no_grad():
        feats = ref.model.get_image_features(hf["pixel_values"], hf["target_sizes"],
                                             downsample_mode=mode).pooler_output
    return torch.cat(feats)


# -- processor ----------------------------------------------------------------------------


@pytest.mark.parametrize(("resolution", "mode"), [(SMALL, "16x"), (448, "4x")],
                         ids=["res112-16x", "res448-4x"])
def test_processor_matches_transformers_after_vllm_relayout(mode: str, resolution: int) -> None:
    model = models.load("minicpm-v-4.6")
    if resolution == SMALL:
        frames = [_rgb(h, w, i) for i, ((h, w), _) in enumerate(IMAGES.values())]
        frames.append(_rgb(37, 211, 9))  # extreme aspect ratio
    else:  # unsliced, 1×2, 3×2
        frames = [_rgb(300, 420, 1), _rgb(500, 700, 2), _rgb(1200, 900, 3)]
    out = model.processor(images=frames, downsample_mode=mode, scale_resolution=resolution,
                          **FLOAT_EXACT)
    assert set(out) == {"pixel_values", "tgt_sizes", "use_vit_merger"}
    grids = set()
    for i, f in enumerate(frames):
        hf = _hf_processor()([Image.fromarray(f)], downsample_mode=mode,
                             scale_resolution=resolution, return_tensors="pt")
        pixels, sizes = _vllm_layout(hf)
        grids.add(tuple(hf["grids"][0]))
        assert out["pixel_values"][i].dtype == torch.float32
        assert out["tgt_sizes"][i].dtype == torch.int64
        assert torch.equal(out["tgt_sizes"][i], sizes), i
        assert torch.equal(out["pixel_values"][i], pixels), i
    assert out["use_vit_merger"].tolist() == [[mode == "16x"]] * len(frames)
    # Unsliced and several grid shapes are all exercised.
    assert (0, 0) in grids and len(grids) >= (5 if resolution == SMALL else 3)


def test_processor_options_match_transformers_kwargs() -> None:
    model = models.load("minicpm-v-4.6")
    f = _rgb(700, 600, 3)
    for kwargs in ({"max_slice_nums": 2}, {"max_slice_nums": 1}, {"scale_resolution": 224}):
        hf = _hf_processor()([Image.fromarray(f)], return_tensors="pt", **kwargs)
        out = model.processor(images=f, **kwargs, **FLOAT_EXACT)
        pixels, sizes = _vllm_layout(hf)
        assert torch.equal(out["tgt_sizes"][0], sizes) and torch.equal(out["pixel_values"][0],
                                                                        pixels), kwargs
    # Grey and RGBA input are converted to RGB first, as transformers does.
    for img in (Image.fromarray(_rgb(80, 120, 1)).convert("L"),
                Image.fromarray(np.dstack([_rgb(80, 120, 2), _rgb(80, 120, 3)[..., :1]]),
                                mode="RGBA")):
        hf = _hf_processor()([img], return_tensors="pt")
        assert torch.equal(model.processor(images=img, **FLOAT_EXACT)["pixel_values"][0],
                           _vllm_layout(hf)[0])


def test_video_is_processed_frame_by_frame_as_vllm_does() -> None:
    # vLLM 0.33 runs the image processor on each frame with the video slice limit and stacks
    # every frame's slices into one (Σ slices, C, P, L_max) tensor per video.
    model = models.load("minicpm-v-4.6")
    clip = np.stack([_rgb(150, 260, 10 + t) for t in range(3)])
    still = np.stack([_rgb(50, 70, 20 + t) for t in range(2)])
    out = model.processor(videos=[clip, still], scale_resolution=SMALL, **FLOAT_EXACT)
    assert set(out) == {"video_pixel_values", "video_tgt_sizes", "video_image_sizes",
                        "video_use_vit_merger"}
    for v, frames in enumerate((clip, still)):
        parts = [_vllm_layout(_hf_processor()([Image.fromarray(f)], scale_resolution=SMALL,
                                              return_tensors="pt")) for f in frames]
        longest = max(p.shape[-1] for p, _ in parts)
        want = torch.cat([torch.nn.functional.pad(p, (0, longest - p.shape[-1]))
                          for p, _ in parts])
        assert torch.equal(out["video_pixel_values"][v], want)
        assert torch.equal(out["video_tgt_sizes"][v], torch.cat([s for _, s in parts]))
        h, w = frames.shape[1:3]
        assert out["video_image_sizes"][v].tolist() == [[w, h]] * len(frames)
    assert out["video_tgt_sizes"][0].shape[0] == 3 * 4  # sliced frames: source + 1×3
    assert out["video_use_vit_merger"].tolist() == [[True], [True]]


def test_preprocessor_config_sets_the_processor(tmp_path: Path) -> None:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"max_slice_nums": 2, "scale_resolution": 224, "downsample_mode": "4x",
         "image_mean": [0.4, 0.5, 0.6], "image_std": [0.2, 0.3, 0.4]}))
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"max_slice_nums": 1}))
    model = MiniCPMV46.from_config(None, tmp_path)
    assert model.processor_config == ProcessorConfig(
        max_slice_nums=2, video_max_slice_nums=1, scale_resolution=224, downsample_mode="4x",
        image_mean=(0.4, 0.5, 0.6), image_std=(0.2, 0.3, 0.4))
    f = _rgb(700, 600, 3)
    hf = _hf_processor(max_slice_nums=2, scale_resolution=224, downsample_mode="4x",
                       image_mean=[0.4, 0.5, 0.6], image_std=[0.2, 0.3, 0.4])(
        [Image.fromarray(f)], return_tensors="pt")
    out = model.processor(images=[f], videos=[f[None]], **FLOAT_EXACT)
    assert torch.equal(out["pixel_values"][0], _vllm_layout(hf)[0])
    assert out["use_vit_merger"].tolist() == [[False]]
    assert out["video_tgt_sizes"][0].shape[0] == 1  # the video limit: no slicing
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"downsample_mode": "8x"}))
    with pytest.raises(ArgumentError):
        MiniCPMV46.from_config(None, tmp_path)


def test_processor_inputs_and_errors() -> None:
    model = models.load("minicpm-v-4.6")
    assert model.processor(images=[]) == {}
    with pytest.raises(ArgumentError):
        model.processor(images=[_rgb(56, 56, 0)], min_pixels=3)
    with pytest.raises(ArgumentError):
        model.processor(images=[_rgb(56, 56, 0)], downsample_mode="2x")
    with pytest.raises(ArgumentError):
        model.processor(audios=[np.zeros(10)])
    with pytest.raises(MediaError) as e:
        model.processor(images=[_rgb(56, 56, 0), b"junk"])
    assert e.value.source == "item 1"


# -- encoder ------------------------------------------------------------------------------


def _encode(model: MiniCPMV46, outputs: dict) -> torch.Tensor:
    """Split and batch as the runtime does, then encode (one batch per modality)."""
    batches = mf.batch_items(mf.split_items(outputs, model.field_specs(outputs)))
    assert len(batches) == 1
    with torch.no_grad():
        return model.encode(**batches[0].data)


BRANCHES = [(case, "16x") for case in IMAGES] + [
    (case, "4x") for case in ("upscaled-unsliced", "sliced-1x2", "sliced-4x1-tall")]


@pytest.mark.parametrize(("case", "mode"), BRANCHES, ids=[f"{c}-{m}" for c, m in BRANCHES])
def test_encoder_matches_transformers_per_slicing_branch(pair, case: str, mode: str) -> None:
    ref, ours = pair
    (h, w), (rows, cols) = IMAGES[case]
    frames = [_rgb(h, w, 0)]
    kwargs = {"max_slice_nums": 4} if case == "sliced-at-max_slice_nums" else {}
    want = _reference(ref, frames, mode, scale_resolution=SMALL, **kwargs)
    out = ours.processor(images=frames, scale_resolution=SMALL, downsample_mode=mode, **kwargs,
                         **EXACT)
    assert len(out["tgt_sizes"][0]) == 1 + rows * cols
    got = _encode(ours, out)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_encoder_matches_transformers_on_a_batch_of_larger_slices(pair) -> None:
    # Several images of different sizes in one call at scale_resolution 224: slices of up to
    # 16×16 patches over a 5×5 position table, so buckets repeat unevenly.
    ref, ours = pair
    frames = [_rgb(h, w, i) for i, (h, w) in enumerate([(250, 350), (150, 200)])]
    want = _reference(ref, frames, "16x", scale_resolution=224)
    got = _encode(ours, ours.processor(images=frames, scale_resolution=224, **EXACT))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_mixed_modes_in_one_batch_match_separate_reference_calls(pair) -> None:
    ref, ours = pair
    a, b = _rgb(230, 220, 1), _rgb(90, 500, 2)
    out16 = ours.processor(images=[a], scale_resolution=SMALL, **EXACT)
    out4 = ours.processor(images=[b], scale_resolution=SMALL, downsample_mode="4x", **EXACT)
    batch = mf.batch_items(mf.split_items(out16, ours.field_specs(out16)).in_order()
                           + mf.split_items(out4, ours.field_specs(out4)).in_order())
    assert len(batch) == 1
    with torch.no_grad():
        got = ours.encode(**batch[0].data)
    want = torch.cat([_reference(ref, [a], "16x", scale_resolution=SMALL),
                      _reference(ref, [b], "4x", scale_resolution=SMALL)])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("mode", ["16x", "4x"])
def test_encoder_matches_transformers_on_videos(pair, mode: str) -> None:
    # transformers' video processor needs torchvision; vLLM processes video frame by frame
    # with the image processor, so the reference is get_image_features on every frame's
    # slices (which is what get_video_features runs).
    ref, ours = pair
    clips = [np.stack([_rgb(150, 260, 10 + t) for t in range(2)]),
             np.stack([_rgb(50, 70, 20 + t) for t in range(2)])]
    want = torch.cat([_reference(ref, list(c), mode, scale_resolution=SMALL) for c in clips])
    got = _encode(ours, ours.processor(videos=clips, scale_resolution=SMALL,
                                       downsample_mode=mode, **EXACT))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_tokens_per_item_counts_the_encoder_rows() -> None:
    model = models.load("minicpm-v-4.6")
    sizes = torch.tensor([[8, 12], [8, 8]])
    assert model.tokens_per_item({"tgt_sizes": sizes, "use_vit_merger": torch.tensor([True])}) \
        == 6 + 4
    assert model.tokens_per_item({"tgt_sizes": sizes, "use_vit_merger": torch.tensor([False])}) \
        == 24 + 16
    assert model.tokens_per_item({"video_tgt_sizes": sizes}) == 10  # the config's mode: 16x
    with pytest.raises(ContractError):
        model.tokens_per_item({"pixel_values": torch.zeros(1)})


# -- checkpoint ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, pair) -> Path:
    """transformers' model saved by save_pretrained (sharded), with its image processor."""
    ref, _ = pair
    folder = tmp_path_factory.mktemp("minicpm")
    ref.save_pretrained(folder, max_shard_size="40KB")
    _hf_processor(max_slice_nums=4, scale_resolution=SMALL).save_pretrained(folder)
    return folder


def test_save_pretrained_checkpoint_loads_by_name_and_matches(saved: Path, pair) -> None:
    ref, ours = pair
    assert (saved / "model.safetensors.index.json").is_file()
    loaded = models.load("minicpm-v-4.6", weights=saved)
    state, want = loaded.state_dict(), ours.state_dict()
    assert state.keys() == want.keys()
    assert all(torch.equal(state[k], want[k]) for k in state)
    assert loaded.processor_config.max_slice_nums == 4
    assert loaded.processor_config.scale_resolution == SMALL
    frame = _rgb(700, 600, 5)
    got = _encode(loaded, loaded.processor(images=[frame], **EXACT))
    want = _reference(ref, [frame], "16x", max_slice_nums=4, scale_resolution=SMALL)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_config_is_validated() -> None:
    good = _hf_config().to_dict()
    assert VisionConfig.from_dict(good).text_hidden_size == TEXT["hidden_size"]
    for bad in ({**good, "model_type": "qwen2_vl"},
                {**good, "insert_layer_id": 5},
                {**good, "text_config": {}},
                {**good, "vision_config": {**good["vision_config"], "num_attention_heads": 5}},
                {**good, "vision_config": {**good["vision_config"], "hidden_act": "relu"}}):
        with pytest.raises(ArgumentError):
            models.load("minicpm-v-4.6", config=bad)


# -- contract and placement ---------------------------------------------------------------


def test_field_specs_name_exactly_the_present_fields() -> None:
    model = models.load("minicpm-v-4.6")
    out = model.dummy_inputs()
    specs = model.field_specs(out)
    assert set(specs) == set(out)
    host = {"tgt_sizes", "use_vit_merger", "video_tgt_sizes", "video_image_sizes",
            "video_use_vit_merger"}
    assert {k for k, s in specs.items() if s.placement == "host"} == host
    assert all(specs[k].kind == "batched" for k in specs)
    # Dummy images 0 and 1: one 4×4 slice, and five (1 token each after both 2×2 merges).
    embeds = {"image_embeds": torch.zeros(1 + 5, model.hidden_size),
              "tgt_sizes": out["tgt_sizes"][:2], "use_vit_merger": out["use_vit_merger"][:2]}
    specs = model.field_specs(embeds)
    assert specs["image_embeds"].sizes == (1, 5)
    with torch.no_grad():
        assert model.encode(**embeds) is embeds["image_embeds"]
    with pytest.raises(ContractError, match="tgt_sizes"):
        model.field_specs({"pixel_values": out["pixel_values"]})


def test_dummy_inputs_cover_both_modes_slicing_and_video() -> None:
    model = models.load("minicpm-v-4.6")
    d = model.dummy_inputs()
    slices = [len(s) for s in d["tgt_sizes"]]
    assert slices[0] == 1 and max(slices) > 1
    assert d["use_vit_merger"].all() and not d["video_use_vit_merger"].any()
    assert [len(s) for s in d["video_image_sizes"]] == [2, 3]


def test_check_item_refuses_values_that_disagree_with_the_sizes() -> None:
    model = models.load("minicpm-v-4.6")
    d = model.dummy_inputs()
    items = mf.split_items(d, model.field_specs(d))
    good = items["image"][1]
    model.check_item(good)
    model.check_item(items["video"][1])
    sizes = good["tgt_sizes"]
    for field, data in (
        ("pixel_values", {**good, "pixel_values": good["pixel_values"][:-1]}),
        ("pixel_values", {**good, "pixel_values": good["pixel_values"][..., :-14]}),
        ("tgt_sizes", {**good, "tgt_sizes": sizes + 2}),  # not a multiple of 4 in 16x
        ("tgt_sizes", {**good, "tgt_sizes": sizes.float()}),
        ("use_vit_merger", {**good, "use_vit_merger": torch.tensor([True, False])}),
        ("video_image_sizes", {**items["video"][1],
                               "video_image_sizes": torch.tensor([[1, 1]] * 4)}),
    ):
        with pytest.raises(ContractError) as e:
            model.check_item(data)
        assert e.value.field == field


def _line_of(fragment: str) -> str:
    """``file:line`` of the one source line of the model module holding ``fragment``."""
    lines, _ = inspect.getsourcelines(minicpm_v4_6)
    hits = [i + 1 for i, line in enumerate(lines) if fragment in line]
    assert len(hits) == 1, hits
    path = Path(minicpm_v4_6.__file__).resolve()
    rel = path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path
    return f"{rel}:{hits[0]}"


@pytest.fixture(scope="module")
def batches():
    model = models.load("minicpm-v-4.6")
    d = model.dummy_inputs()
    return model, {b.modality: b for b in mf.batch_items(mf.split_items(d, model.field_specs(d)))}


def test_contract_audits_clean_on_a_simulated_device(batches) -> None:
    model, by_modality = batches
    for b in by_modality.values():
        report = mf.audit.audit(model.encode, b.data, b.specs)
        assert report.ok and report.findings == [], report


@pytest.mark.parametrize(("modality", "field", "line"), [
    ("image", "tgt_sizes", "rows = [v.tolist() for v in value]"),
    ("video", "video_tgt_sizes", "rows = [v.tolist() for v in value]"),
    ("image", "use_vit_merger", "flags = value.reshape(-1).tolist()"),
    ("video", "video_use_vit_merger", "flags = value.reshape(-1).tolist()"),
])
def test_host_field_on_the_device_is_a_host_sync_at_its_read(batches, modality: str,
                                                               field: str, line: str) -> None:
    model, by_modality = batches
    b = by_modality[modality]
    wrong = {**b.specs, field: mf.FieldSpec.batched(modality)}
    report = mf.audit.audit(model.encode, b.data, wrong)
    assert not report.ok
    assert {f.kind for f in report.findings} == {"host_sync"}
    assert all(f.fields == (field,) for f in report.findings)
    assert {f.location for f in report.findings} == {_line_of(line)}
    if field == "tgt_sizes":
        assert mf.audit.recommend(model.encode, b.data, wrong)[field] == mf.Placement.HOST


@pytest.mark.parametrize(("modality", "field"), [("image", "pixel_values"),
                                                 ("video", "video_pixel_values")])
def test_pixels_on_the_host_are_a_device_mismatch_at_the_patch_embedding(
        batches, modality: str, field: str) -> None:
    model, by_modality = batches
    b = by_modality[modality]
    wrong = {**b.specs, field: mf.FieldSpec.batched(modality, placement="host")}
    report = mf.audit.audit(model.encode, b.data, wrong)
    assert {f.kind for f in report.findings} == {"device_mismatch"}
    assert {f.location for f in report.findings} == {
        _line_of("x = F.linear(flat.index_select(0, gather_d)")}


def test_video_frame_sizes_are_not_read_by_the_encoder(batches) -> None:
    # video_image_sizes only sizes the prompt (vLLM's placeholder text); any placement of it
    # audits clean because the encoder never touches it.
    model, by_modality = batches
    b = by_modality["video"]
    wrong = {**b.specs, "video_image_sizes": mf.FieldSpec.batched("video")}
    assert mf.audit.audit(model.encode, b.data, wrong).ok



def test_encode_rejects_malformed_batches() -> None:
    model = models.load("minicpm-v-4.6")
    d = model.dummy_inputs()
    px, sizes, flags = d["pixel_values"], d["tgt_sizes"], d["use_vit_merger"]
    with pytest.raises(ContractError, match="pixel_values"):
        model.encode(pixel_values=px[:2], tgt_sizes=sizes, use_vit_merger=flags)
    with pytest.raises(ContractError) as e:
        model.encode(pixel_values=px)
    assert e.value.field == "tgt_sizes"
    with pytest.raises(ContractError, match="exactly one of image or video"):
        model.encode(pixel_values=px, tgt_sizes=sizes, video_tgt_sizes=sizes)
    with pytest.raises(ContractError) as e:  # 2×2 grids cannot go through two 2×2 merges
        model.encode(pixel_values=px, tgt_sizes=[s // 2 for s in sizes], use_vit_merger=flags)
    assert e.value.field == "tgt_sizes"
    empty = model.encode(pixel_values=[], tgt_sizes=[], use_vit_merger=torch.zeros(0, 1))
    assert empty.shape == (0, model.hidden_size)


def test_bfloat16_stays_close_to_float32() -> None:
    model = models.load("minicpm-v-4.6")
    half = models.load("minicpm-v-4.6", dtype="bfloat16")
    d = {k: v for k, v in model.dummy_inputs().items() if not k.startswith("video")}
    with torch.no_grad():
        got, want = half.encode(**d), model.encode(**d)
    assert got.dtype == torch.bfloat16
    # bfloat16 keeps 8 mantissa bits; a few layers of rounding stay within a few percent.
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.05)


# -- uint8 pixels -------------------------------------------------------------------------


def _real(pixels: torch.Tensor, sizes: torch.Tensor) -> list[torch.Tensor]:
    """Each slice's real columns (its h·w patches), without the padding to the longest."""
    return [pixels[i, ..., :int(h * w) * 14] for i, (h, w) in enumerate(sizes.tolist())]


@pytest.mark.parametrize("resize_mode", ["fast", "exact"])
def test_uint8_levels_normalise_to_the_float32_output(resize_mode: str) -> None:
    model = models.load("minicpm-v-4.6")
    frames = [_rgb(60, 90, 0), _rgb(230, 220, 1), _rgb(90, 500, 2)]
    clip = np.stack([_rgb(150, 260, 10 + t) for t in range(2)])
    kwargs = {"scale_resolution": SMALL, "resize_mode": resize_mode}
    levels = model.processor(images=frames, videos=[clip], **kwargs)
    floats = model.processor(images=frames, videos=[clip], pixel_dtype="float32", **kwargs)
    specs, float_specs = model.field_specs(levels), model.field_specs(floats)
    a, b = model.normalize.affine()
    for name, sizes_name in (("pixel_values", "tgt_sizes"), ("video_pixel_values",
                                                           "video_tgt_sizes")):
        assert specs[name].normalize == model.normalize and float_specs[name].normalize is None
        assert torch.equal(levels[sizes_name][0], floats[sizes_name][0])
        for u8, f32, sizes in zip(levels[name], floats[name], levels[sizes_name], strict=True):
            assert u8.dtype == torch.uint8 and f32.dtype == torch.float32
            assert u8.shape == f32.shape and u8.shape[:3] == (len(sizes), 3, 14)
            normalised = (u8.double() * a.view(3, 1, 1) + b.view(3, 1, 1)).float()
            for got, want in zip(_real(normalised, sizes), _real(f32, sizes), strict=True):
                assert (got - want).abs().max() <= 1e-6
            # Padding is zero levels (and zero in float32): the encoder never reads it.
            real = sum(x.numel() for x in _real(u8, sizes))
            assert int(u8.count_nonzero()) <= real and int(f32.count_nonzero()) <= real
            assert u8.sum() == sum(x.sum() for x in _real(u8, sizes))
    assert model.normalize == mf.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5), 1 / 255)


def test_uint8_embeddings_equal_the_float32_path(pair) -> None:
    _, ours = pair
    # Unsliced, padded source, padded slices; a sliced and an unsliced clip.
    frames = [_rgb(h, w, i) for i, (h, w) in enumerate([(60, 90), (120, 230), (90, 500)])]
    clips = [np.stack([_rgb(150, 260, 10 + t) for t in range(2)]),
             np.stack([_rgb(50, 70, 20 + t) for t in range(3)])]
    for mode in ("16x", "4x"):
        for media in ({"images": frames}, {"videos": clips}):
            kwargs = {**media, "scale_resolution": SMALL, "downsample_mode": mode}
            levels = ours.processor(**kwargs)
            floats = ours.processor(**kwargs, pixel_dtype="float32")
            got, want = _encode(ours, levels), _encode(ours, floats)
            assert got.shape == want.shape and got.shape[0] > 10
            assert (got - want).abs().max() <= 1e-5, (mode, list(media))


def test_uint8_padding_is_not_read(pair) -> None:
    # The folded bias makes level 0 stand for -1, not 0: were padding read, it would count.
    _, ours = pair
    # A 1×2 image pads its source (4×12 patches to 8×8), a 1×5 one its slices (8×8 to 4×20).
    out = ours.processor(images=[_rgb(120, 230, 1), _rgb(90, 500, 2)], scale_resolution=SMALL)
    want = _encode(ours, out)
    noisy = []
    for p, sizes in zip(out["pixel_values"], out["tgt_sizes"], strict=True):
        q = torch.full_like(p, 255)
        for i, real in enumerate(_real(p, sizes)):
            q[i, ..., :real.shape[-1]] = real
        assert (q != p).sum() >= 14 * 14 * 3 * 16  # 16 patches or more
        noisy.append(q)
    torch.testing.assert_close(_encode(ours, {**out, "pixel_values": noisy}), want,
                               atol=0, rtol=0)


def test_fast_resize_matches_transformers_torchvision_processor() -> None:
    pytest.importorskip("torchvision")
    from transformers.models.minicpmv4_6.image_processing_minicpmv4_6 import (
        MiniCPMV4_6ImageProcessor,
    )

    model = models.load("minicpm-v-4.6")
    tv, pil = MiniCPMV4_6ImageProcessor(), _hf_processor()
    ours_diff, theirs_diff = [], []
    for i, (h, w) in enumerate([(300, 420), (500, 700), (900, 600), (100, 700)]):
        img = Image.fromarray(photo_like(h, w, i))
        fast = model.processor(images=img, pixel_dtype="float32", resize_mode="fast")
        exact = model.processor(images=img, pixel_dtype="float32", resize_mode="exact")
        sizes = fast["tgt_sizes"][0]
        fused = {k: torch.cat(_real(o["pixel_values"][0], sizes), -1)
                 for k, o in (("fast", fast), ("exact", exact))}
        hf_fast = tv([img], return_tensors="pt")
        hf_pil = pil([img], return_tensors="pt")
        assert torch.equal(hf_fast["target_sizes"].long(), sizes)
        # Same pixels; the float arithmetic differs (transformers folds the rescale into the
        # mean and std) by a rounding of float32.
        assert (fused["fast"] - hf_fast["pixel_values"][0]).abs().max() <= 1e-6
        assert torch.equal(fused["exact"], hf_pil["pixel_values"][0])

        def levels(x: torch.Tensor) -> torch.Tensor:
            return x.double() * 127.5 + 127.5

        ours_diff.append((levels(fused["fast"]) - levels(fused["exact"])).abs())
        theirs_diff.append((levels(hf_fast["pixel_values"][0])
                            - levels(hf_pil["pixel_values"][0])).abs())
    ours_all, theirs_all = torch.cat([d.flatten() for d in ours_diff]), \
        torch.cat([d.flatten() for d in theirs_diff])
    # The two resamplers differ by rounding (a level or two), never by content.
    assert 0 < ours_all.max() <= theirs_all.max() + 1e-6 and ours_all.max() <= 3
    assert ours_all.mean() <= theirs_all.mean() + 1e-6


def test_uint8_items_need_the_models_normalisation() -> None:
    model = models.load("minicpm-v-4.6")
    out = model.processor(images=[_rgb(230, 220, 1)], videos=[np.stack([_rgb(50, 70, 2)] * 2)],
                          scale_resolution=SMALL)
    specs = model.field_specs(out)
    for name, modality in (("pixel_values", "image"), ("video_pixel_values", "video")):
        good = mf.split_items(out, specs)[modality][0]
        model.check_item(good)
        for wrong in (None, mf.Normalize((0.48145466, 0.4578275, 0.40821073),
                                         (0.26862954, 0.26130258, 0.27577711))):
            bad_specs = {**specs, name: mf.FieldSpec.batched(modality, normalize=wrong)}
            bad = mf.split_items(out, bad_specs)[modality][0]
            with pytest.raises(ContractError) as e:
                model.check_item(bad)
            assert e.value.field == name
        with pytest.raises(ContractError) as e:  # a plain mapping says nothing of its levels
            model.check_item(dict(good))
        assert e.value.field == name
        with pytest.raises(ContractError) as e:  # neither levels nor values
            model.check_item({**good, name: good[name].to(torch.int16)})
        assert e.value.field == name
    # A float32 item needs no normalisation.
    floats = model.processor(images=[_rgb(230, 220, 1)], pixel_dtype="float32")
    model.check_item(mf.split_items(floats, model.field_specs(floats))["image"][0])


def test_runner_refuses_uint8_items_of_another_normalisation() -> None:
    model = models.load("minicpm-v-4.6")
    out = model.processor(images=[_rgb(230, 220, 1)], scale_resolution=SMALL)
    specs = {**model.field_specs(out),
             "pixel_values": mf.FieldSpec.batched("image", normalize=mf.Normalize((0.5,) * 3,
                                                                                  (0.25,) * 3))}
    runner = mf.EncoderRunner(model, device="cpu")
    good = mf.split_items(out, model.field_specs(out))["image"][0]
    bad = mf.split_items(out, specs)["image"][0]
    got = runner.encode([bad, good])
    assert got[0] is None and got[1] is not None and runner.last.status[0] == "error"
    assert isinstance(runner.last.errors[0], ContractError)
    assert runner.last.errors[0].field == "pixel_values"


@pytest.mark.parametrize(("option", "value"), [("pixel_dtype", "float16"),
                                               ("resize_mode", "nearest")])
def test_pixel_options_are_checked_before_media_is_read(option: str, value: str) -> None:
    model = models.load("minicpm-v-4.6")
    with pytest.raises(ArgumentError) as e:
        model.processor(images=[b"not an image"], **{option: value})
    assert e.value.argument == option
