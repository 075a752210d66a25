"""Whisper log-mel features: mmferry's against transformers' ``WhisperFeatureExtractor``.

Speech-like clips (voiced syllables with pauses, ``mmferry.media.samples.speech_like``) at
16 kHz, 128 mel bins (Qwen2-Audio) and 80 (MOSS-Transcribe-Diarize), one clip per call as a
processor sees a request; both sides called alternately in one process on one torch thread,
the median of the per-repeat medians reported. Each case also prints the largest absolute
difference of the features (target: 1e-4) and whether the attention masks are equal. Target:
ours <= 0.5x transformers' time for a 30 s clip. Shorter clips are listed too: transformers
pads every clip to 30 s and transforms the padding; mmferry skips it.

    python benchmarks/audio.py [--runs 5] [--repeats 3] [--seconds 30 5 1]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import CpuWatch, Timing, configure_torch, fmt_ratio, time_interleaved

from mmferry.media.samples import speech_like
from mmferry.models.whisper import FeatureConfig, log_mel


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmups", type=int, default=2)
    parser.add_argument("--seconds", type=float, nargs="*", default=[30.0, 5.0, 1.0])
    parser.add_argument("--mels", type=int, nargs="*", default=[128, 80])
    args = parser.parse_args()
    configure_torch(1)
    from transformers import WhisperFeatureExtractor

    rows = [("clip", "mels", "ours ms", "transformers ms", "ratio", "max |diff|", "mask", "target")]
    failed = False
    watch = CpuWatch().start()
    for mels in args.mels:
        cfg = FeatureConfig(feature_size=mels)
        theirs = WhisperFeatureExtractor(feature_size=mels)
        for i, seconds in enumerate(args.seconds):
            clip = [speech_like(seconds, cfg.sampling_rate, seed=i)]

            def run_ours(clip=clip, cfg=cfg) -> object:
                return log_mel(clip, cfg)

            def run_theirs(clip=clip, fe=theirs) -> object:
                return fe(clip, sampling_rate=16000, return_attention_mask=True, padding="max_length",
                          truncation=True, return_tensors="pt")

            features, mask = run_ours()
            ref = run_theirs()
            diff = (features - ref["input_features"]).abs().max().item()
            same_mask = torch.equal(mask, ref["attention_mask"])
            timings = {"ours": Timing(), "transformers": Timing()}
            for _ in range(args.repeats):
                time_interleaved({"ours": run_ours, "transformers": run_theirs}, timings,
                                 runs=args.runs, warmups=args.warmups)
            t_ours, t_ref = timings["ours"].median, timings["transformers"].median
            target = ""
            if seconds == 30.0:
                ok = t_ours <= 0.5 * t_ref and diff <= 1e-4 and same_mask
                failed |= not ok
                target = "<= 0.5x: " + ("PASS" if ok else "MISS")
            failed |= diff > 1e-4 or not same_mask
            rows.append((f"{seconds:g} s", str(mels), f"{t_ours * 1e3:.2f}", f"{t_ref * 1e3:.2f}",
                         fmt_ratio(t_ours, t_ref), f"{diff:.1e}", "equal" if same_mask else "DIFFER",
                         target))
    watch.stop()
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    print(f"1 thread, one clip per call, median of {args.repeats} repeats x {args.runs} interleaved "
          f"runs; foreign CPU: {watch.foreign_s:.2f} s over {watch.wall_s:.1f} s "
          f"(steal {watch.steal_s:.2f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
