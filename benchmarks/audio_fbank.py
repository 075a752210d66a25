"""FireRedLID features: our Kaldi fbank against kaldi-native-fbank, as vLLM's FireRedLID /
FireRedASR2 processor calls it (``KaldifeatFbank``: samples passed as a Python list, frames
fetched one by one and stacked) and as the bare library call (frames fetched, no stacking).
One torch thread, the competitors interleaved, median of per-repeat medians; the parity of
each clip is printed with the timings.

    python benchmarks/audio_fbank.py [--quick]

:func:`compare` is the same measurement for other scripts (``benchmarks/audio.py``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from _common import CpuWatch, Timing, configure_torch, fmt_ratio, fmt_us, time_interleaved

from mmferry.media.samples import speech_like
from mmferry.models.firered_lid import kaldi_fbank


def _knf_options() -> tuple[Any, Any]:
    import kaldi_native_fbank as knf

    opts = knf.FbankOptions()
    opts.frame_opts.dither = 0.0
    opts.frame_opts.snip_edges = True
    opts.mel_opts.num_bins = 80
    opts.mel_opts.debug_mel = False
    return knf, opts


def compare(seconds: Sequence[float] = (5.0, 30.0), *, repeats: int = 3, runs: int = 10,
            warmups: int = 2) -> list[dict[str, float]]:
    """Per clip length: median seconds of ours, of vLLM's call pattern and of the bare
    library, and the max |diff| of ours against the library (log-mel units, int16-scale
    input). Raises ImportError without kaldi-native-fbank."""
    knf, opts = _knf_options()
    rows = []
    for s in seconds:
        wave = speech_like(s, seed=int(s)) * 32768
        tensor = torch.from_numpy(wave)

        def vllm_pattern(wave: np.ndarray = wave) -> np.ndarray:
            fbank = knf.OnlineFbank(opts)
            fbank.accept_waveform(16000, wave.tolist())
            return np.vstack([fbank.get_frame(i) for i in range(fbank.num_frames_ready)])

        def library(wave: np.ndarray = wave) -> list[np.ndarray]:
            fbank = knf.OnlineFbank(opts)
            fbank.accept_waveform(16000, wave)
            return [fbank.get_frame(i) for i in range(fbank.num_frames_ready)]

        def ours(tensor: torch.Tensor = tensor) -> torch.Tensor:
            return kaldi_fbank(tensor)

        fns = {"ours": ours, "vllm": vllm_pattern, "knf": library}
        timings = {k: Timing() for k in fns}
        for _ in range(repeats):
            time_interleaved(fns, timings, runs=runs, warmups=warmups)
        diff = float(np.abs(ours().numpy() - vllm_pattern()).max())
        rows.append({"seconds": s, "ours": timings["ours"].median, "vllm": timings["vllm"].median,
                     "knf": timings["knf"].median, "max_abs_diff": diff})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repeat of a few runs")
    args = parser.parse_args()
    configure_torch(1)
    try:
        import kaldi_native_fbank  # noqa: F401
    except ImportError:
        print("kaldi-native-fbank is not installed (pip install kaldi-native-fbank); nothing to compare")
        return 1
    watch = CpuWatch().start()
    rows = compare(repeats=1 if args.quick else 3, runs=3 if args.quick else 10)
    watch.stop()
    print(f"{'clip':>6} {'ours us':>10} {'vLLM us':>10} {'knf us':>10} {'vs vLLM':>8} {'vs knf':>8} "
          f"{'max |diff|':>10}")
    for r in rows:
        print(f"{r['seconds']:>5g}s {fmt_us(r['ours']):>10} {fmt_us(r['vllm']):>10} "
              f"{fmt_us(r['knf']):>10} {fmt_ratio(r['ours'], r['vllm']):>8} "
              f"{fmt_ratio(r['ours'], r['knf']):>8} {r['max_abs_diff']:>10.2e}")
    print(f"foreign CPU: {watch.foreign_s:.2f} s over {watch.wall_s:.1f} s (steal {watch.steal_s:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
