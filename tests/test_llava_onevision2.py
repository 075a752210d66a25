"""LLaVA-OneVision-2: processor, field contract, encoder, checkpoint loading and placement.

OV2 is remote code: transformers has no OV2 classes and vLLM is not installed in the test
environment. Where each expectation comes from:

* vLLM 0.33 ``vllm/model_executor/models/llava_onevision2.py`` ("vLLM" below): the tower's
  forward (transcribed in :func:`vllm_forward`), ``_build_window_cu_seqlens``,
  ``_create_field_factory`` (field kinds, sizes, ``keep_on_cpu``), the frame backend
  ``_frame_video_to_pil_and_timestamps`` (even frame count by repeating the last frame and its
  index, timestamps = index / fps, 1.0 fps by default) and ``_pack_timestamps`` (zero padded),
  ``get_image_replacement`` / ``_process_video_input`` (tokens t·h·w/merge², per video the
  sum over its frames), the tower's docstring and ``hf_to_vllm_mapper`` (checkpoint names:
  ``model.visual.`` + the tower's names).
* The checkpoint's ``processing_llava_onevision2.py``: images go through the image processor
  and ``build_patch_positions`` (``video_processing_llava_onevision2.py``), transcribed in
  :func:`remote_patch_positions`.
* transformers 5.24 ``Qwen2VLImageProcessorPil`` for the patch order, normalisation and the
  resize grid (``resize_mode="exact"``, float32: bit for bit), and its torchvision
  ``Qwen2VLImageProcessor``, the one vLLM builds, for ``resize_mode="fast"`` where
  torchvision is installed (it is not in the test extra). Bit equality with vLLM's own tower,
  frame backend and field factory is checked by ``benchmarks/parity_llava_onevision2.py`` in
  the vLLM venv.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
)

import mmferry as mf
from mmferry.errors import ArgumentError, CheckpointError, ContractError, MediaError
from mmferry.media.samples import photo_like
from mmferry.models import llava_onevision2 as ov2

NAME = "llava-onevision2"
SOURCE = Path(ov2.__file__)
# Tiny but faithful: 2 blocks of 2 heads of 32 (half of 32 splits 4:6:6), the real patch 14,
# merge 2 and windows of 4 frames, a non-default rotary base and norm eps (a wrong read shows).
VISION = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
          "intermediate_size": 96, "patch_size": 14, "spatial_merge_size": 2,
          "num_channels": 3, "frame_windows_size": 4, "rope_theta": 5000.0,
          "layer_norm_eps": 1e-5, "hidden_act": "gelu"}
CONFIG = {"model_type": "llava_onevision2", "vision_config": VISION,
          "text_config": {"model_type": "qwen3", "hidden_size": 40}}
PREPROCESSOR = {"min_pixels": 28 * 28, "max_pixels": 28 * 28 * 64, "patch_size": 14,
                "merge_size": 2, "temporal_patch_size": 1,
                "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
SMALL = {"min_pixels": 28 * 28, "max_pixels": 28 * 28 * 64}
# transformers' pixels: normalised float32, resized by Pillow.
PIL_PIXELS = {"pixel_dtype": "float32", "resize_mode": "exact"}


def rgb(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def hf_processor(**kwargs: object) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=1,
                                    **kwargs)


def photo(h: int, w: int, seed: int) -> np.ndarray:
    """Photo-like pixels (gradients, shapes, mild noise): what resamplers are built for."""
    return photo_like(h, w, seed)


def remote_patch_positions(grid: torch.Tensor, merge: int) -> torch.Tensor:
    """The checkpoint's ``build_patch_positions`` without frame indices, transcribed:
    row-major (t, h, w) coordinates reordered into merge blocks by permuting an index grid."""
    out = []
    for t, h, w in grid.tolist():
        hh = torch.arange(h).repeat_interleave(w).repeat(t)
        ww = torch.arange(w).repeat(h).repeat(t)
        tt = torch.arange(t).repeat_interleave(h * w)
        pp = torch.stack([tt, hh, ww], dim=1)
        idx = torch.arange(t * h * w).view(t, h // merge, merge, w // merge, merge)
        out.append(pp[idx.permute(0, 1, 3, 2, 4).reshape(-1)])
    return torch.cat(out)


def vllm_forward(model: ov2.LlavaOnevision2, pixels: torch.Tensor, grid: torch.Tensor,
                 positions: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """vLLM 0.33's ``LlavaOnevision2VisionTower.forward`` transcribed in plain torch: Conv2d
    patch embedding on ``view(-1, C, P, P)``, ``layernorm_pre``, ``forward_from_positions``,
    ``_build_window_cu_seqlens``, per block ``_apply_rotary_pos_embed`` with
    ``_rotate_half_interleaved`` and SDPA per ``cu_seqlens`` chunk, exact GELU, the merger."""
    cfg = model.config
    sd = {k.removeprefix("visual."): v for k, v in model.state_dict().items()}
    c, p, d, heads = cfg.num_channels, cfg.patch_size, cfg.hidden_size, cfg.num_attention_heads
    hd, eps = d // heads, cfg.layer_norm_eps
    x = F.conv2d(pixels.view(-1, c, p, p), sd["embeddings.patch_embedding.weight"], stride=p)
    x = F.layer_norm(x.view(-1, d), (d,), sd["layernorm_pre.weight"], sd["layernorm_pre.bias"], eps)
    unit = hd // 2 // 16
    freqs = []
    for axis, size in enumerate((4 * unit, 6 * unit, 6 * unit)):
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(size, dtype=torch.float32) / size))
        freqs.append(torch.outer(positions[:, axis].float(), inv))
    emb = torch.cat([torch.cat(freqs, -1)] * 2, -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    lengths = []
    for t, h, w in grid.tolist():
        while t > 0:
            n = min(window or cfg.frame_windows_size, t)
            lengths.append(n * h * w)
            t -= n

    def rotary(t: torch.Tensor) -> torch.Tensor:
        rotated = torch.stack((-t[..., 1::2], t[..., 0::2]), dim=-1).flatten(-2)
        return t * cos + rotated * sin

    for i in range(cfg.num_hidden_layers):
        pre = f"encoder.layers.{i}."
        y = F.layer_norm(x, (d,), sd[pre + "layer_norm1.weight"], sd[pre + "layer_norm1.bias"], eps)
        qkv = F.linear(y, sd[pre + "self_attn.qkv.weight"], sd[pre + "self_attn.qkv.bias"])
        q, k, v = qkv.view(-1, 3, heads, hd).unbind(1)
        q, k = rotary(q), rotary(k)
        chunks = [F.scaled_dot_product_attention(*(s.transpose(0, 1)[None] for s in qkv_i))[0]
                  .transpose(0, 1) for qkv_i in zip(*(t.split(lengths) for t in (q, k, v)),
                                                    strict=True)]
        a = torch.cat(chunks).reshape(-1, d)
        x = x + F.linear(a, sd[pre + "self_attn.proj.weight"], sd[pre + "self_attn.proj.bias"])
        y = F.layer_norm(x, (d,), sd[pre + "layer_norm2.weight"], sd[pre + "layer_norm2.bias"], eps)
        y = F.linear(F.gelu(F.linear(y, sd[pre + "mlp.fc1.weight"], sd[pre + "mlp.fc1.bias"])),
                     sd[pre + "mlp.fc2.weight"], sd[pre + "mlp.fc2.bias"])
        x = x + y
    x = F.layer_norm(x, (d,), sd["merger.ln_q.weight"], sd["merger.ln_q.bias"], eps)
    x = F.gelu(F.linear(x.view(-1, d * 4), sd["merger.mlp.0.weight"], sd["merger.mlp.0.bias"]))
    return F.linear(x, sd["merger.mlp.2.weight"], sd["merger.mlp.2.bias"])


@pytest.fixture(scope="module")
def model() -> ov2.LlavaOnevision2:
    """The CONFIG tower with random weights everywhere (norm scales and biases too)."""
    m = mf.models.load(NAME, config=CONFIG)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if p.ndim == 1 else 0.0))
    return m


# -- processor ---------------------------------------------------------------------------


@pytest.mark.parametrize("sizes", [[(56, 84)], [(112, 56), (84, 84), (56, 140)]])
def test_images_without_resize_match_transformers_patches(sizes: list[tuple[int, int]]) -> None:
    """Sizes already multiples of 28 within the bounds: no resize, so pixel rows (merge-block
    order, C·P·P columns) and grids equal transformers' PIL processor's bit for bit (its
    rescale-then-normalise arithmetic)."""
    m = mf.models.load(NAME)
    images = [rgb(h, w, i) for i, (h, w) in enumerate(sizes)]
    ours = m.processor(images=images, **SMALL, **PIL_PIXELS)
    ref = hf_processor(**SMALL)(images=images, return_tensors="pt")
    assert torch.equal(ours["image_grid_thw"], ref["image_grid_thw"])
    assert ours["pixel_values"].shape == (sum(h * w for h, w in sizes) // 196, 3 * 14 * 14)
    assert ours["pixel_values"].dtype == torch.float32
    assert torch.equal(ours["pixel_values"], ref["pixel_values"])
    assert torch.equal(ours["patch_positions"], remote_patch_positions(ref["image_grid_thw"], 2))


@pytest.mark.parametrize("hw", [(480, 640), (50, 700), (900, 300), (20, 20), (1300, 1000)])
def test_resized_images_take_transformers_grid(hw: tuple[int, int]) -> None:
    """smart_resize decides the grid exactly; the exact mode's pixels are transformers' PIL
    processor's bit for bit, the fast mode's (torchvision's kernel, vLLM's) differ from them
    by the resampling kernel only."""
    m = mf.models.load(NAME)
    image = photo(*hw, seed=7)
    bounds = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 256}
    ours = m.processor(images=image, **bounds, **PIL_PIXELS)
    ref = hf_processor(**bounds)(images=[image], return_tensors="pt")
    assert torch.equal(ours["image_grid_thw"], ref["image_grid_thw"])
    (t, h, w), = ref["image_grid_thw"].tolist()
    assert ours["pixel_values"].shape == ref["pixel_values"].shape == (t * h * w, 588)
    assert ours["patch_positions"].shape == (t * h * w, 3)
    assert torch.equal(ours["pixel_values"], ref["pixel_values"])
    fast = m.processor(images=image, **bounds, pixel_dtype="float32")
    assert torch.equal(fast["image_grid_thw"], ref["image_grid_thw"])
    assert (fast["pixel_values"] - ref["pixel_values"]).abs().mean() < 0.05


def test_patch_positions_name_each_patch() -> None:
    """Each row's (t, h, w) is where its pixels come from: patch (i, j) of an unresized image
    is painted red = i, green = j, and each row's first red and green level (and, in float32,
    the normalised value) decodes back to its position."""
    m = mf.models.load(NAME)
    gh, gw = 4, 6
    image = np.zeros((gh * 14, gw * 14, 3), dtype=np.uint8)
    for i in range(gh):
        for j in range(gw):
            image[i * 14:(i + 1) * 14, j * 14:(j + 1) * 14] = (10 * i, 10 * j, 0)
    levels = m.processor(images=image, **SMALL)["pixel_values"]
    decoded = np.stack([np.zeros(gh * gw), levels[:, 0] // 10, levels[:, 196] // 10], 1)
    out = m.processor(images=image, **SMALL, pixel_dtype="float32")
    assert np.array_equal(out["patch_positions"].numpy(), decoded)
    mean, std = np.array(ov2.CLIP_MEAN), np.array(ov2.CLIP_STD)
    red = out["pixel_values"][:, 0].double().numpy() * std[0] + mean[0]
    green = out["pixel_values"][:, 196].double().numpy() * std[1] + mean[1]
    decoded = np.stack([np.zeros(gh * gw), np.rint(red * 25.5), np.rint(green * 25.5)], 1)
    assert np.array_equal(out["patch_positions"].numpy(), decoded)
    # Merge-block order: the first four rows are the top-left 2x2 block.
    assert out["patch_positions"][:4].tolist() == [[0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 1]]


@pytest.mark.parametrize("grid", [[(1, 4, 6)], [(3, 2, 4), (1, 6, 2)], [(6, 4, 4)]])
def test_patch_positions_match_the_checkpoint_builder(grid: list[tuple[int, int, int]]) -> None:
    assert torch.equal(ov2.patch_positions(grid, 2), remote_patch_positions(torch.tensor(grid), 2))


def test_video_frame_backend() -> None:
    """vLLM's frame backend: frames through the image branch, one (1, h, w) row per frame, an
    odd count padded by repeating the last frame (and its index), timestamps index / fps."""
    m = mf.models.load(NAME)
    v0 = np.stack([rgb(56, 84, 10 + t) for t in range(3)])
    v1 = np.stack([rgb(84, 84, 20 + t) for t in range(4)])
    out = m.processor(images=[rgb(56, 56, 1)], videos=[v0, v1], fps=[2.0, 1.0], **SMALL)
    assert set(out) == {"pixel_values", "image_grid_thw", "patch_positions",
                        "pixel_values_videos", "video_grid_thw", "patch_positions_videos",
                        "video_num_frames", "frame_timestamps", "video_is_codec"}
    assert out["video_grid_thw"].tolist() == [[1, 4, 6]] * 4 + [[1, 6, 6]] * 4
    assert out["video_num_frames"].tolist() == [4, 4]
    assert out["frame_timestamps"].dtype == torch.float32
    assert out["frame_timestamps"].tolist() == [[0.0, 0.5, 1.0, 1.0], [0.0, 1.0, 2.0, 3.0]]
    assert out["video_is_codec"].tolist() == [0, 0]
    frames = [*v0, v0[-1], *v1]
    alone = m.processor(images=frames, **SMALL)
    assert torch.equal(out["pixel_values_videos"], alone["pixel_values"])
    assert torch.equal(out["patch_positions_videos"], alone["patch_positions"])
    assert (out["patch_positions_videos"][:, 0] == 0).all()
    # Different frame counts: timestamps zero padded to the longest (vLLM _pack_timestamps).
    out = m.processor(videos=[v1, v0[:2]], **SMALL)
    assert out["frame_timestamps"].tolist() == [[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 0.0, 0.0]]
    assert out["video_num_frames"].tolist() == [4, 2]


def test_processor_errors_name_their_cause() -> None:
    m = mf.models.load(NAME)
    with pytest.raises(ArgumentError, match="nope") as e:
        m.processor(images=rgb(28, 28, 0), nope=1)
    assert e.value.argument == "nope"
    with pytest.raises(ArgumentError) as e:
        m.processor(videos=[np.zeros((2, 28, 28, 3), np.uint8)], fps=[1.0, 2.0])
    assert e.value.argument == "fps"
    with pytest.raises(ArgumentError) as e:
        m.processor(audios=[np.zeros(10)])
    assert e.value.argument == "audios"
    with pytest.raises(MediaError, match="item 1"):
        m.processor(images=[rgb(28, 28, 0), b"not an image"])
    with pytest.raises(MediaError, match="aspect ratio"):
        m.processor(images=rgb(2, 500, 0))


# -- contract ----------------------------------------------------------------------------


def test_field_specs_and_token_counts_follow_vllm() -> None:
    """_create_field_factory: pixels and positions flat by t·h·w per image (per video the sum
    over its frames, device); image_embeds by t·h·w/4; image_grid_thw batched and
    video_grid_thw flat by video_num_frames, both keep_on_cpu; frame metadata batched on
    the host. Tokens: get_image_replacement / _process_video_input."""
    m = mf.models.load(NAME)
    videos = [np.stack([rgb(56, 84, 3)] * 3), np.stack([rgb(84, 84, 4)] * 2)]
    out = m.processor(images=[rgb(56, 84, 0), rgb(112, 56, 1)], videos=videos, **SMALL)
    specs = m.field_specs(out)
    host, device = mf.Placement.HOST, mf.Placement.DEVICE
    expected = {"pixel_values": ("flat", device, (24, 32)),
                "patch_positions": ("flat", device, (24, 32)),
                "image_grid_thw": ("batched", host, None),
                "pixel_values_videos": ("flat", device, (4 * 24, 2 * 36)),
                "patch_positions_videos": ("flat", device, (4 * 24, 2 * 36)),
                "video_grid_thw": ("flat", host, (4, 2)),
                "video_num_frames": ("batched", host, None),
                "frame_timestamps": ("batched", host, None),
                "video_is_codec": ("batched", host, None)}
    assert set(specs) == set(expected)
    for name, (kind, placement, sizes) in expected.items():
        assert (specs[name].kind, specs[name].placement) == (kind, placement), name
        assert specs[name].sizes == sizes, name
    items = mf.split_items(out, specs)
    assert [m.tokens_per_item(i) for i in items["image"]] == [6, 8]
    assert [m.tokens_per_item(i) for i in items["video"]] == [4 * 6, 2 * 9]
    assert items["video"][1]["video_grid_thw"].tolist() == [[1, 6, 6]] * 2
    embeds = {"image_embeds": torch.zeros(14, m.hidden_size), "image_grid_thw": out["image_grid_thw"]}
    assert m.field_specs(embeds)["image_embeds"].sizes == (6, 8)


def _changed(item: mf.Item, name: str, value: object = None) -> mf.Item:
    """``item`` with field ``name`` set to ``value`` (dropped when None), its specs kept."""
    data = {k: v for k, v in item.items() if k != name}
    specs = {k: v for k, v in item.specs.items() if k != name or value is not None}
    if value is not None:
        data[name] = value
    return mf.Item(item.modality, data, specs)


@pytest.mark.parametrize("pixel_dtype", ["uint8", "float32"])
def test_check_item_blames_the_field(pixel_dtype: str) -> None:
    m = mf.models.load(NAME)
    out = m.processor(images=[rgb(56, 84, 0)], videos=[np.stack([rgb(56, 56, 1)] * 2)], **SMALL,
                      pixel_dtype=pixel_dtype)
    items = mf.split_items(out, m.field_specs(out))
    image, video = items["image"][0], items["video"][0]
    m.check_item(image)
    m.check_item(video)
    for item, name, value in (
            (image, "patch_positions", image["patch_positions"][:-1]),
            (image, "patch_positions", image["patch_positions"].float()),
            (image, "pixel_values", image["pixel_values"][:, :-1]),
            (image, "image_grid_thw", torch.tensor([1, 3, 6])),
            (video, "video_num_frames", torch.tensor(3)),
            (video, "patch_positions_videos", video["patch_positions_videos"][1:])):
        with pytest.raises(ContractError) as e:
            m.check_item(_changed(item, name, value))
        assert e.value.field == name
    with pytest.raises(ContractError) as e:
        m.check_item(_changed(image, "patch_positions"))
    assert e.value.field == "patch_positions"


# -- encoder -----------------------------------------------------------------------------


def _image_batch(m: ov2.LlavaOnevision2, sizes: list[tuple[int, int]],
                 pixel_dtype: str = "float32") -> dict[str, torch.Tensor]:
    """Float32 by default: vLLM's tower takes normalised pixels."""
    return m.processor(images=[rgb(h, w, i) for i, (h, w) in enumerate(sizes)], **SMALL,
                       pixel_dtype=pixel_dtype)


