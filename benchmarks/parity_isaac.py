"""Isaac against vLLM 0.33 on the CPU: processor bit for bit, embeddings on the same weights.

Our float32 pixels (both resize modes) must be vLLM's bit for bit; our uint8 levels (the
default) go through the folded patch embedding, and their embeddings are compared with
vLLM's and with our float32 path's.

vLLM's own classes are instantiated: ``IsaacImageProcessor`` (resize, normalise, patchify)
and ``IsaacVisionEmbedding`` (Siglip2 NaViT, pixel shuffle, projector), its weights loaded
through its own ``load_weights`` (which stacks q/k/v into ``qkv_proj``) from our model's
state dict. vLLM needs a (single-process, gloo) distributed context for its parallel
linears; on a machine without a GPU its platform is "unspecified" and its encoder attention
runs the native SDPA path over ``cu_seqlens``.

Run with the vLLM environment, from the repository root (not a test: vLLM is not a
dependency):

    /work/venv-vllm/bin/python benchmarks/parity_isaac.py [--json]

Exits 1 when the processor differs in any bit, an embedding differs from vLLM's by more than
1e-4, or the uint8 path's from the float32 path's by more than 1e-5.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from encoder_refs.isaac import vllm_context, vllm_reference

import mmferry.models as models
from mmferry.media.samples import photo_like

ATOL = 1e-4
LEVELS_ATOL = 1e-5  # uint8 levels through the folded layer against float32 pixels

# Small widths, the real patch size 16, a 16×16 position grid (resized up and down), and
# both shuffle settings (r = 2 as published; r = 1, vLLM's config default: no shuffle).
CONFIGS = {
    "r2": {"model_type": "isaac", "hidden_size": 40, "vision_config": {
        "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2,
        "num_attention_heads": 4, "patch_size": 16, "num_patches": 256,
        "pixel_shuffle_scale_factor": 2, "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": 1e-6}},
    "r1": {"model_type": "isaac", "hidden_size": 24, "vision_config": {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "patch_size": 16, "num_patches": 64,
        "pixel_shuffle_scale_factor": 1, "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": 1e-5}},
}
# (height, width) of source images: tall, wide, tiny (grown to the minimum), large (shrunk
# to the maximum), odd sizes (rounded up), and one size twice (a repeated position table).
IMAGES = [(120, 200), (333, 97), (20, 31), (900, 700), (64, 64), (257, 129), (120, 200)]
BOUNDS = [dict(max_num_patches=256, min_num_patches=64), dict(max_num_patches=6144,
                                                             min_num_patches=256)]


def _randomise(model: torch.nn.Module, seed: int) -> None:
    # Random everywhere, norms and biases too, so a misplaced or unused parameter shows.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if p.ndim > 1 else 0.3)
                    + (1.0 if p.ndim == 1 else 0.0))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    from PIL import Image
    from vllm.transformers_utils.processors.isaac import IsaacImageProcessor

    vllm_context()
    results, failed = [], False
    for name, config in CONFIGS.items():
        ours = models.load("isaac", config=config)
        _randomise(ours, seed=len(name))
        ref = vllm_reference(config, ours.state_dict())
        vision = config["vision_config"]
        r, patch = vision["pixel_shuffle_scale_factor"], vision["patch_size"]
        for bounds in BOUNDS:
            pil = [Image.fromarray(photo_like(h, w, seed=i)) for i, (h, w) in enumerate(IMAGES)]
            processor = IsaacImageProcessor(
                patch_size=patch, vision_max_num_patches=bounds["max_num_patches"],
                vision_min_num_patches=bounds["min_num_patches"], pixel_shuffle_scale=r)
            expect = processor(pil)
            got = {mode: ours.processor(images=pil, pixel_dtype="float32", resize_mode=mode,
                                        **bounds) for mode in ("exact", "fast")}
            levels = ours.processor(images=pil, **bounds)  # uint8, fast: the defaults
            same_grid = all(torch.equal(g["image_grid_thw"], expect["image_grid_thw"])
                            for g in (*got.values(), levels))
            same_pixels = all(g["pixel_values"].dtype == expect["pixel_values"].dtype
                              and torch.equal(g["pixel_values"], expect["pixel_values"])
                              for g in got.values())
            grid = got["exact"]["image_grid_thw"]
            with torch.no_grad():
                want = ref((expect["pixel_values"],
                            expect["image_grid_thw"][:, 1:3].to(torch.int32)))
                out = ours.encode(**got["exact"])
                out_levels = ours.encode(**levels)

            def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
                return (a - b).abs().max().item() if a.shape == b.shape else float("inf")

            diff, diff_levels = max_diff(out, want), max_diff(out_levels, want)
            levels_vs_float = max_diff(out_levels, out)
            ok = (same_grid and same_pixels and max(diff, diff_levels) <= ATOL
                  and levels_vs_float <= LEVELS_ATOL)
            failed |= not ok
            results.append({
                "config": name, "bounds": bounds, "grids": grid[:, 1:].tolist(),
                "processor_bit_exact": same_grid and same_pixels, "tokens": out.shape[0],
                "embedding_max_abs_diff": diff, "uint8_embedding_max_abs_diff": diff_levels,
                "uint8_vs_float32_max_abs_diff": levels_vs_float,
                "output_scale": want.abs().max().item(), "ok": ok})
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        for res in results:
            print(f"{res['config']} {res['bounds']}: grids {res['grids']}")
            print(f"   processor bit-exact (float32, exact and fast): "
                  f"{res['processor_bit_exact']}; {res['tokens']} tokens; max |diff| from vLLM: "
                  f"float32 {res['embedding_max_abs_diff']:.2e}, uint8 "
                  f"{res['uint8_embedding_max_abs_diff']:.2e}; uint8 vs float32 "
                  f"{res['uint8_vs_float32_max_abs_diff']:.2e} (outputs up to "
                  f"{res['output_scale']:.1f}) -> {'ok' if res['ok'] else 'FAIL'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
