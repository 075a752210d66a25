"""Where an encoder step's host time goes, and our Qwen2-VL processor against transformers'.

Part 1: a batch of 8 images through split, hashing and cache lookup, batch, transfer
(``device="cpu"``: the packing without the copy), ``model.encode``, scatter and cache store;
prints each stage's median and the share of the step spent outside ``model.encode``. Two
towers: the tiny test config and a Qwen2-VL-width tower (embed 1280, 16 heads) cut to one
block, so the encode time is of a realistic order per block.

Part 2: images per second of our processor against transformers' ``Qwen2VLImageProcessor``
(PIL backend, and the torchvision one when it imports), on the same 8 images
(``benchmarks/qwen2_vl_processor.py``).

    python benchmarks/encode_step.py [--repeats 5] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import CpuWatch, configure_torch

import mmferry as mf

STAGES = ("split", "lookup", "batch", "transfer", "encode", "scatter", "cache")


def sample_images(n: int, size: tuple[int, int]) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (*size[::-1], 3), dtype=np.uint8)) for _ in range(n)]


def step_breakdown(config: str | dict, images: list[Image.Image], repeats: int) -> dict[str, float]:
    """Median seconds per stage of one encoder step over fresh items (a cold cache)."""
    model = mf.models.load("qwen2-vl", config=config)
    outputs = model.processor(images=images)
    samples: dict[str, list[float]] = {s: [] for s in STAGES}
    for r in range(repeats + 1):
        runner = mf.EncoderRunner(model, mf.EncoderCache(max_tokens=1 << 20))
        watch = CpuWatch().start()
        items = mf.split_items(outputs, model.field_specs(outputs))
        split = watch.stop().wall_s
        runner.encode(items)
        if r == 0:
            continue  # warm-up
        samples["split"].append(split)
        for stage in STAGES[1:]:
            samples[stage].append(runner.last.seconds.get(stage, 0.0))
    return {s: statistics.median(v) for s, v in samples.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny tower only, 2 repeats")
    args = parser.parse_args()
    configure_torch(1)
    repeats = 2 if args.quick else args.repeats
    images = sample_images(8, (448, 448))
    towers: dict[str, str | dict] = {"tiny (embed 32, depth 2)": "tiny"}
    if not args.quick:
        towers["qwen2-vl width, 1 block"] = {"vision_config": {
            "depth": 1, "embed_dim": 1280, "hidden_size": 1536, "num_heads": 16}}
    print(f"encoder step, 8 images of 448x448 (8192 patches, 2048 tokens), {repeats} repeats, "
          "1 torch thread, device cpu")
    print(f"{'tower':<26}" + "".join(f"{s:>10}" for s in STAGES) + f"{'outside':>10}")
    watch = CpuWatch().start()
    for name, config in towers.items():
        med = step_breakdown(config, images, repeats)
        total = sum(med.values())
        outside = (total - med["encode"]) / total
        print(f"{name:<26}" + "".join(f"{med[s] * 1e3:>8.2f}ms" for s in STAGES) + f"{outside:>10.1%}")
    watch.stop()
    print(f"(median ms per stage; 'outside' = share of the step not in model.encode; "
          f"foreign CPU {watch.foreign_s:.2f} s)")

    from qwen2_vl_processor import compare_processors

    print()
    compare_processors(images, repeats=max(repeats, 5), label="8 x 448x448")
    return 0


if __name__ == "__main__":
    sys.exit(main())