@pytest.mark.parametrize("sizes", [[(56, 84)], [(84, 140), (56, 56), (112, 84)], [(28, 224)]])
def test_encoder_matches_vllm_on_images(model: ov2.LlavaOnevision2,
                                        sizes: list[tuple[int, int]]) -> None:
    out = _image_batch(model, sizes)
    with torch.no_grad():
        ours = model.encode(**out)
        ref = vllm_forward(model, out["pixel_values"], out["image_grid_thw"],
                           out["patch_positions"])
    assert ours.shape == (sum(h * w for h, w in sizes) // 784, 40)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_encoder_matches_vllm_on_video_frames(model: ov2.LlavaOnevision2) -> None:
    out = model.processor(videos=[np.stack([rgb(56, 84, t) for t in range(3)]),
                                  np.stack([rgb(84, 56, t) for t in range(2)])], **SMALL,
                          pixel_dtype="float32")
    batch = mf.batch_items(mf.split_items(out, model.field_specs(out)))[0]
    with torch.no_grad():
        ours = model.encode(**batch.data)
        ref = vllm_forward(model, out["pixel_values_videos"], out["video_grid_thw"],
                           out["patch_positions_videos"])
    assert ours.shape == (6 * 6, 40)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("grid", [[(6, 2, 4)], [(9, 2, 2), (1, 4, 4), (4, 2, 2)]])
def test_encoder_windows_of_frames(model: ov2.LlavaOnevision2,
                                   grid: list[tuple[int, int, int]]) -> None:
    """Rows with t > frame_windows_size (the codec backend's canvases): attention within
    windows of 4 frames, the last one shorter; full attention would differ."""
    g = torch.tensor(grid)
    n = int(g.prod(-1).sum())
    pixels = torch.randn(n, 588, generator=torch.Generator().manual_seed(5))
    positions = ov2.patch_positions(grid, 2)
    with torch.no_grad():
        ours = model.encode(pixel_values=pixels, image_grid_thw=g, patch_positions=positions)
        ref = vllm_forward(model, pixels, g, positions)
        unwindowed = vllm_forward(model, pixels, g, positions, window=1000)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    assert (ours - unwindowed).abs().max() > 1e-3


def test_encoder_reads_positions_not_the_grid(model: ov2.LlavaOnevision2) -> None:
    """The rotary angles come from patch_positions (the codec backend sends real frame
    indices as t), so other positions give other embeddings."""
    out = _image_batch(model, [(56, 84)])
    shifted = out["patch_positions"].clone()
    shifted[:, 0] = 7
    with torch.no_grad():
        a = model.encode(**out)
        b = model.encode(**{**out, "patch_positions": shifted})
        ref = vllm_forward(model, out["pixel_values"], out["image_grid_thw"], shifted)
    assert (a - b).abs().max() > 1e-3
    torch.testing.assert_close(b, ref, atol=1e-5, rtol=1e-5)


def test_image_embeds_pass_through_and_bad_batches_fail(model: ov2.LlavaOnevision2) -> None:
    grid = torch.tensor([[1, 4, 6]])
    embeds = torch.randn(6, 40)
    assert model.encode(image_embeds=embeds, image_grid_thw=grid) is embeds
    out = _image_batch(model, [(56, 84)])
    with pytest.raises(ContractError) as e:
        model.encode(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
    assert e.value.field == "patch_positions"
    with pytest.raises(ContractError) as e:
        model.encode(**{**out, "patch_positions": out["patch_positions"][1:]})
    assert e.value.field == "patch_positions"
    video = model.processor(videos=[np.stack([rgb(56, 56, 0)] * 2)], **SMALL)
    with pytest.raises(ContractError) as e:
        model.encode(**{**video, "video_num_frames": torch.tensor([3])})
    assert e.value.field == "video_num_frames"


# -- uint8 pixels -------------------------------------------------------------------------

IMAGE_SIZES = [(100, 60), (37, 211), (140, 84), (56, 56)]


def _media() -> tuple[list[np.ndarray], list[np.ndarray]]:
    images = [photo(h, w, i) for i, (h, w) in enumerate(IMAGE_SIZES)]
    videos = [np.stack([photo(70, 100, 20 + t) for t in range(3)]),
              np.stack([photo(56, 84, 30 + t) for t in range(6)])]
    return images, videos


def _normalised(levels: torch.Tensor, normalize: mf.Normalize) -> torch.Tensor:
    """Levels ``[N, C·P·P]`` (channel-major columns) normalised with the spec's affine."""
    a, b = normalize.affine()
    n, c = levels.shape[0], normalize.channels
    return (levels.double().view(n, c, -1) * a[:, None] + b[:, None]).float().view(n, -1)


@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_levels_are_the_float_pixels_before_normalising(mode: str) -> None:
    m = mf.models.load(NAME)
    images, videos = _media()
    levels = m.processor(images=images, videos=videos, **SMALL, resize_mode=mode)
    floats = m.processor(images=images, videos=videos, **SMALL, resize_mode=mode,
                         pixel_dtype="float32")
    assert set(levels) == set(floats)
    for name in levels:
        if name in ("pixel_values", "pixel_values_videos"):
            assert levels[name].dtype == torch.uint8 and floats[name].dtype == torch.float32
            # Temporal patch 1: the same [patches, C·P·P] either way, a quarter of the bytes.
            assert levels[name].shape == floats[name].shape
            assert levels[name].shape[1] == 3 * 14 * 14
            torch.testing.assert_close(_normalised(levels[name], m.normalize), floats[name],
                                       atol=1e-6, rtol=0)
        else:
            assert torch.equal(levels[name], floats[name]), name
    assert m.normalize == mf.Normalize(ov2.CLIP_MEAN, ov2.CLIP_STD, 1 / 255)
    specs, float_specs = m.field_specs(levels), m.field_specs(floats)
    for name, spec in specs.items():
        pixels = name in ("pixel_values", "pixel_values_videos")
        assert spec.normalize == (m.normalize if pixels else None), name
        assert float_specs[name].normalize is None, name
    # The levels survive the item split with their normalisation.
    items = mf.split_items(levels, specs)
    assert all(i.specs["pixel_values"].normalize == m.normalize for i in items["image"])
    assert all(i.specs["pixel_values_videos"].normalize == m.normalize for i in items["video"])


def test_fast_and_exact_levels_differ_as_transformers_processors_do() -> None:
    """The two resize modes differ only by the resampling kernel: by no more (in uint8
    levels) than transformers' own torchvision and PIL processors differ on the same images
    (the same kernels, so here exactly as much). Images that need no resize are equal."""
    m = mf.models.load(NAME)
    images = [photo(h, w, i) for i, (h, w) in enumerate([(480, 640), (900, 300), (1000, 1300)])]
    bounds = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 256}
    fast = m.processor(images=images, **bounds)["pixel_values"].int()
    exact = m.processor(images=images, **bounds, resize_mode="exact")["pixel_values"].int()
    diff = (fast - exact).abs()
    assert 0 < diff.max() <= 20 and diff.float().mean() < 0.5
    ref = hf_processor(**bounds)(images=images, return_tensors="pt")["pixel_values"]
    ours = m.processor(images=images, **bounds, **PIL_PIXELS)["pixel_values"]
    assert torch.equal(ours, ref)
    same = [photo(56, 84, 0)]
    assert torch.equal(m.processor(images=same)["pixel_values"],
                       m.processor(images=same, resize_mode="exact")["pixel_values"])
    torchvision = pytest.importorskip("torchvision")
    assert torchvision  # installed: compare with transformers' own fast-vs-PIL difference
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    theirs = Qwen2VLImageProcessor(patch_size=14, merge_size=2, temporal_patch_size=1,
                                   **bounds)(images=images, return_tensors="pt")["pixel_values"]
    levels = (theirs - ref).abs().double() * torch.tensor(ov2.CLIP_STD).repeat_interleave(196) * 255
    assert diff.max() <= levels.max().round() and diff.float().mean() <= levels.mean() + 1e-3


def test_fast_pixels_are_transformers_torchvision_pixels() -> None:
    """vLLM's processor for OV2: transformers' torchvision ``Qwen2VLImageProcessor`` with OV2's
    settings; the fast float32 pixels equal its output bit for bit."""
    pytest.importorskip("torchvision")
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    m = mf.models.load(NAME)
    bounds = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 256}
    images = [photo(h, w, i) for i, (h, w) in enumerate([(480, 640), (50, 700), (900, 300),
                                                         (20, 20), (112, 56)])]
    ref = Qwen2VLImageProcessor(patch_size=14, merge_size=2, temporal_patch_size=1,
                                **bounds)(images=images, return_tensors="pt")
    ours = m.processor(images=images, **bounds, pixel_dtype="float32")
    assert torch.equal(ours["image_grid_thw"], ref["image_grid_thw"])
    assert torch.equal(ours["pixel_values"], ref["pixel_values"])


