"""Ernie4.5-VL: processor and encoder against transformers, checkpoint loading, contract,
placement."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from transformers import Ernie4_5_VLMoeConfig, Ernie4_5_VLMoeForConditionalGeneration
from transformers.models.ernie4_5_vl_moe.image_processing_pil_ernie4_5_vl_moe import (
    Ernie4_5_VLMoeImageProcessorPil,
)

import mmferry as mf
import mmferry.models as models
from mmferry.errors import ArgumentError, ContractError, MediaError
from mmferry.media import samples
from mmferry.models import ernie4_5_vl
from mmferry.models.ernie4_5_vl import Ernie45VL

# Small but faithful: the real patch 14 / merge 2 / temporal merge 2, 2 heads of 24 (6 rotary
# frequencies per axis), a non-default rotary base and epsilons, so a wrong read would show.
VISION = dict(depth=2, hidden_size=48, intermediate_size=96, num_heads=2, rms_norm_eps=1e-5,
              rope_parameters={"rope_type": "axial", "rope_theta": 5000.0})
TEXT = dict(hidden_size=40, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, moe_intermediate_size=[32, 16], moe_num_experts=2, moe_k=1,
            vocab_size=64, rms_norm_eps=1e-4,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0,
                             "mrope_section": [2, 2, 6]})
SMALL = dict(min_pixels=28 * 28, max_pixels=28 * 28 * 64)
# transformers' values: normalised float32, Pillow's resize (the PIL image processor's pixels)
# or torch's uint8 resize (the torchvision image and video processors' pixels).
EXACT = dict(pixel_dtype="float32", resize_mode="exact")
FAST = dict(pixel_dtype="float32", resize_mode="fast")

# float32 on both sides; the differences are summation order only (frames of one length share
# one batched SDPA call; for still images the temporal merge's [x, x] @ [A | B]^T runs as
# x @ (A + B)^T). Observed: max |diff| ~2e-6 on outputs of magnitude ~3 (a few float32 ulps).
# A real mistake (rotary base, pairing order, an epsilon) moves outputs by 1e-3 or more.
ATOL, RTOL = 1e-4, 1e-5


def _rgb(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _clip(t: int, h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (t, h, w, 3), dtype=np.uint8)


def _random_reference() -> Ernie4_5_VLMoeForConditionalGeneration:
    """transformers' model with random encoder weights everywhere (norms and biases too)."""
    ref = Ernie4_5_VLMoeForConditionalGeneration(
        Ernie4_5_VLMoeConfig(vision_config=VISION, text_config=TEXT)).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if ".vision_tower." in name or ".resampler_model." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if p.ndim == 1 else 0.0))
    return ref


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder written by transformers' save_pretrained (sharded), with the image
    processor's preprocessor_config.json at small bounds."""
    folder = tmp_path_factory.mktemp("ernie")
    _random_reference().save_pretrained(folder, max_shard_size="100KB")
    Ernie4_5_VLMoeImageProcessorPil(
        size={"shortest_edge": SMALL["min_pixels"], "longest_edge": SMALL["max_pixels"]}
    ).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def pair(checkpoint: Path) -> tuple[Ernie4_5_VLMoeForConditionalGeneration, Ernie45VL]:
    """The reference loaded from the folder, and ours loaded from it by name."""
    ref = Ernie4_5_VLMoeForConditionalGeneration.from_pretrained(checkpoint).eval()
    return ref, models.load("ernie4.5-vl", weights=checkpoint)


def _image_reference(ref, out) -> torch.Tensor:
    with torch.no_grad():
        feats = ref.model.get_image_features(out["pixel_values"], out["image_grid_thw"])
    return torch.cat(feats.pooler_output)


def _video_reference(ref, out) -> torch.Tensor:
    with torch.no_grad():
        feats = ref.model.get_video_features(out["pixel_values_videos"], out["video_grid_thw"])
    return torch.cat(feats.pooler_output)


# -- processor ---------------------------------------------------------------------------


