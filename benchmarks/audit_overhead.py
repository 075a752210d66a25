"""Placement-audit overhead: audited vs plain forward of the same encoder, side by side.

The encoder is the Qwen2-VL-like example (per-image attention blocks, grid read on the
host) at widths 64, 256 and 1280; each width runs the plain forward, the forward under
two pass-through modes (the floor any mode-based tracer pays) and the audit, interleaved,
and prints median ratios against the plain forward. Target: at most 1.3x at width 256
and above.

    python3 benchmarks/audit_overhead.py            # default: about 1-2 minutes on 2 cores
    python3 benchmarks/audit_overhead.py --reps 9 --depth 16
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from mmferry.audit import audit
from mmferry.audit.examples import Qwen2VLLike
from mmferry.fields import FieldSpec

# (width, heads, image grids): the patch count shrinks as the width grows so that every
# width's forward takes a comparable time on a small CPU.
CONFIGS = (
    (64, 4, [[1, 32, 32], [1, 16, 24]]),
    (256, 8, [[1, 32, 32], [1, 16, 24]]),
    (1280, 16, [[1, 16, 16]]),
)
PATCH_DIM = 1176  # 3 channels x 2 frames x 14 x 14, as Qwen2-VL


class _PassFunction(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


class _PassDispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def _interleaved(variants: dict[str, Callable[[], object]], reps: int) -> dict[str, list[float]]:
    for fn in variants.values():
        fn()  # warm-up: allocator, kernels, caches
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def run(width: int, heads: int, grids: list[list[int]], depth: int, reps: int) -> float:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2VLLike(dim=width, heads=heads, depth=depth, patch_dim=PATCH_DIM).eval()
    grid = torch.tensor(grids)
    inputs = {"pixel_values": torch.randn(int(grid.prod(-1).sum()), PATCH_DIM),
              "image_grid_thw": grid}
    specs = {"pixel_values": FieldSpec.batched("image"),
             "image_grid_thw": FieldSpec.batched("image", placement="host")}

    def plain() -> None:
        with torch.no_grad():
            model(**inputs)

    def floor() -> None:
        with torch.no_grad(), _PassFunction(), _PassDispatch():
            model(**inputs)

    def audited() -> None:
        report = audit(model, inputs, specs)
        assert report.ok, report

    ops = audit(model, inputs, specs).ops
    times = _interleaved({"plain": plain, "floor": floor, "audited": audited}, reps)

    def ratio(name: str) -> float:
        # Each run is compared with the plain run next to it, then the median is taken.
        return statistics.median(a / p for a, p in zip(times[name], times["plain"], strict=True))

    plain_ms = statistics.median(times["plain"]) * 1e3
    audited_ms = statistics.median(times["audited"]) * 1e3
    per_op = (audited_ms - plain_ms) / ops * 1e3
    print(f"width {width:5d}  tokens {int(grid.prod(-1).sum()):5d}  aten ops {ops:5d}  "
          f"plain {plain_ms:8.1f} ms  | pass-through modes {ratio('floor'):5.2f}x  "
          f"| audited {ratio('audited'):5.2f}x  (+{per_op:5.1f} us/op)", flush=True)
    return ratio("audited")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=8, help="encoder blocks (default 8)")
    parser.add_argument("--reps", type=int, default=9, help="interleaved runs per variant")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, depth {args.depth}, "
          f"median of {args.reps} interleaved runs (ratio = audited / plain, same run)")
    for width, heads, grids in CONFIGS:
        run(width, heads, grids, args.depth, args.reps)


if __name__ == "__main__":
    main()
