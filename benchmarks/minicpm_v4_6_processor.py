"""MiniCPM-V 4.6 image processing: mmferry's ``exact`` / ``fast`` uint8 processor against
transformers' PIL and torchvision processors on the same photo-like images.

Peers (what vLLM 0.33 runs, one image per call, default kwargs of the checkpoint's
``preprocessor_config.json``: scale_resolution 448, max_slice_nums 9, patch_size 14, "16x",
mean = std = 0.5): ``MiniCPMV4_6ImageProcessorPil`` for ``exact`` and
``MiniCPMV4_6ImageProcessor`` (torchvision) for ``fast``. One torch thread; every round runs
each processor once per image in rotating order; CPU-time medians; the claim is the ratio.
"Pillow resizes" times the resizes alone (the source image and, when sliced, the refined
one): "exact" must make the same ones, so their share of the PIL processor is its floor.

    python3 benchmarks/minicpm_v4_6_processor.py [--rounds 21]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from PIL import Image

import mmferry.models as mf_models
from mmferry.media.samples import photo_like
from mmferry.models.minicpm_v4_6 import best_resize, refine_size, slice_grid

SIZES = [(448, 448), (1024, 768), (1920, 1080)]  # width x height


def pillow_resizes(img: Image.Image) -> list[Image.Image]:
    """The source (and, when sliced, refined) image resized as both exact processors do."""
    w, h = img.size
    grid = slice_grid(h, w, 9, 448)
    sizes = [best_resize(h, w, 448, 14, "16x", grid is None)]
    if grid is not None:
        sizes.append(refine_size(h, w, grid, 448, 14, "16x"))
    return [img.resize((sw, sh), Image.Resampling.BICUBIC) for sh, sw in sizes
            if (sw, sh) != img.size]


def processors() -> dict[str, Callable[[Image.Image], Any]]:
    from transformers.models.minicpmv4_6.image_processing_pil_minicpmv4_6 import (
        MiniCPMV4_6ImageProcessorPil,
    )
    model = mf_models.load("minicpm-v-4.6")
    pil = MiniCPMV4_6ImageProcessorPil()
    out: dict[str, Callable[[Image.Image], Any]] = {
        "hf PIL": lambda img: pil([img], return_tensors="pt"),
        "exact": lambda img: model.processor(images=[img], resize_mode="exact"),
        "fast": lambda img: model.processor(images=[img], resize_mode="fast"),
        # The floor of "exact": the Pillow resizes it shares with the PIL processor, alone.
        "Pillow resizes": pillow_resizes,
    }
    try:
        from transformers.models.minicpmv4_6.image_processing_minicpmv4_6 import (
            MiniCPMV4_6ImageProcessor,
        )
        tv = MiniCPMV4_6ImageProcessor()
        out["hf torchvision"] = lambda img: tv([img], return_tensors="pt")
    except ImportError:
        pass
    return out


def measure(fns: dict[str, Callable[[Image.Image], Any]], img: Image.Image,
            rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for name in names:
        fns[name](img)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.process_time()
            fns[name](img)
            times[name].append(time.process_time() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    torch.set_num_threads(1)
    fns = processors()
    for w, h in SIZES:
        img = Image.fromarray(photo_like(h, w))
        t = measure(fns, img, args.rounds)
        line = "  ".join(f"{k} {v * 1e3:.2f} ms" for k, v in t.items())
        ratios = (f"exact/PIL {t['exact'] / t['hf PIL']:.2f}x (floor: Pillow resizes/PIL "
                  f"{t['Pillow resizes'] / t['hf PIL']:.2f}x)")
        if "hf torchvision" in t:
            ratios += f"  fast/torchvision {t['fast'] / t['hf torchvision']:.2f}x"
        print(f"{w}x{h}: {line}  |  {ratios}")


if __name__ == "__main__":
    main()
