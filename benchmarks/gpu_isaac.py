"""Isaac on a real GPU: the encode path never syncs, and matches the CPU.

Images of different sizes (one size twice, so the position gather runs) go through the
processor, the field contract, batching and ``mf.Transfer("cuda")``; then, after one
warm-up call, ``model.encode`` runs under ``torch.cuda.set_sync_debug_mode("error")``: a host
read of a device value or a blocking copy raises. Both pixel paths run: uint8 levels (the
default, through the folded patch embedding) and float32. Every float32-weight output must
equal the CPU's float32-pixel output within 1e-4, and bfloat16 (uint8 levels) stay within 5%
of the output scale. Without CUDA it says so and exits 0.

    python benchmarks/gpu_isaac.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import mmferry as mf

CONFIG = {"model_type": "isaac", "hidden_size": 256, "vision_config": {
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "patch_size": 16, "num_patches": 256,
    "pixel_shuffle_scale_factor": 2}}
SIZES = [(480, 640), (333, 97), (480, 640), (20, 31)]


def _encode(model: torch.nn.Module, batch: mf.Batch, device: str) -> torch.Tensor:
    placed = mf.Transfer(device).to_device(batch)
    model.encode(**placed)  # warm-up: kernels, caching allocator, pinned pool
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            out = model.encode(**mf.Transfer(device).to_device(batch))
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    return out.float().cpu()


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: skipped")
        return 0
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in SIZES]
    model = mf.models.load("isaac", config=CONFIG)
    batches = {}
    for dtype in ("uint8", "float32"):
        outputs = model.processor(images=images, max_num_patches=1024, min_num_patches=256,
                                  pixel_dtype=dtype)
        (batches[dtype],) = mf.batch_items(mf.split_items(outputs, model.field_specs(outputs)))
    cpu = _encode(model, batches["float32"], "cpu")
    cpu_levels = _encode(model, batches["uint8"], "cpu")
    model.to("cuda")
    gpu = {dtype: _encode(model, batch, "cuda") for dtype, batch in batches.items()}
    half = _encode(mf.models.load("isaac", config=CONFIG, dtype=torch.bfloat16).to("cuda"),
                   batches["uint8"], "cuda")
    errs = {name: (out - cpu).abs().max().item() for name, out in (
        ("cpu uint8", cpu_levels), ("cuda uint8", gpu["uint8"]), ("cuda float32", gpu["float32"]))}
    err, err_half, scale = (max(errs.values()), (half - cpu).abs().max().item(),
                            cpu.abs().max().item())
    print(f"grids {outputs['image_grid_thw'][:, 1:].tolist()}, {cpu.shape[0]} tokens")
    print("encode under sync-debug 'error': no sync")
    print("max |diff| from cpu float32 pixels: " + ", ".join(
        f"{name} {e:.2e}" for name, e in errs.items()) + f"; bfloat16 (uint8) {err_half:.2e}; "
        f"scale {scale:.2f}")
    ok = err <= 1e-4 and err_half <= 0.05 * scale
    print("ok" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