@pytest.mark.parametrize("bounds", [SMALL, {}], ids=["small-bounds", "default-bounds"])
def test_image_processor_matches_transformers_pil_bit_for_bit(bounds: dict[str, int]) -> None:
    model = models.load("ernie4.5-vl")
    # Up- and down-scaling, extreme aspect ratios, odd sizes, no resize, grey and alpha input.
    images: list[object] = [_rgb(h, w, i) for i, (h, w) in enumerate(
        [(56, 56), (100, 60), (37, 211), (140, 84), (9, 13), (300, 17), (28, 28 * 9)])]
    images.append(Image.fromarray(_rgb(50, 70, 9)).convert("L"))
    rgba = np.dstack([_rgb(64, 48, 10), _rgb(64, 48, 11)[..., :1]])
    images.append(Image.fromarray(rgba, mode="RGBA"))
    size = {"shortest_edge": bounds["min_pixels"], "longest_edge": bounds["max_pixels"]} \
        if bounds else None
    ref = Ernie4_5_VLMoeImageProcessorPil(**({"size": size} if size else {}))(
        images=images, return_tensors="pt")
    out = model.processor(images=images, **bounds, **EXACT)
    assert set(out) == {"pixel_values", "image_grid_thw"}
    assert out["pixel_values"].dtype == torch.float32 and out["pixel_values"].shape[1] == 588
    assert out["image_grid_thw"].dtype == torch.int64
    assert out["image_grid_thw"][:, 0].tolist() == [1] * len(images)
    assert torch.equal(out["image_grid_thw"], ref["image_grid_thw"])
    assert torch.equal(out["pixel_values"], ref["pixel_values"])