@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_uint8_embeddings_equal_the_float32_path(model: ov2.LlavaOnevision2, mode: str) -> None:
    """Images of several sizes and videos, split and batched: the folded patch embedding on
    uint8 levels gives the float32 path's embeddings."""
    images, videos = _media()
    outs = {}
    for dtype in ("uint8", "float32"):
        out = model.processor(images=images, videos=videos, **SMALL, resize_mode=mode,
                              pixel_dtype=dtype)
        batches = mf.batch_items(mf.split_items(out, model.field_specs(out)))
        assert {b.modality for b in batches} == {"image", "video"}
        with torch.no_grad():
            outs[dtype] = {b.modality: model.encode(**b.data) for b in batches}
    for modality, want in outs["float32"].items():
        got = outs["uint8"][modality]
        assert got.shape == want.shape and want.abs().max() > 0.1
        assert (got - want).abs().max() < 1e-5, modality


def test_uint8_items_through_wire_and_runner_equal_float32(model: ov2.LlavaOnevision2) -> None:
    images = [photo(h, w, i) for i, (h, w) in enumerate([(100, 60), (56, 84)])]
    outs = {}
    for dtype in ("uint8", "float32"):
        out = model.processor(images=images, **SMALL, pixel_dtype=dtype)
        items = mf.wire.decode(mf.wire.encode(mf.split_items(out, model.field_specs(out))))
        with torch.no_grad():
            outs[dtype] = mf.EncoderRunner(model).encode(items)
    for got, want in zip(outs["uint8"], outs["float32"], strict=True):
        assert (got - want).abs().max() < 1e-5


