"""LLaVA-OneVision-2's image processor against its transformers peers, per image size.

Peers (what vLLM 0.33 builds for OV2: ``Qwen2VLImageProcessor.from_pretrained``, the
torchvision backend with transformers 5), both with OV2's settings (patch 14, merge 2,
temporal patch 1, CLIP mean/std, the class's resize bounds):

* ``Qwen2VLImageProcessorPil``: the pixels of mmferry's ``resize_mode="exact"``;
* ``Qwen2VLImageProcessor`` (needs torchvision): those of ``resize_mode="fast"``.

One photo-like image per call, 1 torch thread, runs interleaved in rotating order, CPU-time
medians. Prints each mode's time as a ratio of its peer's (target <= 0.5): the median of the
per-round ratios (each mode and its peer timed in the same round, so load that drifts over the
run cancels out) and the ratio of the medians; then the pixel differences fast vs exact (uint8
levels) next to transformers' own torchvision vs PIL ones.

    python benchmarks/llava_onevision2_pixels.py [--rounds 21]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import Image

import mmferry as mf
from mmferry.media.samples import photo_like
from mmferry.models.qwen2_vl import CLIP_MEAN, CLIP_STD

SIZES = ((448, 448), (1024, 768), (1920, 1080))  # width x height
PEER_KWARGS = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 1,
               "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD)}


def peers() -> dict[str, Any]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    out: dict[str, Any] = {"transformers PIL": Qwen2VLImageProcessorPil(**PEER_KWARGS)}
    try:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
        out["transformers torchvision"] = Qwen2VLImageProcessor(**PEER_KWARGS)
    except ImportError:
        pass
    return out


def measure(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """CPU seconds of every call by round, interleaved in rotating order after a warm-up."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for name in names:
        fns[name]()
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.process_time()
            fns[name]()
            times[name].append(time.process_time() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = mf.models.load("llava-onevision2", materialize=False)
    ref = peers()
    for width, height in SIZES:
        image = Image.fromarray(photo_like(height, width))
        fns: dict[str, Callable[[], Any]] = {
            f"mmferry {mode}": (lambda m=mode, i=image: model.processor(images=i, resize_mode=m))
            for mode in ("exact", "fast")}
        fns.update({name: (lambda p=p, i=image: p(images=[i], return_tensors="pt"))
                    for name, p in ref.items()})
        times = measure(fns, args.rounds)
        medians = {k: statistics.median(v) for k, v in times.items()}
        print(f"{width}x{height}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in medians.items()))
        pairs = [("exact", "mmferry exact", "transformers PIL"),
                 ("fast", "mmferry fast", "transformers torchvision")]
        for label, ours, peer in pairs:
            if peer in times:
                paired = statistics.median(a / b for a, b in zip(times[ours], times[peer],
                                                                  strict=True))
                print(f"  {label} / {peer.split()[1]}: {paired:.2f}x (median of per-round "
                      f"ratios), {medians[ours] / medians[peer]:.2f}x (ratio of medians)")
        exact = model.processor(images=image, resize_mode="exact")["pixel_values"].int()
        fast = model.processor(images=image, resize_mode="fast")["pixel_values"].int()
        diff = (fast - exact).abs().float()
        print(f"  fast vs exact: max {diff.max():.0f}, mean {diff.mean():.4f} levels", end="")
        if "transformers torchvision" in ref:
            a = ref["transformers PIL"](images=[image], return_tensors="pt")["pixel_values"]
            b = ref["transformers torchvision"](images=[image], return_tensors="pt")["pixel_values"]
            # Back to levels: the normalised difference times std / rescale.
            std = torch.tensor(CLIP_STD).repeat_interleave(196) * 255
            levels = ((b - a).abs() * std).double()
            print(f"; transformers torchvision vs PIL: max {levels.max():.2f}, "
                  f"mean {levels.mean():.4f} levels", end="")
        print()
    print(f"(torch {torch.__version__}, numpy {np.__version__}, Pillow {Image.__version__})")


if __name__ == "__main__":
    main()
