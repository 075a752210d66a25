"""LLaVA-OneVision-2: mmferry against vLLM 0.33 on the same weights and media (not a test).

Run with the vLLM venv's Python from the repository root; it needs no GPU and no network:

    PYTHONPATH=src /work/venv-vllm/bin/python benchmarks/parity_llava_onevision2.py

vLLM's vision tower runs on the CPU with ``VLLM_TARGET_DEVICE=cpu`` (CPU platform, torch SDPA
attention), a default ``VllmConfig`` context, a one-process gloo group, and vLLM's CPU GEMM
dispatch (which needs the compiled ``vllm._C`` the CPU wheel has and this CUDA build lacks)
replaced by ``torch.nn.functional.linear`` on every linear layer: the reference numbers come
from vLLM's own modules, only the matmul kernel is torch's.

Checks, each printed with its numbers:

1. processor: our ``pixel_values`` (``pixel_dtype="float32"``, the default ``"fast"``
   resize) / ``image_grid_thw`` against transformers' ``Qwen2VLImageProcessor`` (the class
   vLLM's ``_load_ov2_processor`` builds) with OV2's settings (patch 14, merge 2, temporal
   patch 1), for several sizes and aspect ratios;
   ``patch_positions`` against a transcription of the checkpoint's ``build_patch_positions``;
   video frames through vLLM's own ``_frame_video_to_pil_and_timestamps`` and
   ``_pack_timestamps`` (padding to an even count, timestamps);
2. contract: our field specs against vLLM's ``_create_field_factory`` (kind, per-item slices,
   ``keep_on_cpu``) on the same processor output;
3. checkpoint names: vLLM's tower parameter names, as the published checkpoint spells them
   (``model.visual.`` + name, vLLM's ``hf_to_vllm_mapper``), are exactly the keys our model
   reads;
4. encoder: our embeddings against vLLM's ``LlavaOnevision2VisionTower`` on the same weights,
   tiny and at the published width (depth 2), for images, video frames and a grid with
   t > ``frame_windows_size`` (windowed attention with a short last window); processor
   cases both as float32 pixels and as our default uint8 levels (the normalisation folded
   into the patch embedding), vLLM's tower on the float32 pixels.
"""

from __future__ import annotations

import os
import sys

os.environ["VLLM_TARGET_DEVICE"] = "cpu"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import numpy as np
import torch
from PIL import Image

import mmferry as mf
from mmferry.models.llava_onevision2 import LlavaOnevision2, VisionConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from encoder_refs.llava_onevision2 import vllm_module, vllm_tower

ATOL = 1e-4