def test_levels_are_refused_without_the_models_normalisation() -> None:
    m = mf.models.load(NAME)
    out = m.processor(images=[rgb(56, 84, 0)], videos=[np.stack([rgb(56, 56, 1)] * 2)], **SMALL)
    items = mf.split_items(out, m.field_specs(out))
    other = mf.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    for item, name in ((items["image"][0], "pixel_values"),
                       (items["video"][0], "pixel_values_videos")):
        m.check_item(item)
        spec = mf.FieldSpec.from_dict({**item.specs[name].to_dict(),
                                       "normalize": other.to_dict()})
        for bad in (mf.Item(item.modality, dict(item), {**item.specs, name: spec}), dict(item)):
            with pytest.raises(ContractError, match="normalize") as e:
                m.check_item(bad)
            assert e.value.field == name
        runner = mf.EncoderRunner(m)
        assert runner.encode([mf.Item(item.modality, dict(item), {**item.specs, name: spec})]) \
            == [None]
        assert runner.last.errors[0].field == name
    # Integers other than uint8 are neither levels nor floats (an Item with a normalize
    # refuses them itself; a plain mapping reaches the model's check).
    image = items["image"][0]
    with pytest.raises(ContractError, match="uint8 or floating point") as e:
        m.check_item({**image, "pixel_values": image["pixel_values"].to(torch.int16)})
    assert e.value.field == "pixel_values"
    with pytest.raises(ContractError, match="uint8 levels or floating point") as e:
        m.encode(pixel_values=out["pixel_values"].to(torch.int32),
                 image_grid_thw=out["image_grid_thw"], patch_positions=out["patch_positions"])
    assert e.value.field == "pixel_values"


