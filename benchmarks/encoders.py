"""Each built-in model's encoder against its reference on the same weights.

For every module in ``benchmarks/encoder_refs``: the model at its real published width with
the depth cut to ``--depth`` blocks (so it fits this machine), ours and the reference called
alternately in one process on one torch thread, medians of interleaved runs; parity (max
absolute difference of the embeddings) is checked in the same run. Prints ours / reference
time: the target is at most 1.0x.

    python benchmarks/encoders.py [--depth 2] [--runs 3] [--repeats 3] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import encoder_refs
from _common import CpuWatch, Timing, configure_torch, fmt_ratio, time_interleaved


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmups", type=int, default=1)
    parser.add_argument("--only", nargs="*", default=None, help="model names to run")
    parser.add_argument("--atol", type=float, default=1e-3,
                        help="parity bound on the embeddings (float32, real width)")
    args = parser.parse_args()
    configure_torch(1)
    torch.manual_seed(0)

    rows = [("model", "reference", "ours ms", "ref ms", "ratio", "max |diff|", "parity")]
    failed = False
    watch = CpuWatch().start()
    for info in sorted(pkgutil.iter_modules(encoder_refs.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"encoder_refs.{info.name}")
        if args.only and module.NAME not in args.only:
            continue
        try:
            ours, reference = module.build(depth=args.depth)
        except ImportError as e:
            rows.append((module.NAME, module.REFERENCE, "-", "-", "-", "-",
                         f"reference unavailable ({str(e).splitlines()[0]})"))
            continue
        diff = (ours().float() - reference().float()).abs().max().item()
        ok = diff <= args.atol
        failed |= not ok
        timings = {"ours": Timing(), "reference": Timing()}
        for _ in range(args.repeats):
            time_interleaved({"ours": ours, "reference": reference}, timings,
                             runs=args.runs, warmups=args.warmups)
        t_ours, t_ref = timings["ours"].median, timings["reference"].median
        rows.append((module.NAME, module.REFERENCE, f"{t_ours * 1e3:.1f}", f"{t_ref * 1e3:.1f}",
                     fmt_ratio(t_ours, t_ref), f"{diff:.2e}", "ok" if ok else "FAIL"))
    watch.stop()
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    print(f"depth {args.depth}, 1 thread, median of {args.repeats} repeats x {args.runs} "
          f"interleaved runs; foreign CPU: {watch.foreign_s:.2f} s over {watch.wall_s:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