def _video_transcription(frames: np.ndarray, min_pixels: int, max_pixels: int,
                         max_frames: int = 180) -> tuple[torch.Tensor, list[int]]:
    """transformers' Ernie4_5_VLMoeVideoProcessor (draw_on_frames=False) step by step, in
    torch, as it runs on a CPU: its frame sampling, last-frame padding, torchvision's
    bicubic resize of uint8 (which calls interpolate on the uint8 tensor), the fused
    rescale-and-normalise, and its patch permutation. (That class needs torchvision, which
    the test extra lacks; test_fast_is_transformers_torchvision_and_stays_close_to_exact
    compares with the class itself where torchvision is installed.)"""
    from transformers.models.ernie4_5_vl_moe.image_processing_pil_ernie4_5_vl_moe import (
        smart_resize,
    )

    video = torch.from_numpy(frames)
    total = video.shape[0]
    num = min(max(total, 16), max_frames, total)
    video = video[torch.arange(0, total, total / num).int()]
    video = video.permute(0, 3, 1, 2).contiguous()
    if video.shape[0] % 2:
        video = torch.cat((video, video[-1:].clone()))
    h, w = smart_resize(video.shape[2], video.shape[3], 28, min_pixels, max_pixels)
    if (h, w) != tuple(video.shape[2:]):
        video = F.interpolate(video, size=[h, w], mode="bicubic", align_corners=False,
                              antialias=True)
    mean = torch.tensor(ernie4_5_vl.CLIP_MEAN) * (1.0 / (1 / 255.0))
    std = torch.tensor(ernie4_5_vl.CLIP_STD) * (1.0 / (1 / 255.0))
    x = (video.to(torch.float32) - mean[:, None, None]) / std[:, None, None]
    t, gh, gw = x.shape[0], h // 14, w // 14
    x = x.view(t, 3, gh // 2, 2, 14, gw // 2, 2, 14).permute(0, 2, 5, 3, 6, 1, 4, 7)
    return x.reshape(t * gh * gw, 3 * 14 * 14), [t, gh, gw]


@pytest.mark.parametrize(("shapes", "bounds"), [
    ([(3, 70, 100)], dict(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 40)),  # odd, upscale
    ([(4, 200, 90), (2, 33, 250)], dict(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 40)),
    ([(1, 64, 64), (5, 300, 400)], dict(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 40)),
    ([(4, 56, 84)], {}),  # the default bounds upscale to >= 299 merge blocks
    ([(190, 30, 40)], dict(min_pixels=28 * 28, max_pixels=28 * 28 * 4)),  # > max_frames
], ids=["odd-frames", "two-sizes", "one-frame-and-downscale", "default-bounds", "sampled"])
def test_video_processor_matches_the_transformers_video_path(shapes, bounds) -> None:
    model = models.load("ernie4.5-vl")
    clips = [_clip(t, h, w, i) for i, (t, h, w) in enumerate(shapes)]
    out = model.processor(videos=clips, **bounds, **FAST)
    pc = model.processor_config
    lo, hi = bounds.get("min_pixels", pc.video_min_pixels), bounds.get("max_pixels",
                                                                       pc.video_max_pixels)
    want = [_video_transcription(c, lo, hi) for c in clips]
    assert set(out) == {"pixel_values_videos", "video_grid_thw"}
    assert out["video_grid_thw"].tolist() == [g for _, g in want]
    assert all(t % 2 == 0 and t <= 180 for t, _, _ in out["video_grid_thw"].tolist())
    assert torch.equal(out["pixel_values_videos"], torch.cat([p for p, _ in want]))


def _normalised(levels: torch.Tensor, normalize: mf.Normalize) -> torch.Tensor:
    """uint8 rows ``[n, C·P·P]`` (channel-major columns) to the values they stand for."""
    a, b = normalize.affine()
    x = levels.view(levels.shape[0], len(a), -1).double() * a[:, None] + b[:, None]
    return x.view(levels.shape).float()


PHOTOS = [(448, 448), (300, 200), (97, 131), (64, 300)]


@pytest.mark.parametrize("resize_mode", ["fast", "exact"])
def test_uint8_levels_stand_for_the_float32_values(resize_mode: str) -> None:
    model = models.load("ernie4.5-vl")
    images = [samples.photo_like(h, w, seed=i) for i, (h, w) in enumerate(PHOTOS)]
    clips = [samples.video_like(3, 70, 100, seed=5), samples.video_like(2, 56, 84, seed=6)]
    bounds = dict(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 200)
    levels = model.processor(images=images, videos=clips, **bounds, resize_mode=resize_mode)
    floats = model.processor(images=images, videos=clips, **bounds, resize_mode=resize_mode,
                             pixel_dtype="float32")
    specs = model.field_specs(levels)
    for values, grid in (("pixel_values", "image_grid_thw"),
                         ("pixel_values_videos", "video_grid_thw")):
        assert levels[values].dtype == torch.uint8 and floats[values].dtype == torch.float32
        assert levels[values].shape == floats[values].shape
        assert torch.equal(levels[grid], floats[grid])
        assert specs[values].normalize == model.normalize
        # The same levels, normalised here in float64 rather than by a float32 table.
        got = _normalised(levels[values], specs[values].normalize)
        assert (got - floats[values]).abs().max() <= 1e-6
    # The odd clip's padding frame repeats its last frame's rows.
    t, gh, gw = levels["video_grid_thw"][0].tolist()
    frame = gh * gw
    assert t == 4 and torch.equal(levels["pixel_values_videos"][3 * frame:4 * frame],
                                  levels["pixel_values_videos"][2 * frame:3 * frame])


def _levels_diff(a: torch.Tensor, b: torch.Tensor, normalize: mf.Normalize) -> tuple[float, float]:
    """Max and mean |a - b| in pixel levels, for uint8 levels or normalised values."""
    if a.dtype == torch.uint8:
        d = (a.int() - b.int()).abs().float()
    else:  # undo the normalisation: one level is scale / std of a normalised unit
        a_, _ = normalize.affine()
        d = (a - b).abs().view(a.shape[0], len(a_), -1).double() / a_[:, None]
    return d.max().item(), d.mean().item()


def test_fast_is_transformers_torchvision_and_stays_close_to_exact() -> None:
    pytest.importorskip("torchvision")
    from transformers.models.ernie4_5_vl_moe.image_processing_ernie4_5_vl_moe import (
        Ernie4_5_VLMoeImageProcessor,
    )
    from transformers.models.ernie4_5_vl_moe.video_processing_ernie4_5_vl_moe import (
        Ernie4_5_VLMoeVideoProcessor,
    )

    model = models.load("ernie4.5-vl")
    # Photo-like images at sizes that down- and up-scale, and a random one.
    images = [Image.fromarray(samples.photo_like(h, w, seed=i))
              for i, (h, w) in enumerate([(768, 1024), (300, 200), (97, 131), (1080, 700)])]
    images.append(Image.fromarray(_rgb(120, 90, 3)))
    tv = Ernie4_5_VLMoeImageProcessor()(images=images, return_tensors="pt")
    pil = Ernie4_5_VLMoeImageProcessorPil()(images=images, return_tensors="pt")
    fast = model.processor(images=images, **FAST)
    assert torch.equal(fast["image_grid_thw"], tv["image_grid_thw"])
    assert torch.equal(fast["pixel_values"], tv["pixel_values"])
    clips = [samples.video_like(3, 70, 100, seed=1), samples.video_like(4, 200, 90, seed=2)]
    video = Ernie4_5_VLMoeVideoProcessor(draw_on_frames=False)(videos=clips, return_tensors="pt")
    frames = model.processor(videos=clips, **FAST)
    assert torch.equal(frames["video_grid_thw"], video["video_grid_thw"])
    assert torch.equal(frames["pixel_values_videos"], video["pixel_values_videos"])
    # fast vs exact in pixel levels, ours on uint8 and transformers' torchvision vs PIL
    # processors on their normalised output: the same pixels, so the same difference.
    ours = _levels_diff(model.processor(images=images)["pixel_values"],
                        model.processor(images=images, resize_mode="exact")["pixel_values"],
                        model.normalize)
    theirs = _levels_diff(tv["pixel_values"], pil["pixel_values"], model.normalize)
    print(f"fast vs exact, levels: ours max {ours[0]:.0f} mean {ours[1]:.4f}; transformers "
          f"torchvision vs PIL max {theirs[0]:.3f} mean {theirs[1]:.4f}")
    assert 0 < ours[0] <= theirs[0] + 1e-3 and ours[1] <= theirs[1] + 1e-4


def _drawing_folder(folder: Path, draw: bool = True) -> Path:
    """A checkpoint's processor files whose video processor draws timestamps with a font
    shipped beside them (Pillow's embedded TrueType font, so nothing is fetched)."""
    from PIL import ImageFont

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "font.ttf").write_bytes(ImageFont.load_default(size=10).font_bytes)
    (folder / "preprocessor_config.json").write_text(json.dumps({"size": {
        "shortest_edge": SMALL["min_pixels"], "longest_edge": SMALL["max_pixels"]}}))
    (folder / "video_preprocessor_config.json").write_text(json.dumps({
        "draw_on_frames": draw, "font": "font.ttf",
        "size": {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 64}}))
    return folder