def photo(h: int, w: int, seed: int) -> np.ndarray:
    """A photo-like uint8 image: gradients, a disc and a bar, mild noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.stack([x / w * 200 + 30, y / h * 180 + 40, (x + y) / (h + w) * 160 + 50], -1)
    disc = (y - h * 0.4) ** 2 + (x - w * 0.6) ** 2 < (min(h, w) * 0.25) ** 2
    img[disc] = (220, 60, 40)
    img[int(h * 0.7):int(h * 0.8), int(w * 0.1):int(w * 0.9)] = (30, 90, 200)
    img += rng.normal(0, 6, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


# The checkpoint's build_patch_positions (video_processing_llava_onevision2.py, frame indices
# None), transcribed: t, h, w coordinates in row-major order, then reordered into merge
# blocks by permuting an index grid.
def remote_patch_positions(grid: torch.Tensor, merge: int) -> torch.Tensor:
    out = []
    for t, h, w in grid.tolist():
        hh = torch.arange(h).repeat_interleave(w).repeat(t)
        ww = torch.arange(w).repeat(h).repeat(t)
        tt = torch.arange(t).repeat_interleave(h * w)
        pp = torch.stack([tt, hh, ww], dim=1)
        idx = torch.arange(t * h * w).view(t, h // merge, merge, w // merge, merge)
        out.append(pp[idx.permute(0, 1, 3, 2, 4).reshape(-1)])
    return torch.cat(out)


def check_processor(ov2: object) -> None:
    from transformers.models.qwen2_vl import Qwen2VLImageProcessor

    model = mf.models.load("llava-onevision2")
    pc = model.processor_config
    hf = Qwen2VLImageProcessor(patch_size=14, merge_size=2, temporal_patch_size=1,
                               min_pixels=pc.min_pixels, max_pixels=pc.max_pixels)
    print("1. processor vs transformers Qwen2VLImageProcessor (torchvision backend, "
          "patch 14, merge 2, temporal 1)")
    sizes = [(480, 640), (1080, 1920), (50, 700), (900, 300), (28, 28), (1500, 1500)]
    for i, (h, w) in enumerate(sizes):
        img = Image.fromarray(photo(h, w, i))
        ours = model.processor(images=[img], pixel_dtype="float32")
        ref = hf(images=[img], return_tensors="pt")
        grid_ok = torch.equal(ours["image_grid_thw"], ref["image_grid_thw"])
        diff = (ours["pixel_values"] - ref["pixel_values"]).abs().max().item()
        pos_ok = torch.equal(ours["patch_positions"],
                             remote_patch_positions(ref["image_grid_thw"], 2))
        print(f"   image {h}x{w}: grid {ref['image_grid_thw'].tolist()[0]} equal={grid_ok}, "
              f"pixel max|diff|={diff:.3g}, patch_positions equal={pos_ok}")
        assert grid_ok and diff == 0 and pos_ok
    # Video, frame backend: vLLM pads and stamps the frames, then the image processor runs.
    frames = np.stack([photo(360, 640, 10 + t) for t in range(5)])
    pil, stamps = ov2._frame_video_to_pil_and_timestamps((frames, {"fps": 2.0}))
    ref = hf(images=pil, return_tensors="pt")
    ours = model.processor(videos=[frames], fps=2.0, pixel_dtype="float32")
    diff = (ours["pixel_values_videos"] - ref["pixel_values"]).abs().max().item()
    same = (torch.equal(ours["video_grid_thw"], ref["image_grid_thw"])
            and torch.equal(ours["frame_timestamps"], ov2._pack_timestamps([stamps]))
            and torch.equal(ours["patch_positions_videos"],
                            remote_patch_positions(ref["image_grid_thw"], 2))
            and ours["video_num_frames"].tolist() == [len(stamps)])
    print(f"   video 5 frames 360x640 @2 fps: {len(pil)} frames after vLLM's padding, "
          f"timestamps {stamps}, grid/positions/timestamps equal={same}, pixel max|diff|={diff:.3g}")
    assert same and diff == 0


def check_contract(ov2: object) -> None:
    model = mf.models.load("llava-onevision2")
    frames = [np.stack([photo(56, 84, t)] * n) for t, n in ((1, 4), (2, 3))]
    outputs = model.processor(images=[photo(56, 84, 5), photo(112, 84, 6)], videos=frames,
                              max_pixels=28 * 28 * 16)
    ours = model.field_specs(outputs)
    theirs = ov2._create_field_factory(2)(outputs)
    print("2. field contract vs vLLM _create_field_factory")
    for name in sorted(ours):
        cfg = theirs[name]
        spec = ours[name]
        kind = "batched" if type(cfg.field).__name__ == "MultiModalBatchedField" else "flat"
        slices_ok = True
        if kind == "flat":
            mine = [s[0] for s in spec.item_slices()]
            theirs_dim0 = [s[0] if isinstance(s, tuple) else s for s in cfg.field.slices]
            slices_ok = [(s.start, s.stop) for s in mine] == [
                (s.start, s.stop) for s in theirs_dim0]
        host = spec.placement == mf.Placement.HOST
        ok = (kind == spec.kind and cfg.modality == spec.modality
              and cfg.field.keep_on_cpu == host and slices_ok)
        print(f"   {name}: {spec.kind}, {spec.placement}; vLLM {kind}, keep_on_cpu="
              f"{cfg.field.keep_on_cpu}; slices equal={slices_ok} -> {'ok' if ok else 'DIFFERS'}")
        assert ok, name


def check_names(ov2: object, model: LlavaOnevision2, tower: torch.nn.Module) -> None:
    published = {"model.visual." + n for n, _ in tower.named_parameters()}
    mapped = set()
    for key in published:
        for prefix, ours in model.checkpoint_prefixes.items():
            if key.startswith(prefix):
                mapped.add(ours + key[len(prefix):])
                break
    ok = mapped == set(model.state_dict())
    print(f"3. checkpoint names: {len(published)} published keys map onto our "
          f"{len(model.state_dict())} parameters exactly: {ok}")
    assert ok


def check_encoder(ov2: object, label: str, cfg: VisionConfig) -> None:
    model = mf.models.load("llava-onevision2", config=_config_json(cfg))
    # Random weights everywhere, norm scales and biases too, so no term hides behind a 0 or 1.
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05 + (1.0 if p.ndim == 1 else 0.0))
    tower = vllm_tower(model)
    if label == "tiny":
        check_names(ov2, model, tower)
    print(f"4. encoder vs vLLM LlavaOnevision2VisionTower, {label} (hidden {cfg.hidden_size}, "
          f"heads {cfg.num_attention_heads}, depth {cfg.num_hidden_layers}, LM width "
          f"{cfg.text_hidden_size})")
    merge = cfg.spatial_merge_size
    cases = []
    for i, (h, w) in enumerate(((224, 224), (336, 504), (140, 700))):
        for dtype in ("float32", "uint8"):
            out = model.processor(images=[photo(h, w, 20 + i)], max_pixels=448 * 448,
                                  pixel_dtype=dtype)
            cases.append((f"image {h}x{w} {dtype}", out))
    video = [np.stack([photo(224, 308, 30 + t) for t in range(3)])]
    for dtype in ("float32", "uint8"):
        vid = model.processor(videos=video, max_pixels=448 * 448, pixel_dtype=dtype)
        cases.append((f"video 3->4 frames 224x308 {dtype}", vid))
    rng = torch.Generator().manual_seed(0)
    grid = torch.tensor([[6, 4, 6], [1, 8, 4]])
    n = int(grid.prod(-1).sum())
    positions = mf.models.llava_onevision2.patch_positions([tuple(r) for r in grid.tolist()],
                                                           merge)
    cases.append(("grid t=6 (windows 4+2) + image", {
        "pixel_values": torch.randn(n, 588, generator=rng), "image_grid_thw": grid,
        "patch_positions": positions}))
    for name, fields in cases:
        names = (("pixel_values_videos", "video_grid_thw", "patch_positions_videos")
                 if "video_grid_thw" in fields else
                 ("pixel_values", "image_grid_thw", "patch_positions"))
        pixels, grid, positions = (fields[k] for k in names)
        if pixels.dtype == torch.uint8:  # vLLM's tower takes what transformers gives
            a, b = model.normalize.affine()
            pixels = (pixels.double().view(len(pixels), 3, -1) * a[:, None] + b[:, None]
                      ).float().view(len(pixels), -1)
        with torch.no_grad():
            ours = model.encode(**fields)
            ref = tower(pixels, grid, positions)
        diff = (ours - ref).abs().max().item()
        print(f"   {name}: grid {grid.tolist()}, out {list(ours.shape)}, max|diff|={diff:.3g} "
              f"(max|ref| {ref.abs().max().item():.3g})")
        assert ours.shape == ref.shape and diff < ATOL * max(1.0, ref.abs().max().item())


def _config_json(cfg: VisionConfig) -> dict:
    return {"model_type": "llava_onevision2",
            "vision_config": {k: getattr(cfg, k) for k in (
                "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "patch_size", "spatial_merge_size", "num_channels", "frame_windows_size",
                "rope_theta", "layer_norm_eps")},
            "text_config": {"hidden_size": cfg.text_hidden_size}}


def main() -> int:
    torch.set_num_threads(1)
    ov2 = vllm_module()
    check_processor(ov2)
    check_contract(ov2)
    check_encoder(ov2, "tiny", VisionConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=96,
        rope_theta=5000.0, layer_norm_eps=1e-5, text_hidden_size=40))
    check_encoder(ov2, "published width, depth 2", VisionConfig(num_hidden_layers=2))
    print("all parity checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
