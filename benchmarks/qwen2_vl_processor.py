"""Qwen2-VL image processing: mmferry's processor against transformers' on the same images.

Peers: ``Qwen2VLImageProcessorPil`` (PIL/NumPy) and, when torchvision imports,
``Qwen2VLImageProcessor`` (torchvision). Each round runs every processor once on the same
8 PIL images, in rotating order (so neither always runs warm or first); the figure is the
median over rounds, and the claim is the ratio. Outputs are checked equal to the PIL peer's.

    python3 benchmarks/qwen2_vl_processor.py [--rounds 15] [--threads 1]

``compare_processors(images, repeats)`` is the same comparison on given images (used by
``benchmarks/encode_step.py``).
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

import mmferry.models as mf_models

SETS = {
    "8 x 448x448": [(448, 448)] * 8,
    "8 mixed": [(448, 448), (640, 480), (375, 500), (1024, 768), (224, 336), (720, 1280),
                (500, 500), (300, 900)],
}


def images(sizes: list[tuple[int, int]], seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def peers() -> dict[str, Callable[[list[Image.Image]], Any]]:
    """transformers' processors that import here, by name."""
    out: dict[str, Callable[[list[Image.Image]], Any]] = {}
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )
    except ImportError:
        return out
    pil = Qwen2VLImageProcessorPil()
    out["transformers PIL"] = lambda imgs: pil(images=imgs, return_tensors="pt")
    try:
        import torchvision  # noqa: F401
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

        fast = Qwen2VLImageProcessor()
        out["transformers torchvision"] = lambda imgs: fast(images=imgs, return_tensors="pt")
    except ImportError:
        pass
    return out


def measure(fns: dict[str, Callable[[list[Image.Image]], Any]], imgs: list[Image.Image],
            rounds: int) -> dict[str, float]:
    """Median seconds per call of each function, interleaved in rotating order."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for name in names:  # warm-up
        fns[name](imgs)
    for r in range(max(rounds, 1)):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            fns[name](imgs)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def compare_processors(imgs: list[Image.Image], repeats: int = 15,
                       label: str | None = None) -> dict[str, float]:
    """Time our processor and each peer on ``imgs`` and print images/s and our speed-up over
    each; returns median images/s by processor. Checks our output equals the PIL peer's."""
    model = mf_models.load("qwen2-vl")
    # float32 and exact: the same pixels as the PIL peer, checked below (benchmarks/preprocess.py
    # times the uint8 default).
    fns = {"mmferry": lambda x: model.processor(images=x, pixel_dtype="float32", resize_mode="exact"),
           **peers()}
    if "transformers PIL" in fns:
        ours, ref = fns["mmferry"](imgs), fns["transformers PIL"](imgs)
        assert torch.equal(ours["pixel_values"], ref["pixel_values"]), "outputs differ"
    medians = measure(fns, imgs, repeats)
    label = label or f"{len(imgs)} images"
    print(f"{'images':<14} {'processor':<26} {'images/s':>10} {'mmferry speed-up':>17}")
    for name, seconds in medians.items():
        print(f"{label:<14} {name:<26} {len(imgs) / seconds:>10.1f} "
              f"{seconds / medians['mmferry']:>16.2f}x")
    if len(fns) == 1:
        print("(transformers not installed: no peer)")
    return {name: len(imgs) / seconds for name, seconds in medians.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (both sides)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for label, sizes in SETS.items():
        compare_processors(images(sizes), args.rounds, label)


if __name__ == "__main__":
    main()