def _processor_only(folder: Path) -> Ernie45VL:
    with torch.device("meta"):
        return Ernie45VL.from_config(None, folder)


def test_timestamps_are_drawn_when_the_checkpoint_asks(tmp_path: Path) -> None:
    drawing = _processor_only(_drawing_folder(tmp_path / "on", draw=True))
    plain = _processor_only(_drawing_folder(tmp_path / "off", draw=False))
    assert drawing.processor_config.timestamp_font == str(tmp_path / "on" / "font.ttf")
    assert plain.processor_config.timestamp_font is None
    # Flat grey frames: any difference is the drawn text, which must sit in the top-left.
    clip = np.full((3, 168, 224, 3), 128, dtype=np.uint8)
    drawn = drawing.processor(videos=[clip])
    bare = plain.processor(videos=[clip])
    assert torch.equal(drawn["video_grid_thw"], bare["video_grid_thw"])
    (t, gh, gw), = drawn["video_grid_thw"].tolist()
    changed = (drawn["pixel_values_videos"] != bare["pixel_values_videos"]).any(-1)
    # Rows are (frame, block row, block col, row in block, col in block): back to patch rows
    # and columns per frame.
    changed = changed.view(t, gh // 2, gw // 2, 2, 2).permute(0, 1, 3, 2, 4).reshape(t, gh, gw)
    assert changed[:, 0, 0].all()  # every frame (the padding copy too) has its timestamp
    # One line of text a tenth of the frame's shorter side high (168 px -> 16 px, with its
    # outline under 28 px: two patch rows), from the left edge, never the bottom-right.
    rows, cols = changed.any(0).nonzero(as_tuple=True)
    assert rows.max() < 2 and cols.min() == 0 and cols.max() < gw - 1
    assert not changed[:, 2:].any()
    # The timestamp depends on fps: frame 1 at 24 fps is 00.04 s, at 1 fps 01.00 s.
    assert not torch.equal(drawing.processor(videos=[clip], fps=1)["pixel_values_videos"],
                           drawn["pixel_values_videos"])
    with pytest.raises(ArgumentError) as e:
        drawing.processor(videos=[clip], fps=0)
    assert e.value.argument == "fps"


def test_timestamp_text_and_a_missing_font(tmp_path: Path) -> None:
    assert ernie4_5_vl._timestamp(0, 24.0) == "time: 00:00:00.00"
    assert ernie4_5_vl._timestamp(7, 24.0) == "time: 00:00:00.29"
    assert ernie4_5_vl._timestamp(3725, 1.0) == "time: 01:02:05.00"
    folder = _drawing_folder(tmp_path)
    (folder / "font.ttf").unlink()
    with pytest.raises(ArgumentError) as e:
        _processor_only(folder)
    assert e.value.argument == "font"


def test_processor_inputs_and_errors() -> None:
    model = models.load("ernie4.5-vl")
    one = model.processor(images=_rgb(56, 56, 0))
    assert one["image_grid_thw"].tolist() == [[1, 4, 4]]
    both = model.processor(images=[_rgb(56, 56, 0)], videos=[_clip(2, 56, 56, 1)], **SMALL)
    assert set(both) == {"pixel_values", "image_grid_thw", "pixel_values_videos",
                         "video_grid_thw"}
    frames = model.processor(videos=[Image.fromarray(f) for f in _clip(2, 56, 56, 1)], **SMALL)
    assert torch.equal(frames["pixel_values_videos"], both["pixel_values_videos"])
    assert model.processor(images=[]) == {}
    with pytest.raises(MediaError, match="aspect ratio") as e:
        model.processor(images=[_rgb(56, 56, 0), _rgb(2, 500, 1)])
    assert e.value.source == "item 1"
    with pytest.raises(MediaError) as e:
        model.processor(images=[_rgb(56, 56, 0), b"junk"])
    assert e.value.source == "item 1"
    with pytest.raises(ArgumentError) as e:
        model.processor(images=[_rgb(56, 56, 0)], num_frames=8)
    assert e.value.argument == "num_frames"
    with pytest.raises(ArgumentError):
        model.processor(audios=[np.zeros(16000)])


# -- encoder -----------------------------------------------------------------------------


@pytest.mark.parametrize("sizes", [[(56, 56)], [(100, 60), (37, 211), (140, 84)],
                                   [(56, 84), (56, 84), (84, 56)], [(28, 28 * 9), (300, 17)]],
                         ids=["one", "three-sizes", "repeated-size", "extreme-aspect"])
def test_encoder_matches_transformers_on_images(pair, sizes: list[tuple[int, int]]) -> None:
    ref, ours = pair
    images = [_rgb(h, w, i) for i, (h, w) in enumerate(sizes)]
    out = ours.processor(images=images, **SMALL)  # uint8 levels, folded into the first layer
    with torch.no_grad():
        got = ours.encode(**out)
    want = _image_reference(ref, ours.processor(images=images, **SMALL, **FAST))
    counts = [ours.tokens_per_item({"image_grid_thw": g}) for g in out["image_grid_thw"]]
    assert counts == [h * w // 4 for _, h, w in out["image_grid_thw"].tolist()]
    assert got.shape == want.shape == (sum(counts), TEXT["hidden_size"])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("shapes", [[(5, 56, 84), (2, 84, 84), (4, 60, 100)], [(8, 28, 56)],
                                    [(1, 84, 56), (2, 84, 56)]],
                         ids=["three-clips", "eight-frames", "one-frame-padded"])
def test_encoder_matches_transformers_on_videos(pair, shapes) -> None:
    ref, ours = pair
    clips = [_clip(*s, i) for i, s in enumerate(shapes)]
    out = ours.processor(videos=clips, **SMALL)
    with torch.no_grad():
        got = ours.encode(**out)
    want = _video_reference(ref, ours.processor(videos=clips, **SMALL, **FAST))
    grid = out["video_grid_thw"].tolist()
    counts = [ours.tokens_per_item({"video_grid_thw": torch.tensor(g)}) for g in grid]
    assert counts == [t * h * w // 8 for t, h, w in grid]
    assert got.shape == want.shape == (sum(counts), TEXT["hidden_size"])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_checkpoint_loads_by_name_reading_only_the_encoder(checkpoint: Path, pair) -> None:
    ref, ours = pair
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 2  # sharded
    saved = set(index["weight_map"])
    mapped = {k for k in saved if any(k.startswith(p) for p in Ernie45VL.checkpoint_prefixes)}
    # Exactly the vision tower and the resampler; never a language-model tensor.
    assert mapped and all(re.match(r"model\.(vision_model|resampler_model)\.", k) for k in mapped)
    assert len(mapped) == len(ours.state_dict())
    ref_state = ref.state_dict()
    ours_state = ours.state_dict()
    assert torch.equal(ours_state["vision_model.blocks.1.attn.qkv.weight"],
                       ref_state["model.vision_tower.blocks.1.attn.qkv.weight"])
    assert torch.equal(ours_state["resampler_model.temporal_linear.3.bias"],
                       ref_state["model.resampler_model.temporal_linear.ln.bias"])
    # config.json set the architecture, preprocessor_config.json the processor.
    assert ours.config.width == 48 and ours.config.hidden_size == 40
    assert ours.config.vision_eps == 1e-5 and ours.config.text_eps == 1e-4
    assert ours.config.rope_theta == 5000.0
    pc = ours.processor_config
    assert (pc.min_pixels, pc.max_pixels) == (SMALL["min_pixels"], SMALL["max_pixels"])


def test_in_memory_transformers_names_load_too(tmp_path: Path) -> None:
    # transformers' in-memory layout (model.vision_tower., resampler fc1/fc2/ln), as a
    # safetensors file written directly from its state dict.
    from safetensors.torch import save_file

    ref = _random_reference()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()
               if ".vision_tower." in k or ".resampler_model." in k}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(ref.config.to_dict()))
    ours = models.load("ernie4.5-vl", weights=tmp_path)
    out = ours.processor(images=[_rgb(56, 84, 0)], videos=[_clip(2, 56, 56, 1)], **SMALL,
                         **EXACT)
    with torch.no_grad():
        got = ours.encode(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
    torch.testing.assert_close(got, _image_reference(ref, out), atol=ATOL, rtol=RTOL)


def test_batch_equals_items_encoded_one_by_one(pair) -> None:
    _, ours = pair
    out = ours.processor(videos=[_clip(*s, i) for i, s in
                                 enumerate([(2, 56, 84), (4, 84, 56), (2, 56, 84)])], **SMALL)
    items = mf.split_items(out, ours.field_specs(out))["video"]
    with torch.no_grad():
        batch = ours.encode(**out)
        singles = [ours.encode(pixel_values_videos=it["pixel_values_videos"],
                               video_grid_thw=it["video_grid_thw"][None]) for it in items]
    counts = [ours.tokens_per_item(it) for it in items]
    assert [s.shape[0] for s in singles] == counts
    for got, want in zip(batch.split(counts), singles, strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("resize_mode", ["fast", "exact"])
def test_uint8_embeddings_equal_the_float32_path(pair, resize_mode: str) -> None:
    _, ours = pair
    images = [samples.photo_like(h, w, seed=i) for i, (h, w) in enumerate(PHOTOS)]
    clips = [samples.video_like(3, 70, 100, seed=5), samples.video_like(4, 56, 84, seed=6)]
    kwargs = dict(images=images, videos=clips, **SMALL, resize_mode=resize_mode)
    levels = ours.processor(**kwargs)
    floats = ours.processor(**kwargs, pixel_dtype="float32")
    assert levels["pixel_values"].dtype == torch.uint8
    worst = 0.0
    with torch.no_grad():
        for values, grid in (("pixel_values", "image_grid_thw"),
                             ("pixel_values_videos", "video_grid_thw")):
            got = ours.encode(**{values: levels[values], grid: levels[grid]})
            want = ours.encode(**{values: floats[values], grid: floats[grid]})
            assert got.shape == want.shape and got.shape[0] > 8
            worst = max(worst, (got - want).abs().max().item())
    print(f"uint8 vs float32 embeddings ({resize_mode}): max |diff| {worst:.1e}")
    assert worst <= 1e-5


def test_pixel_options_are_checked_before_media_is_read() -> None:
    model = models.load("ernie4.5-vl")
    for option, value in (("pixel_dtype", "float16"), ("pixel_dtype", torch.uint8),
                          ("resize_mode", "nearest")):
        with pytest.raises(ArgumentError) as e:  # not the MediaError the junk would give
            model.processor(images=[b"junk"], **{option: value})
        assert e.value.argument == option


def test_bfloat16_stays_close_to_float32(pair) -> None:
    _, ours = pair
    out = ours.processor(images=[_rgb(56, 84, 0)], **SMALL)
    half = models.load("ernie4.5-vl", config=ours_config(), dtype="bfloat16")
    half.load_state_dict(ours.state_dict())
    assert half.vision_model.blocks[0].attn.qkv.weight.dtype == torch.bfloat16
    with torch.no_grad():
        got, want = half.encode(**out), ours.encode(**out)
    assert got.dtype == torch.bfloat16
    # bfloat16 keeps 8 mantissa bits; two blocks and the resampler stay within a few percent.
    torch.testing.assert_close(got.float(), want, atol=0.1, rtol=0.05)


def ours_config() -> dict:
    return Ernie4_5_VLMoeConfig(vision_config=VISION, text_config=TEXT).to_dict()


# -- config ------------------------------------------------------------------------------


def test_config_layouts_and_bad_values() -> None:
    from mmferry.models.ernie4_5_vl import ErnieConfig

    hf = ErnieConfig.from_dict(ours_config())
    # The original (remote-code) layout of the published checkpoints.
    original = ErnieConfig.from_dict({
        "model_type": "ernie4_5_moe_vl", "hidden_size": 40, "rms_norm_eps": 1e-4,
        "spatial_conv_size": 2, "temporal_conv_size": 2,
        "vision_config": {"depth": 2, "embed_dim": 48, "hidden_size": 48, "mlp_ratio": 2,
                          "num_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 5000.0}})
    assert original == hf
    default = ErnieConfig.from_dict({"vision_config": {}})
    assert (default.width, default.depth, default.hidden_size) == (1280, 32, 2560)
    for bad, key in ((dict(hidden_size="48"), "hidden_size"), (dict(num_heads=5), "heads"),
                     (dict(hidden_act="swoosh"), "hidden_act"),
                     (dict(temporal_merge_size=3), "temporal_merge_size")):
        with pytest.raises(ArgumentError, match=key) as e:
            ErnieConfig.from_dict({"vision_config": {**VISION, **bad}})
        assert e.value.argument == "config"
    with pytest.raises(ArgumentError, match="model_type"):
        ErnieConfig.from_dict({"model_type": "qwen2_vl", "vision_config": {}})
    with pytest.raises(ArgumentError, match="vision_config"):
        models.load("ernie4.5-vl", config={"text_config": {}})


# -- contract ----------------------------------------------------------------------------


def test_field_specs_and_tokens() -> None:
    model = models.load("ernie4.5-vl")
    out = model.processor(images=[_rgb(56, 84, 0), _rgb(84, 112, 1)],
                          videos=[_clip(3, 56, 56, 2)], **SMALL)
    specs = model.field_specs(out)
    assert set(specs) == set(out)
    assert specs["image_grid_thw"].placement == specs["video_grid_thw"].placement == "host"
    assert specs["pixel_values"].sizes == (24, 48)
    assert specs["pixel_values_videos"].sizes == (64,)
    assert specs["pixel_values"].placement == "device"
    assert out["pixel_values"].dtype == out["pixel_values_videos"].dtype == torch.uint8
    assert specs["pixel_values"].normalize == specs["pixel_values_videos"].normalize \
        == mf.Normalize(ernie4_5_vl.CLIP_MEAN, ernie4_5_vl.CLIP_STD, 1 / 255) == model.normalize
    floats = model.field_specs(model.processor(images=[_rgb(56, 84, 0)], **SMALL, **EXACT))
    assert floats["pixel_values"].normalize is None
    with pytest.raises(ContractError, match="image_grid_thw"):
        model.field_specs({"pixel_values": out["pixel_values"]})
    assert model.tokens_per_item({"image_grid_thw": torch.tensor([1, 4, 6])}) == 6
    assert model.tokens_per_item({"video_grid_thw": torch.tensor([4, 4, 6])}) == 12
    with pytest.raises(ContractError):
        model.tokens_per_item({"pixel_values": torch.zeros(1)})


def test_encode_rejects_malformed_batches() -> None:
    model = models.load("ernie4.5-vl")
    d = {k: v for k, v in model.dummy_inputs().items() if k in ("pixel_values", "image_grid_thw")}
    with pytest.raises(ContractError, match="pixel_values"):
        model.encode(pixel_values=d["pixel_values"][:-1], image_grid_thw=d["image_grid_thw"])
    with pytest.raises(ContractError, match="one of image or video"):
        model.encode(**d, video_grid_thw=d["image_grid_thw"])
    with pytest.raises(ContractError, match="image_grid_thw"):
        model.encode(pixel_values=d["pixel_values"])
    with pytest.raises(ContractError) as e:  # a video grid with an odd frame count
        model.encode(pixel_values_videos=torch.zeros(48, 588),
                     video_grid_thw=torch.tensor([[3, 4, 4]]))
    assert e.value.field == "video_grid_thw"
    empty = model.encode(pixel_values=torch.zeros(0, 588),
                         image_grid_thw=torch.zeros(0, 3, dtype=torch.int64))
    assert empty.shape == (0, model.hidden_size)


def _small_items(model: Ernie45VL, pixel_dtype: str) -> mf.Items:
    out = model.processor(images=[_rgb(56, 84, 0), _rgb(84, 112, 1)],
                          videos=[_clip(4, 56, 56, 2), _clip(3, 56, 84, 3)],
                          min_pixels=56 * 56, max_pixels=28 * 28 * 16, pixel_dtype=pixel_dtype)
    return mf.split_items(out, model.field_specs(out))


@pytest.mark.parametrize("pixel_dtype", ["uint8", "float32"])
def test_check_item_refuses_rows_that_disagree_with_the_grid(pixel_dtype: str) -> None:
    model = models.load("ernie4.5-vl")
    items = _small_items(model, pixel_dtype)
    good = items["image"][0]
    model.check_item(good)
    model.check_item(items["video"][1])
    grid = good["image_grid_thw"]

    def item(**fields: torch.Tensor) -> mf.Item:  # the good item's specs, so uint8 stays valid
        return mf.Item("image", {**good, **fields}, good.specs)

    for field, data in (
        ("pixel_values", item(pixel_values=good["pixel_values"][:-4])),
        ("pixel_values", {**good, "pixel_values": good["pixel_values"].to(torch.int64)}),
        ("pixel_values", item(image_grid_thw=grid * torch.tensor([1, 1, 3]))),
        ("image_grid_thw", item(image_grid_thw=grid + torch.tensor([0, 0, 1]))),
        ("image_grid_thw", item(image_grid_thw=grid * torch.tensor([2, 1, 1]))),
        ("image_grid_thw", item(image_grid_thw=grid.float())),
    ):
        with pytest.raises(ContractError) as e:
            model.check_item(data)
        assert e.value.field == field


def test_check_item_refuses_uint8_pixels_of_another_normalisation() -> None:
    model = models.load("ernie4.5-vl")
    items = _small_items(model, "uint8")
    for modality, name in (("image", "pixel_values"), ("video", "pixel_values_videos")):
        good = items[modality][0]
        assert good.specs[name].normalize == model.normalize
        model.check_item(good)
        half = mf.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
        for normalize in (half, None):
            specs = {**good.specs, name: replace(good.specs[name], normalize=normalize)}
            with pytest.raises(ContractError, match="normalize") as e:
                model.check_item(mf.Item(modality, dict(good), specs))
            assert e.value.field == name
        # A bare mapping has no spec, so nothing says what its levels stand for.
        with pytest.raises(ContractError) as e:
            model.check_item(dict(good))
        assert e.value.field == name
        # The same uint8 item reaching the runner is refused there too, naming the field.
        wrong = mf.Item(modality, dict(good),
                        {**good.specs, name: replace(good.specs[name], normalize=half)})
        runner = mf.EncoderRunner(model)
        outs = runner.encode([wrong, good])
        assert outs[0] is None and outs[1].shape == (model.tokens_per_item(good), model.hidden_size)
        assert runner.last.errors[0].field == name


# -- placement ---------------------------------------------------------------------------


def _batches(model: Ernie45VL) -> dict[str, mf.Batch]:
    d = model.dummy_inputs()
    return {b.modality: b for b in mf.batch_items(mf.split_items(d, model.field_specs(d)))}


def _grid_read_line() -> str:
    """The model file's line that reads the grid on the host (``rows = grid.tolist()``)."""
    path = Path(ernie4_5_vl.__file__)
    lines = path.read_text().splitlines()
    (number,) = [i + 1 for i, line in enumerate(lines) if "rows = grid.tolist()" in line]
    return f"{path.name}:{number}"


@pytest.mark.parametrize("modality", ["image", "video"])
def test_grid_placement_flips(modality: str) -> None:
    model = models.load("ernie4.5-vl")
    batch = _batches(model)[modality]
    grid_name = f"{modality}_grid_thw"
    assert batch.specs[grid_name].placement == "host"
    assert mf.audit.audit(model.encode, batch.data, batch.specs).ok

    # host -> device: every host read of the grid becomes a sync, caught where it is read.
    on_device = {**batch.specs, grid_name: mf.FieldSpec.batched(modality)}
    report = mf.audit.audit(model.encode, batch.data, on_device)
    assert not report.ok
    assert {f.kind for f in report.findings} == {"host_sync"}
    assert all(f.fields == (grid_name,) for f in report.findings)
    assert {f.location.rsplit("/", 1)[-1] for f in report.findings} == {_grid_read_line()}

    # host -> both: runs clean (only the host side is read), and the audit's counterfactual
    # runs recommend host: no kernel ever needs the grid on the device.
    both = {**batch.specs, grid_name: mf.FieldSpec.batched(modality, placement="both")}
    assert mf.audit.audit(model.encode, batch.data, both).ok
    assert mf.audit.recommend(model.encode, batch.data, both)[grid_name] == mf.Placement.HOST


def test_grid_stays_on_the_host_and_pixels_on_the_device() -> None:
    # `meta` stands in for the accelerator: mixing a CPU tensor into a device op raises, and
    # reading a device value on the host raises, so a clean run shows the encoder reads the
    # grid only on the host and builds every device tensor from uploads.
    model = models.load("ernie4.5-vl").to("meta")
    d = model.dummy_inputs()
    for pixels, grid in (("pixel_values", "image_grid_thw"),
                         ("pixel_values_videos", "video_grid_thw")):
        out = model.encode(**{pixels: d[pixels].to("meta"), grid: d[grid]})
        assert out.device.type == "meta"
        assert out.shape[1] == model.hidden_size
        with pytest.raises(NotImplementedError):
            model.encode(**{pixels: d[pixels].to("meta"), grid: d[grid].to("meta")})
