"""Ernie4.5-VL on a CUDA GPU: what the CPU audit predicts, checked on the device, and the
encoder's time against transformers'.

1. The declared contract (grids on the host) runs a warm encode step, transfer included,
   under ``torch.cuda.set_sync_debug_mode("error")``: no sync.
2. The grid on the device makes the same step raise at its first host read (the audit's
   ``host_sync``).
3. The tiny model's embeddings on the GPU against the CPU's (float32).
4. The published width (vision 1280, resampler to 2560), depth 2 and 32, float32 and
   bfloat16: ours against transformers' vision tower + resampler on the same weights,
   median of CUDA-event timings.

    python3 benchmarks/gpu_ernie4_5_vl.py
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mmferry as mf


def _median_ms(fn: Callable[[], torch.Tensor], runs: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def check_placement() -> None:
    cpu = mf.models.load("ernie4.5-vl")
    gpu = mf.models.load("ernie4.5-vl").to("cuda")
    outputs = cpu.dummy_inputs()
    batches = mf.batch_items(mf.split_items(outputs, cpu.field_specs(outputs)))
    transfer = mf.Transfer("cuda")
    with torch.inference_mode():
        want = [cpu.encode(**b.data) for b in batches]
        for b in batches:  # warm: pinned pools, kernels, allocator
            gpu.encode(**transfer.to_device(b))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = [gpu.encode(**transfer.to_device(b)) for b in batches]
        finally:
            torch.cuda.set_sync_debug_mode(0)
        print("declared placement under sync_debug_mode='error': no sync")
        for b, w, g in zip(batches, want, got, strict=True):
            print(f"  {b.modality}: GPU vs CPU float32 max |diff| "
                  f"{(g.cpu() - w).abs().max().item():.2e} over {tuple(g.shape)}")
        image = next(b for b in batches if b.modality == "image")
        moved = transfer.to_device(image)
        grid = image.data["image_grid_thw"].pin_memory().to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            gpu.encode(pixel_values=moved["pixel_values"], image_grid_thw=grid)
            print("grid on the device: no sync raised (the audit predicted one)")
        except RuntimeError as e:
            print(f"grid on the device: sync raised, as the audit predicts ({str(e).splitlines()[0]})")
        finally:
            torch.cuda.set_sync_debug_mode(0)


def compare_speed() -> None:
    from encoder_refs import ernie4_5_vl as ref

    for depth in (2, 32):
        ours_fn, theirs_fn = ref.build(depth)
        env: dict[str, object] = {}
        for fn in (ours_fn, theirs_fn):
            env.update(zip(fn.__code__.co_freevars,
                           (c.cell_contents for c in fn.__closure__ or ()), strict=True))
        ours, tower, resampler = env["ours"], env["tower"], env["resampler"]
        pixels, grid = env["pixels"], env["grid"]
        for dtype in (torch.float32, torch.bfloat16):
            for m in (ours, tower, resampler):
                m.to("cuda", dtype)
            px, grid_dev = pixels.to("cuda", dtype), grid.to("cuda")

            def run_ours(model=ours, px=px, grid=grid):
                with torch.inference_mode():
                    return model.encode(pixel_values=px, image_grid_thw=grid)

            def run_theirs(tower=tower, resampler=resampler, px=px, grid=grid_dev):
                with torch.inference_mode():
                    return resampler(tower(px, grid_thw=grid).last_hidden_state, grid)

            diff = (run_ours().float() - run_theirs().float()).abs().max().item()
            t_ours, t_theirs = _median_ms(run_ours), _median_ms(run_theirs)
            print(f"depth {depth:>2} {str(dtype).removeprefix('torch.'):>8}: ours {t_ours:7.2f} ms"
                  f"  transformers {t_theirs:7.2f} ms  ratio {t_ours / t_theirs:.2f}x"
                  f"  max |diff| {diff:.2e}")


def main() -> None:
    if not torch.cuda.is_available():
        print("gpu_ernie4_5_vl: skipped, CUDA is not available on this machine")
        return
    print(torch.__version__, torch.cuda.get_device_name())
    check_placement()
    compare_speed()


if __name__ == "__main__":
    main()