def test_pixel_options_are_checked_before_any_media() -> None:
    m = mf.models.load(NAME)
    for option, value in (("pixel_dtype", "float16"), ("resize_mode", "lanczos"),
                          ("pixel_dtype", None)):
        with pytest.raises(ArgumentError) as e:
            m.processor(images=[b"not an image"], **{option: value})
        assert e.value.argument == option


def test_the_fold_follows_the_weight(model: ov2.LlavaOnevision2) -> None:
    """The folded weight is kept between calls and redone when the weight changes."""
    out = _image_batch(model, [(56, 84)], pixel_dtype="uint8")
    floats = _image_batch(model, [(56, 84)])
    embed = model.visual.embeddings
    with torch.no_grad():
        first = model.encode(**out)
        kept = embed.fold.weight
        model.encode(**out)
        assert embed.fold.weight is kept
        weight = embed.patch_embedding.weight
        saved = weight.clone()
        try:
            # A uniform scale would vanish in layernorm_pre: perturb it.
            weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(9)) * 0.05)
            changed = model.encode(**out)
            assert embed.fold.weight is not kept
            assert (changed - model.encode(**floats)).abs().max() < 1e-5
            assert (changed - first).abs().max() > 1e-3
        finally:
            weight.copy_(saved)
    assert not any("fold" in name for name in model.state_dict())


