"""Isaac: processor and encoder against reference pipelines, checkpoint names, placement.

Neither reference runs in the project environment: transformers 5.24 has no Isaac, and
vLLM (whose Isaac is the serving reference) is not a dependency. So:

* the resize sizes are checked against values computed by vLLM 0.33's
  ``get_image_size_for_max_num_patches`` (``vllm/transformers_utils/processors/isaac.py``);
* the pixels against vLLM's processing steps written out here one op at a time (torch's
  bilinear resize of the uint8 image, rescale, normalise, patchify), bit for bit;
* the embeddings against a plain per-image re-statement of vLLM's ``IsaacVisionEmbedding``
  (explicit softmax attention per image, per-image pixel shuffle by reshaping), and against
  transformers' own Siglip2 modules composed as transformers main's Isaac composes them
  (padded batch, masked ``Siglip2Encoder``, ``resize_positional_embeddings``);
* the checkpoint names against vLLM's ``hf_to_vllm_mapper`` for Isaac.

``benchmarks/parity_isaac.py`` runs vLLM's own classes against ours (in vLLM's environment):
processor bit-exact, embeddings max |diff| 0.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import mmferry as mf
import mmferry.models as models
from mmferry.errors import ArgumentError, CheckpointError, ContractError, MediaError
from mmferry.media.samples import photo_like as _photo
from mmferry.models.isaac import IsaacModel, target_size

# Small widths; the real patch size 16 and a 16×16 learned position grid, so the grid is
# resized both up and down; r = 2 as published.
VISION = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
              patch_size=16, num_patches=256, pixel_shuffle_scale_factor=2,
              hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)
CONFIG = {"model_type": "isaac", "hidden_size": 40, "vision_config": VISION}
SMALL = dict(max_num_patches=256, min_num_patches=64)

# Float32 on both sides; the remaining differences are summation order (batched SDPA against
# an explicit softmax or a masked padded batch). Observed 5e-6 to 7e-6 on outputs of
# magnitude ~14; a wrong position
# interpolation, shuffle order or activation moves them by 1e-2 or more.
ATOL, RTOL = 1e-4, 1e-5


@pytest.fixture(scope="module")
def model() -> IsaacModel:
    m = models.load("isaac", config=CONFIG)
    # Random everywhere (norms and biases too), so a misplaced parameter shows.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if p.ndim > 1 else 0.3)
                    + (1.0 if p.ndim == 1 else 0.0))
    return m


# -- processor ---------------------------------------------------------------------------

# (source h, w, patch, r, max, min) -> target (h, w), from vLLM 0.33's
# get_image_size_for_max_num_patches. Covers: kept (rounded up to the step), grown to the
# minimum, shrunk to the maximum, extreme aspect ratios, r = 1, no minimum.
VLLM_SIZES = [
    ((120, 200, 16, 2, 256, 64), (128, 224)),
    ((333, 97, 16, 2, 256, 64), (352, 128)),
    ((20, 31, 16, 2, 256, 64), (128, 160)),
    ((900, 700, 16, 2, 256, 64), (288, 224)),
    ((900, 700, 16, 2, 6144, 256), (928, 704)),
    ((120, 200, 16, 2, 6144, 256), (224, 352)),
    ((4000, 3000, 16, 2, 6144, 256), (1440, 1088)),
    ((30, 2000, 16, 2, 6144, 256), (32, 2048)),
    ((120, 200, 16, 1, 256, 64), (128, 208)),
    ((257, 129, 16, 1, 256, 64), (272, 144)),
    ((20, 31, 16, 2, 256, None), (32, 32)),
    ((1, 1, 16, 2, 6144, 256), (128, 128)),
    ((1080, 1920, 16, 2, 6144, 256), (928, 1664)),
    ((77, 1001, 14, 2, 1024, None), (84, 1008)),
]


@pytest.mark.parametrize(("args", "expected"), VLLM_SIZES)
def test_target_size_is_vllms(args: tuple, expected: tuple[int, int]) -> None:
    h, w, patch, r, max_n, min_n = args
    assert target_size(h, w, patch, r, max_n, min_n) == expected


def _patchify(t: torch.Tensor, patch: int) -> torch.Tensor:
    _, height, width, c = t.shape
    t = t.reshape(height // patch, patch, width // patch, patch, c).permute(0, 2, 1, 3, 4)
    return t.reshape(-1, patch * patch * c)


def _reference_resize(img: np.ndarray, size: tuple[int, int]) -> torch.Tensor:
    # vLLM's resize: HWC uint8 -> NCHW view -> bilinear (align_corners=False, no antialias)
    # on uint8 -> NHWC.
    t = torch.from_numpy(img.copy())[None].permute(0, 3, 1, 2)
    return F.interpolate(t, size=size, mode="bilinear", align_corners=False).permute(0, 2, 3, 1)


def _reference_pixels(img: np.ndarray, size: tuple[int, int], patch: int) -> torch.Tensor:
    # vLLM's steps: its resize -> float -> * (1/255) -> (x - 0.5) / 0.5 -> (h, P, w, P, C)
    # patches.
    half = torch.tensor([0.5, 0.5, 0.5], dtype=torch.float32).view(1, 1, 1, -1)
    return _patchify((_reference_resize(img, size).float() * (1 / 255) - half) / half, patch)


SOURCES = [(120, 200), (333, 97), (20, 31), (900, 700), (64, 64), (257, 129), (128, 224)]


@pytest.mark.parametrize("mode", ["exact", "fast"])
@pytest.mark.parametrize("bounds", [SMALL, {}], ids=["small-bounds", "default-bounds"])
def test_processor_matches_vllms_steps_bit_for_bit(model: IsaacModel, bounds: dict,
                                                   mode: str) -> None:
    # Isaac's reference resize is torch's, so both modes give its pixels.
    images = [_photo(h, w, i) for i, (h, w) in enumerate(SOURCES)]
    out = model.processor(images=images, pixel_dtype="float32", resize_mode=mode, **bounds)
    max_n, min_n = bounds.get("max_num_patches", 6144), bounds.get("min_num_patches", 256)
    sizes = [target_size(h, w, 16, 2, max_n, min_n) for h, w in SOURCES]
    assert out["image_grid_thw"].dtype == torch.int64
    assert out["image_grid_thw"].tolist() == [[1, h // 16, w // 16] for h, w in sizes]
    expected = torch.cat([_reference_pixels(img, s, 16) for img, s in zip(images, sizes, strict=True)])
    assert out["pixel_values"].dtype == torch.float32
    assert torch.equal(out["pixel_values"], expected)
    # Every grid side is a multiple of r, every count within the bounds.
    for _, gh, gw in out["image_grid_thw"].tolist():
        assert gh % 2 == 0 and gw % 2 == 0 and min_n <= gh * gw <= max_n
    assert model.field_specs(out)["pixel_values"].normalize is None


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_uint8_levels_are_the_reference_pixels_before_normalising(model: IsaacModel,
                                                                  mode: str) -> None:
    images = [_photo(h, w, i) for i, (h, w) in enumerate(SOURCES)]
    out = model.processor(images=images, resize_mode=mode, **SMALL)  # uint8 by default
    levels = out["pixel_values"]
    sizes = [target_size(h, w, 16, 2, 256, 64) for h, w in SOURCES]
    assert levels.dtype == torch.uint8
    assert levels.shape == (sum(h * w // 256 for h, w in sizes), 16 * 16 * 3)
    assert torch.equal(levels, torch.cat([_patchify(_reference_resize(img, s), 16)
                                          for img, s in zip(images, sizes, strict=True)]))
    spec = model.field_specs(out)["pixel_values"]
    assert spec.normalize == model.normalize == mf.Normalize((0.5,) * 3, (0.5,) * 3)
    # The levels read with the spec's normalisation are the float32 output of the same mode.
    a, b = spec.normalize.affine()  # one value per channel: the innermost column
    normalised = (levels.view(len(levels), -1, 3).double() * a + b).float().view_as(levels)
    floats = model.processor(images=images, pixel_dtype="float32", resize_mode=mode, **SMALL)
    assert torch.equal(out["image_grid_thw"], floats["image_grid_thw"])
    assert (normalised - floats["pixel_values"]).abs().max() <= 1e-6


def test_processor_takes_every_source_kind_and_refuses_bad_input(model: IsaacModel,
                                                                 tmp_path: Path) -> None:
    from PIL import Image

    img = _photo(50, 70, 0)
    path = tmp_path / "a.png"
    Image.fromarray(img).save(path)
    outs = [model.processor(images=x, **SMALL) for x in (img, Image.fromarray(img), path,
                                                           path.read_bytes(), [img])]
    assert all(torch.equal(o["pixel_values"], outs[0]["pixel_values"]) for o in outs)
    assert model.processor(images=[]) == {} and model.processor() == {}
    with pytest.raises(ArgumentError) as e:
        model.processor(images=img, max_pixels=10)
    assert e.value.argument == "max_pixels"
    with pytest.raises(ArgumentError) as e:
        model.processor(videos=[[img]])
    assert e.value.argument == "videos"
    # The pixel options are checked before any media is read, too.
    for option, value in (("pixel_dtype", "float16"), ("resize_mode", "nearest"),
                          ("pixel_dtype", None)):
        with pytest.raises(ArgumentError) as e:
            model.processor(images=b"never read", **{option: value})
        assert e.value.argument == option
    # Bounds are checked before any media is read: a minimum that would blow a small image
    # up past the reference's 60-megapixel input ceiling is refused.
    for option, value in (("max_num_patches", 0), ("min_num_patches", 60_000_000 // 256 + 1),
                          ("min_num_patches", 2.5)):
        with pytest.raises(ArgumentError) as e:
            model.processor(images=b"never read", **{option: value})
        assert e.value.argument == option
    h, w = target_size(50, 70, 16, 2, 16, 4)
    assert model.processor(images=img, min_num_patches=4, max_num_patches=16)[
        "image_grid_thw"].tolist() == [[1, h // 16, w // 16]]
    with pytest.raises(MediaError) as e:
        model.processor(images=[img, b"not an image"])
    assert e.value.source == "item 1"


# -- encoder -----------------------------------------------------------------------------


def _reference_encode(model: IsaacModel, pixels: torch.Tensor, grid: list) -> torch.Tensor:
    """vLLM's IsaacVisionEmbedding restated per image, from the state dict by checkpoint
    name: explicit softmax attention, per-image antialiased position resize, pixel shuffle
    by reshaping each image's (h/r, r, w/r, r) blocks."""
    cfg = model.config
    sd = {k.removeprefix("vision_embedding."): v for k, v in model.state_dict().items()}
    d, heads, r = cfg.hidden_size, cfg.num_attention_heads, cfg.pixel_shuffle_scale_factor
    side = math.isqrt(cfg.num_patches)
    table = sd["0.embeddings.position_embedding.weight"].reshape(side, side, d).permute(2, 0, 1)

    def ln(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (d,), sd[f"{name}.weight"], sd[f"{name}.bias"], cfg.layer_norm_eps)

    def lin(x: torch.Tensor, name: str) -> torch.Tensor:
        return x @ sd[f"{name}.weight"].T + sd.get(f"{name}.bias", 0)

    outs, start = [], 0
    for _, h, w in grid:
        x = lin(pixels[start:start + h * w], "0.embeddings.patch_embedding")
        start += h * w
        pos = F.interpolate(table[None], size=(h, w), mode="bilinear", align_corners=False,
                            antialias=True)[0]
        x = x + pos.reshape(d, h * w).T
        for i in range(cfg.num_hidden_layers):
            p = f"0.encoder.layers.{i}"
            y = ln(x, f"{p}.layer_norm1")
            q, k, v = (lin(y, f"{p}.self_attn.{n}_proj").view(h * w, heads, -1).transpose(0, 1)
                       for n in "qkv")
            att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(d // heads), dim=-1)
            x = x + lin((att @ v).transpose(0, 1).reshape(h * w, d), f"{p}.self_attn.out_proj")
            y = F.gelu(lin(ln(x, f"{p}.layer_norm2"), f"{p}.mlp.fc1"), approximate="tanh")
            x = x + lin(y, f"{p}.mlp.fc2")
        x = ln(x, "0.post_layernorm")
        x = x.view(h // r, r, w // r, r, d).permute(0, 2, 1, 3, 4).reshape(-1, r * r * d)
        outs.append(lin(F.silu(lin(x, "1")), "3"))
    return torch.cat(outs)


@pytest.mark.parametrize("sources", [
    [(120, 200)],                              # one image, grid larger than the table
    [(20, 31), (333, 97), (900, 700)],         # grown / tall / shrunk
    [(120, 200), (64, 64), (120, 200)],        # a repeated size: the position gather
    [(64, 64), (64, 64)],                      # equal lengths: one batched attention call
], ids=["one", "mixed", "repeated", "equal"])
def test_encoder_matches_the_reference(model: IsaacModel, sources: list) -> None:
    images = [_photo(h, w, i) for i, (h, w) in enumerate(sources)]
    levels, d = _processed(model, images)
    grid = d["image_grid_thw"].tolist()
    with torch.no_grad():
        ref = _reference_encode(model, d["pixel_values"], grid)
        for out in (model.encode(**d), model.encode(**levels)):
            assert out.shape == (sum(h * w // 4 for _, h, w in grid), 40)
            torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


def _processed(model: IsaacModel, images: list, **options) -> tuple[dict, dict]:
    """The processor's uint8 output (the default) and its float32 output."""
    return (model.processor(images=images, **SMALL, **options),
            model.processor(images=images, pixel_dtype="float32", **SMALL, **options))


def test_uint8_embeddings_equal_the_float32_path(model: IsaacModel) -> None:
    # Grown, tall, shrunk, a repeated size, equal lengths: one batch of several sizes. The
    # folded first layer changes only float32 rounding: observed 8.6e-6 on outputs ~13
    # (the float32 path itself is 7e-6 from float64 there); a wrong fold (mean, scale,
    # channel order) moves them by 1e-2 or more.
    sources = [(20, 31), (333, 97), (900, 700), (120, 200), (64, 64), (120, 200), (64, 64)]
    levels, floats = _processed(model, [_photo(h, w, i) for i, (h, w) in enumerate(sources)])
    with torch.no_grad():
        a, b = model.encode(**levels), model.encode(**floats)
    assert a.shape == b.shape == (levels["image_grid_thw"].prod(-1).sum() // 4, 40)
    assert (a - b).abs().max() <= 1e-5
    # And through split, wire, batch and transfer: the spec's normalisation comes along.
    items = mf.wire.decode(mf.wire.encode(mf.split_items(levels, model.field_specs(levels))))
    (batch,) = mf.batch_items(items)
    assert batch.specs["pixel_values"].normalize == model.normalize
    moved = mf.Transfer("cpu").to_device(batch)
    assert moved["pixel_values"].dtype == torch.uint8
    with torch.no_grad():
        assert torch.equal(model.encode(**moved), a)


def _transformers_encode(model: IsaacModel, pixels: torch.Tensor, grid: list) -> torch.Tensor:
    """The encoder as transformers main's Isaac composes it from transformers' own Siglip2
    modules (here 5.24's): images padded to one batch, Siglip2VisionEmbeddings'
    resize_positional_embeddings (a matmul form of the antialiased bilinear resize),
    Siglip2Encoder under a bidirectional padding mask, post-LayerNorm, then the per-image
    pixel shuffle and the SiLU projector restated."""
    from transformers.masking_utils import create_bidirectional_mask
    from transformers.models.siglip2.configuration_siglip2 import Siglip2VisionConfig
    from transformers.models.siglip2.modeling_siglip2 import (
        Siglip2Encoder,
        Siglip2VisionEmbeddings,
    )

    cfg = model.config
    hf = Siglip2VisionConfig(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_channels=cfg.num_channels, patch_size=cfg.patch_size, num_patches=cfg.num_patches,
        hidden_act=cfg.hidden_act, layer_norm_eps=cfg.layer_norm_eps)
    hf._attn_implementation = "sdpa"
    sd = {k.removeprefix("vision_embedding."): v for k, v in model.state_dict().items()}
    encoder = Siglip2Encoder(hf).eval()
    encoder.load_state_dict({k.removeprefix("0.encoder."): v for k, v in sd.items()
                             if k.startswith("0.encoder.")})
    d, r, side = cfg.hidden_size, cfg.pixel_shuffle_scale_factor, math.isqrt(cfg.num_patches)
    lengths = [h * w for _, h, w in grid]
    longest = max(lengths)
    padded = torch.zeros(len(grid), longest, pixels.shape[1])
    mask = torch.zeros(len(grid), longest, dtype=torch.long)
    for i, chunk in enumerate(pixels.split(lengths)):
        padded[i, :len(chunk)], mask[i, :len(chunk)] = chunk, 1
    x = F.linear(padded, sd["0.embeddings.patch_embedding.weight"],
                 sd["0.embeddings.patch_embedding.bias"])
    x = x + Siglip2VisionEmbeddings.resize_positional_embeddings(
        sd["0.embeddings.position_embedding.weight"].reshape(side, side, d),
        torch.tensor([[h, w] for _, h, w in grid]), max_length=longest)
    x = encoder(inputs_embeds=x, attention_mask=create_bidirectional_mask(
        config=hf, inputs_embeds=x, attention_mask=mask)).last_hidden_state
    x = F.layer_norm(x, (d,), sd["0.post_layernorm.weight"], sd["0.post_layernorm.bias"],
                     cfg.layer_norm_eps)
    outs = [x[i, :h * w].view(h // r, r, w // r, r, d).permute(0, 2, 1, 3, 4).reshape(-1, r * r * d)
            for i, (_, h, w) in enumerate(grid)]
    return F.linear(F.silu(F.linear(torch.cat(outs), sd["1.weight"])), sd["3.weight"])


def test_encoder_matches_transformers_siglip2_modules(model: IsaacModel) -> None:
    images = [_photo(h, w, i) for i, (h, w) in enumerate([(20, 31), (333, 97), (120, 200)])]
    levels, d = _processed(model, images)
    grid = d["image_grid_thw"].tolist()
    assert len({h * w for _, h, w in grid}) == 3  # unequal lengths: padding is masked
    with torch.no_grad():
        ref = _transformers_encode(model, d["pixel_values"], grid)
        for out in (model.encode(**d), model.encode(**levels)):
            torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


def test_no_shuffle_when_r_is_one() -> None:
    config = {"hidden_size": 24, "vision_config": {**VISION, "pixel_shuffle_scale_factor": 1,
                                                   "num_patches": 64, "hidden_size": 32}}
    m = models.load("isaac", config=config)
    assert m.state_dict()["vision_embedding.1.weight"].shape == (128, 32)
    levels, d = _processed(m, [_photo(100, 60, 0), _photo(40, 90, 1)])
    grid = d["image_grid_thw"].tolist()
    assert any(h % 2 or w % 2 for _, h, w in grid)  # odd grids: only multiples of P needed
    with torch.no_grad():
        ref = _reference_encode(m, d["pixel_values"], grid)
        for out in (m.encode(**d), m.encode(**levels)):
            torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


def test_bfloat16_stays_close_to_float32(model: IsaacModel) -> None:
    levels, d = _processed(model, [_photo(120, 200, 0), _photo(64, 64, 1)])
    half = models.load("isaac", config=CONFIG, dtype=torch.bfloat16)
    half.load_state_dict(model.state_dict())
    with torch.no_grad():
        full = model.encode(**d)
        for low in (half.encode(**d), half.encode(**levels)):  # levels: folded in bfloat16
            assert low.dtype == torch.bfloat16
            assert (low.float() - full).abs().max() < 0.05 * full.abs().max()


def test_tokens_specs_and_check_item(model: IsaacModel) -> None:
    d = model.processor(images=[_photo(120, 200, 0), _photo(333, 97, 1)], **SMALL)
    specs = model.field_specs(d)
    assert set(specs) == {"pixel_values", "image_grid_thw"}
    assert specs["image_grid_thw"].placement == mf.Placement.HOST
    items = mf.split_items(d, specs)["image"]
    # Tokens per image h·w / r², as vLLM's prompt replacement counts them.
    assert [model.tokens_per_item(i) for i in items] == [
        h * w // 4 for _, h, w in d["image_grid_thw"].tolist()]
    for item in items:
        model.check_item(item)
    good = items[0]
    grid = good["image_grid_thw"]
    for field, bad in (
        ("pixel_values", {**good, "pixel_values": good["pixel_values"][:-1]}),
        ("pixel_values", {**good, "pixel_values": good["pixel_values"].to(torch.int64)}),
        ("image_grid_thw", {**good, "image_grid_thw": grid + torch.tensor([0, 0, 1])}),
        ("image_grid_thw", {**good, "image_grid_thw": grid * torch.tensor([2, 1, 1])}),
        ("image_grid_thw", {**good, "image_grid_thw": grid.float()}),
        ("image_embeds", {**good, "image_embeds": torch.zeros(1, 40)}),
    ):
        with pytest.raises(ContractError) as e:
            model.check_item(bad)
        assert e.value.field == field
    with pytest.raises(ContractError) as e:
        model.encode(pixel_values=d["pixel_values"][:-1], image_grid_thw=d["image_grid_thw"])
    assert e.value.field == "pixel_values"
    with pytest.raises(ContractError) as e:
        model.encode(pixel_values=d["pixel_values"])
    assert e.value.field == "image_grid_thw"


def test_uint8_pixels_need_the_models_normalisation(model: IsaacModel) -> None:
    levels, floats = _processed(model, [_photo(120, 200, 0)])
    specs = model.field_specs(levels)
    model.check_item(mf.split_items(levels, specs)["image"][0])
    model.check_item(mf.split_items(floats, model.field_specs(floats))["image"][0])
    assert model.field_specs(floats)["pixel_values"].normalize is None
    n = len(levels["pixel_values"])
    clip = mf.Normalize((0.48145466, 0.4578275, 0.40821073),
                        (0.26862954, 0.26130258, 0.27577711))
    for normalize in (clip, mf.Normalize((0.5,) * 3, (0.5,) * 3, scale=1 / 256), None):
        wrong = mf.split_items(levels, {**specs, "pixel_values": mf.FieldSpec.flat_from_sizes(
            "image", [n], normalize=normalize)})["image"][0]
        with pytest.raises(ContractError) as e:
            model.check_item(wrong)
        assert e.value.field == "pixel_values"
        runner = mf.EncoderRunner(model)
        assert runner.encode([wrong]) == [None]
        assert runner.last.errors[0].field == "pixel_values"
    # A plain mapping has no spec, so its levels have no normalisation either.
    with pytest.raises(ContractError) as e:
        model.check_item(dict(mf.split_items(levels, specs)["image"][0]))
    assert e.value.field == "pixel_values"


# -- checkpoints -------------------------------------------------------------------------


def _vllm_checkpoint_keys(layers: int) -> set[str]:
    # The names vLLM's IsaacForConditionalGeneration.hf_to_vllm_mapper reads the encoder from:
    # model.vision_embedding.{0 -> transformer, 1 -> linear_fc1, 3 -> linear_fc2}, with the
    # transformer's q/k/v_proj stacked by Siglip2VisionTransformer's mapper.
    tower = ["embeddings.patch_embedding.weight", "embeddings.patch_embedding.bias",
             "embeddings.position_embedding.weight", "post_layernorm.weight",
             "post_layernorm.bias"]
    for i in range(layers):
        for part in ("layer_norm1", "layer_norm2", "self_attn.q_proj", "self_attn.k_proj",
                     "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2"):
            tower += [f"encoder.layers.{i}.{part}.weight", f"encoder.layers.{i}.{part}.bias"]
    return ({f"model.vision_embedding.0.{k}" for k in tower}
            | {"model.vision_embedding.1.weight", "model.vision_embedding.3.weight"})


def _write_checkpoint(folder: Path, model: IsaacModel, *, sharded: bool) -> None:
    folder.mkdir()
    state = {f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}
    assert set(state) == _vllm_checkpoint_keys(VISION["num_hidden_layers"])
    # Language-model tensors the encoder must not read.
    state["model.text_model.embed_tokens.weight"] = torch.zeros(8, 40)
    state["lm_head.weight"] = torch.zeros(8, 40)
    (folder / "config.json").write_text(json.dumps({
        **CONFIG, "architectures": ["IsaacForConditionalGeneration"], "pixel_shuffle_scale": 2,
        "vision_max_num_patches": 6144, "vision_min_num_patches": 256}))
    if not sharded:
        save_file(state, str(folder / "model.safetensors"))
        return
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[::2],
              "model-00002-of-00002.safetensors": keys[1::2]}
    for name, names in shards.items():
        save_file({k: state[k] for k in names}, str(folder / name))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: name for name, names in shards.items() for k in names}}))


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_checkpoint_folder_loads_by_name(model: IsaacModel, tmp_path: Path,
                                         sharded: bool) -> None:
    folder = tmp_path / "isaac"
    _write_checkpoint(folder, model, sharded=sharded)
    loaded = mf.models.load("isaac", weights=folder)
    assert loaded.hidden_size == 40 and loaded.config == model.config
    d = model.processor(images=[_photo(120, 200, 0), _photo(20, 31, 1)], **SMALL)
    with torch.no_grad():
        assert torch.equal(loaded.encode(**d), model.encode(**d))


def test_preprocessor_config_sets_the_bounds(model: IsaacModel, tmp_path: Path) -> None:
    folder = tmp_path / "isaac"
    _write_checkpoint(folder, model, sharded=False)
    default = mf.models.load("isaac", weights=folder, materialize=False)
    assert (default.processor_config.max_num_patches,
            default.processor_config.min_num_patches) == (6144, 256)
    (folder / "preprocessor_config.json").write_text(json.dumps(
        {"patch_size": 16, "pixel_shuffle_scale": 2, "max_num_patches": 100,
         "min_num_patches": 40}))
    m = mf.models.load("isaac", weights=folder, materialize=False)
    grid = m.processor(images=[_photo(900, 700, 0), _photo(20, 31, 1)])["image_grid_thw"]
    assert [list(g) for g in grid.tolist()] == [
        [1, h // 16, w // 16] for h, w in (target_size(900, 700, 16, 2, 100, 40),
                                          target_size(20, 31, 16, 2, 100, 40))]
    for bad, key in (({"patch_size": 14}, "patch_size"),
                     ({"min_num_patches": 10**9}, "min_num_patches"),
                     ({"max_num_patches": "many"}, "max_num_patches")):
        (folder / "preprocessor_config.json").write_text(json.dumps(bad))
        with pytest.raises(ArgumentError, match=key) as e:
            mf.models.load("isaac", weights=folder, materialize=False)
        assert e.value.argument == "config"


def test_bad_configs_name_the_key(tmp_path: Path) -> None:
    for config, key in (
        ({"vision_config": VISION}, "hidden_size"),
        ({**CONFIG, "hidden_size": True}, "hidden_size"),
        ({**CONFIG, "vision_config": [1]}, "vision_config"),
        ({**CONFIG, "vision_config": {**VISION, "num_patches": 200}}, "vision_config.num_patches"),
        ({**CONFIG, "vision_config": {**VISION, "num_attention_heads": 5}},
         "vision_config.hidden_size"),
        ({**CONFIG, "vision_config": {**VISION, "hidden_act": "relu6"}},
         "vision_config.hidden_act"),
        ({**CONFIG, "vision_config": {**VISION, "patch_size": "16"}}, "vision_config.patch_size"),
        ({**CONFIG, "vision_config": {**VISION, "layer_norm_eps": -1}},
         "vision_config.layer_norm_eps"),
        ({**CONFIG, "model_type": "qwen2_vl"}, "model_type"),
    ):
        with pytest.raises(ArgumentError, match=key) as e:
            models.load("isaac", config=config)
        assert e.value.argument == "config"
    # Text width from text_config when the top level has none.
    m = models.load("isaac", config={"text_config": {"hidden_size": 24}, "vision_config": VISION},
                    materialize=False)
    assert m.hidden_size == 24
    folder = tmp_path / "bad"
    model = models.load("isaac", config=CONFIG)
    _write_checkpoint(folder, model, sharded=False)
    (folder / "config.json").write_text(json.dumps(
        {**CONFIG, "vision_config": {**VISION, "num_hidden_layers": 1}}))
    with pytest.raises(CheckpointError, match="unexpected"):
        mf.models.load("isaac", weights=folder)


# -- placement ---------------------------------------------------------------------------


def _line_of(snippet: str) -> str:
    source = Path(models.__file__).parent / "isaac.py"
    lines = [i for i, text in enumerate(source.read_text().splitlines(), 1) if snippet in text]
    assert len(lines) == 1, (snippet, lines)
    return f"isaac.py:{lines[0]}"


def _batch():
    m = models.load("isaac")
    d = m.dummy_inputs()
    (batch,) = mf.batch_items(mf.split_items(d, m.field_specs(d)))
    return m, batch


def test_grid_on_the_device_is_a_host_sync_at_the_grid_read() -> None:
    m, batch = _batch()
    wrong = {**batch.specs, "image_grid_thw": mf.FieldSpec.batched("image")}
    report = mf.audit.audit(m.encode, batch.data, wrong)
    assert not report.ok
    assert {f.kind for f in report.findings} == {"host_sync"}
    assert all(f.fields == ("image_grid_thw",) for f in report.findings)
    assert {f.location.rsplit("/", 1)[-1] for f in report.findings} == {
        _line_of("rows = grid.tolist()")}
    assert mf.audit.recommend(m.encode, batch.data, wrong) == {
        "pixel_values": mf.Placement.DEVICE, "image_grid_thw": mf.Placement.HOST}


def test_grid_on_both_sides_is_clean_but_host_is_enough() -> None:
    # The encoder reads the host side (host_and_device) and uploads what it derives, so a
    # device copy of the grid is never used: `both` runs clean, the audit recommends `host`.
    m, batch = _batch()
    both = {**batch.specs, "image_grid_thw": mf.FieldSpec.batched("image", placement="both")}
    report = mf.audit.audit(m.encode, batch.data, both)
    assert report.ok and report.findings == []
    assert mf.audit.recommend(m.encode, batch.data, both)["image_grid_thw"] == mf.Placement.HOST
    d = m.dummy_inputs()
    specs = {**m.field_specs(d), "image_grid_thw": both["image_grid_thw"]}
    mirrored = mf.Transfer("cpu").to_device(mf.batch_items(mf.split_items(d, specs))[0])
    assert isinstance(mirrored["image_grid_thw"], mf.Mirrored)
    torch.testing.assert_close(m.encode(**mirrored), m.encode(**batch.data))


def test_pixels_on_the_host_meet_the_patch_embedding() -> None:
    m, batch = _batch()
    wrong = {**batch.specs, "pixel_values": "host"}
    report = mf.audit.audit(m.encode, batch.data, wrong)
    named = [f for f in report.findings if "pixel_values" in f.fields]
    assert named and {f.kind for f in named} == {"device_mismatch"}
    assert {f.location.rsplit("/", 1)[-1] for f in named} == {
        _line_of("return F.linear(pixels.to(weight.dtype)")}
