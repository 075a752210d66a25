"""One coalesced pinned copy per batch vs one ``.to(device, non_blocking=True)`` per tensor.

On a machine with CUDA: for each case, times (CUDA events, median of interleaved repeats)
mmferry's ``Transfer.to_device`` against the per-tensor upload vLLM's ``reduce_data`` does
(reduce on the host into fresh, optionally pinned memory, then one copy per tensor), prints
the ratio, and checks under ``torch.cuda.set_sync_debug_mode("error")`` that our transfer
never synchronises and that the device data equals the host data.

Without CUDA it says so and exits 0.

    python benchmarks/gpu_transfer.py [--repeats 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

import mmferry as mf

F = mf.FieldSpec


def cases() -> dict[str, tuple[dict, dict]]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, n, dtype in [("qwen2vl_8x1024_f32", 8, torch.float32),
                           ("qwen2vl_8x1024_bf16", 8, torch.bfloat16),
                           ("qwen2vl_64x64_f32", 64, torch.float32)]:
        side = 32 if n == 8 else 8
        grid = torch.tensor([[1, side, side]] * n)
        pixels = torch.randn(int(grid.prod(-1).sum()), 1176, generator=g).to(dtype)
        out[name] = (
            {"pixel_values": pixels, "image_grid_thw": grid},
            {"pixel_values": F.flat_from_sizes("image", grid.prod(-1)),
             "image_grid_thw": F.batched("image", placement="host")},
        )
    lengths = torch.randint(1000, 3000, (8,), generator=g)
    mask = (torch.arange(3000)[None, :] < lengths[:, None]).to(torch.int32)
    out["qwen2audio_8"] = (
        {"input_features": torch.randn(8, 128, 3000, generator=g), "feature_attention_mask": mask},
        {"input_features": F.batched("audio"), "feature_attention_mask": F.batched("audio")},
    )
    return out


def per_tensor_upload(batch: mf.Batch, device: torch.device) -> dict:
    """vLLM's path: reduce each field on the host into pinned memory, one async copy each."""
    moved = {}
    for name, spec in batch.specs.items():
        values = batch.values(name)
        if spec.placement is mf.Placement.HOST:
            moved[name] = batch.reduced(name)
            continue
        plan = mf.fields.plan_reduction(name, spec, values)
        outs = [torch.empty(s, dtype=d, pin_memory=True)
                for s, d in zip(plan.shapes, plan.dtypes, strict=True)]
        value = plan.fill(outs)
        moved[name] = value.to(device, non_blocking=True)
    return moved


def time_cuda(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_transfer: skipped, CUDA is not available on this machine")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    torch.set_num_threads(1)
    print(f"device: {torch.cuda.get_device_name(device)}; torch {torch.__version__}")
    print(f"{'case':<22} {'MB':>8} {'ours ms':>9} {'per-tensor ms':>14} {'ratio':>7}  no-sync  equal")
    failures = 0
    for name, (outputs, specs) in cases().items():
        (batch,) = mf.batch_items(mf.split_items(outputs, specs))
        transfer = mf.Transfer(device)
        for _ in range(3):  # warm the staging pool, the caching allocators and the kernels
            transfer.to_device(batch)
            per_tensor_upload(batch, device)
        torch.cuda.synchronize()

        torch.cuda.set_sync_debug_mode("error")
        try:
            moved = transfer.to_device(batch)
            no_sync = True
        except RuntimeError as e:
            no_sync = False
            print(f"  {name}: synchronised: {e}", file=sys.stderr)
            moved = None
        finally:
            torch.cuda.set_sync_debug_mode("default")
        equal = moved is not None and all(
            torch.equal(moved[k].cpu(), batch.reduced(k)) for k in batch.specs
        )

        ours, theirs = [], []
        for _ in range(args.repeats):  # interleaved, so both sides see the same machine state
            ours += time_cuda(lambda b=batch, t=transfer: t.to_device(b), 1)
            theirs += time_cuda(lambda b=batch: per_tensor_upload(b, device), 1)
        mo, mt = statistics.median(ours), statistics.median(theirs)
        mb = sum(v.nbytes for k, v in batch.data.items()
                 if batch.specs[k].placement is not mf.Placement.HOST) / 1e6
        print(f"{name:<22} {mb:>8.1f} {mo:>9.3f} {mt:>14.3f} {mo / mt:>6.2f}x  {no_sync!s:<7}  {equal}")
        failures += (not no_sync) + (not equal)
    print(f"stats of the last transfer: {transfer.stats}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