# -- checkpoints and configs ---------------------------------------------------------------

# The tower's names as vLLM's LlavaOnevision2VisionTower docstring lists them, under the
# published checkpoint's "model.visual." (hf_to_vllm_mapper maps it to "visual.").
PUBLISHED = (["embeddings.patch_embedding.weight", "layernorm_pre.weight", "layernorm_pre.bias",
              "merger.ln_q.weight", "merger.ln_q.bias", "merger.mlp.0.weight",
              "merger.mlp.0.bias", "merger.mlp.2.weight", "merger.mlp.2.bias"]
             + [f"encoder.layers.{i}.{part}.{kind}" for i in range(2)
                for part in ("self_attn.qkv", "self_attn.proj", "layer_norm1", "layer_norm2",
                             "mlp.fc1", "mlp.fc2") for kind in ("weight", "bias")])


def _checkpoint(folder: Path, source: ov2.LlavaOnevision2, *, shards: int = 1,
                drop: str | None = None) -> Path:
    tensors = {f"model.{k}": v.contiguous() for k, v in source.state_dict().items()}
    # The language model's tensors sit beside the tower's; only model.visual.* is read.
    tensors["model.language_model.embed_tokens.weight"] = torch.zeros(8, 40)
    tensors["lm_head.weight"] = torch.zeros(8, 40)
    if drop:
        del tensors[drop]
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, folder / "model.safetensors")
        return folder
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({k: tensors[k] for k in part}, folder / file)
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def test_config_reads_every_key(model: ov2.LlavaOnevision2) -> None:
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.intermediate_size, cfg.rope_theta, cfg.layer_norm_eps, cfg.frame_windows_size,
            cfg.text_hidden_size) == (64, 2, 2, 96, 5000.0, 1e-5, 4, 40)
    assert model.hidden_size == 40
    # vLLM's getattr defaults for the optional keys.
    bare = {k: v for k, v in VISION.items()
            if k not in ("num_channels", "frame_windows_size", "rope_theta", "layer_norm_eps")}
    cfg = ov2.VisionConfig.from_dict({**CONFIG, "vision_config": bare})
    assert (cfg.num_channels, cfg.frame_windows_size, cfg.rope_theta, cfg.layer_norm_eps) == (
        3, 4, 10000.0, 1e-6)


def test_parameter_names_are_the_published_ones(model: ov2.LlavaOnevision2) -> None:
    assert set(model.state_dict()) == {f"visual.{n}" for n in PUBLISHED}
    assert model.checkpoint_prefixes["model.visual."] == "visual."


@pytest.mark.parametrize("shards", [1, 3])
def test_checkpoint_loads_by_name(tmp_path: Path, model: ov2.LlavaOnevision2, shards: int) -> None:
    folder = _checkpoint(tmp_path / "ckpt", model, shards=shards)
    loaded = mf.models.load(NAME, weights=folder)
    state, expected = loaded.state_dict(), model.state_dict()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    # preprocessor_config.json set the processor: its bounds and normalisation.
    assert loaded.processor_config.max_pixels == PREPROCESSOR["max_pixels"]
    image = rgb(56, 84, 0)
    out = loaded.processor(images=image, pixel_dtype="float32")
    assert out["pixel_values"][0, 0].item() == pytest.approx(image[0, 0, 0] / 127.5 - 1, abs=1e-6)
    assert loaded.normalize == mf.Normalize((0.5,) * 3, (0.5,) * 3)
    levels = loaded.processor(images=image)
    assert loaded.field_specs(levels)["pixel_values"].normalize == loaded.normalize
    with torch.no_grad():
        torch.testing.assert_close(loaded.encode(**out), model.encode(**out), atol=0, rtol=0)
        # The levels go through the loaded checkpoint's normalisation, not the default's.
        torch.testing.assert_close(loaded.encode(**levels), loaded.encode(**out), atol=1e-5,
                                   rtol=0)


def test_missing_checkpoint_key_is_a_checkpoint_error(tmp_path: Path,
                                                      model: ov2.LlavaOnevision2) -> None:
    folder = _checkpoint(tmp_path / "ckpt", model, drop="model.visual.merger.mlp.2.bias")
    with pytest.raises(CheckpointError, match="missing") as e:
        mf.models.load(NAME, weights=folder)
    assert e.value.parameter == "visual.merger.mlp.2.bias"


@pytest.mark.parametrize(("change", "key"), [
    ({"vision_config": None}, "vision_config"),
    ({"text_config": {}}, "text_config.hidden_size"),
    ({"vision_config": {**VISION, "num_attention_heads": 4}}, "vision_config.num_attention_heads"),
    ({"vision_config": {**VISION, "patch_size": "14"}}, "vision_config.patch_size"),
    ({"vision_config": {k: v for k, v in VISION.items() if k != "intermediate_size"}},
     "vision_config.intermediate_size"),
])
def test_bad_config_names_the_key(change: dict, key: str) -> None:
    with pytest.raises(ArgumentError) as e:
        mf.models.load(NAME, config={**CONFIG, **change}, materialize=False)
    assert e.value.argument == key


def test_processor_config_must_fit_the_tower(tmp_path: Path) -> None:
    for key, value in (("patch_size", 16), ("temporal_patch_size", 2)):
        folder = tmp_path / key
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(CONFIG))
        (folder / "preprocessor_config.json").write_text(json.dumps({**PREPROCESSOR, key: value}))
        with pytest.raises(ArgumentError) as e:
            ov2.LlavaOnevision2.from_config(CONFIG, folder)
        assert e.value.argument == f"preprocessor_config.{key}"


# -- placement ---------------------------------------------------------------------------


def _line(marker: str) -> int:
    """The model file's line holding ``marker`` (exactly one)."""
    hits = [i for i, text in enumerate(SOURCE.read_text().splitlines(), 1) if marker in text]
    assert len(hits) == 1, (marker, hits)
    return hits[0]


@functools.cache
def _batch(modality: str) -> mf.Batch:
    m = mf.models.load(NAME, materialize=False)
    out = m.dummy_inputs()
    (batch,) = [b for b in mf.batch_items(mf.split_items(out, m.field_specs(out)))
                if b.modality == modality]
    return batch


@pytest.mark.parametrize(("modality", "field", "kind", "marker"), [
    ("image", "image_grid_thw", "host_sync", "for t, h, w in grid.tolist()]"),
    ("video", "video_grid_thw", "host_sync", "for t, h, w in grid.tolist()]"),
    ("video", "video_num_frames", "host_sync", "else sum(frames.reshape(-1).tolist())"),
    ("image", "patch_positions", "device_mismatch", "torch.outer(positions[:, axis]"),
    ("video", "patch_positions_videos", "device_mismatch", "torch.outer(positions[:, axis]"),
])
def test_placement_flip_is_caught_where_the_field_is_used(
        modality: str, field: str, kind: str, marker: str) -> None:
    """Every host field the encoder reads, flipped to the device, is a host sync at the line
    that reads it; the per-patch positions flipped to the host meet the device rotary
    frequencies (a hard device mismatch on a GPU: nothing moves them)."""
    m = mf.models.load(NAME)
    batch = _batch(modality)  # its own specs audit clean: tests/test_registry.py
    spec = batch.specs[field]
    flipped = "device" if spec.placement == mf.Placement.HOST else "host"
    wrong = {**batch.specs, field: mf.FieldSpec.from_dict({**spec.to_dict(),
                                                           "placement": flipped})}
    report = mf.audit.audit(m.encode, batch.data, wrong)
    assert not report.ok
    assert {f.kind for f in report.findings} == {kind}
    assert {f.fields for f in report.findings} == {(field,)}
    for f in report.findings:
        path, line = f.location.rsplit(":", 1)
        assert Path(path).parts[-2:] == ("models", SOURCE.name) and int(line) == _line(marker)
