"""Ernie4.5-VL processing: mmferry's processor against transformers' on the same media.

Images against ``Ernie4_5_VLMoeImageProcessorPil``; videos against
``Ernie4_5_VLMoeVideoProcessor`` without and with timestamps drawn on the frames, which needs
torchvision: without it the video rows say so. mmferry runs in its float32 mode (transformers'
values: ``exact`` resizing for images, ``fast`` for videos; ``benchmarks/preprocess.py`` and
``ernie4_5_vl_pixels.py`` time the uint8 default). For each set: outputs compared bit for bit, then both timed
interleaved in rotating order, median over rounds.

    python3 benchmarks/ernie4_5_vl_processor.py [--rounds 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import ImageFont

import mmferry.models as mf_models
from mmferry.media import samples
from mmferry.models.ernie4_5_vl import Ernie45VL

IMAGES = {
    "8 mixed images": [(448, 448), (640, 480), (375, 500), (1024, 768), (224, 336), (720, 1280),
                       (500, 500), (300, 900)],
}
EXACT = {"pixel_dtype": "float32", "resize_mode": "exact"}
FAST = {"pixel_dtype": "float32", "resize_mode": "fast"}
VIDEOS = {
    "2 clips 16+9 frames": [(16, 360, 640), (9, 240, 320)],
    "1 clip 200 frames": [(200, 120, 160)],
}


def median_seconds(fns: dict[str, Callable[[], Any]], rounds: int,
                   clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median seconds of each function over ``rounds`` runs in rotating order, on ``clock``."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for name in names:
        fns[name]()
    for r in range(max(rounds, 1)):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = clock()
            fns[name]()
            times[name].append(clock() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _row(label: str, values: str, ours: Any, ref: Any, grid: str, seconds: dict[str, float]) -> None:
    same = torch.equal(ours[values], ref[values]) and torch.equal(ours[grid], ref[grid])
    diff = (ours[values] - ref[values]).abs().max().item() if ours[values].shape == ref[values].shape \
        else float("nan")
    print(f"{label:<22} {'equal' if same else 'DIFFER'} (max |diff| {diff:.1e}, "
          f"{tuple(ours[values].shape)})  mmferry {seconds['mmferry'] * 1e3:8.1f} ms  "
          f"transformers {seconds['transformers'] * 1e3:8.1f} ms  "
          f"speed-up {seconds['transformers'] / seconds['mmferry']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers.models.ernie4_5_vl_moe.image_processing_pil_ernie4_5_vl_moe import (
        Ernie4_5_VLMoeImageProcessorPil,
    )

    model = mf_models.load("ernie4.5-vl")
    pil = Ernie4_5_VLMoeImageProcessorPil()
    for label, sizes in IMAGES.items():
        imgs = [samples.photo_like(h, w, seed=i) for i, (h, w) in enumerate(sizes)]
        fns = {"mmferry": lambda x=imgs: model.processor(images=x, **EXACT),
               "transformers": lambda x=imgs: pil(images=x, return_tensors="pt")}
        _row(label, "pixel_values", fns["mmferry"](), fns["transformers"](), "image_grid_thw",
             median_seconds(fns, args.rounds))
    try:
        from transformers.models.ernie4_5_vl_moe.video_processing_ernie4_5_vl_moe import (
            Ernie4_5_VLMoeVideoProcessor,
        )
    except ImportError as e:
        print(f"videos: transformers' video processor unavailable ({e})")
        return
    video = Ernie4_5_VLMoeVideoProcessor(draw_on_frames=False)
    # With timestamps: the video processor's config saved beside a font (Pillow's embedded
    # TrueType font), read back by our model as a checkpoint folder's processor files.
    folder = Path(tempfile.mkdtemp())
    font = folder / "font.ttf"
    font.write_bytes(ImageFont.load_default(size=10).font_bytes)
    drawing = Ernie4_5_VLMoeVideoProcessor(font=str(font))
    drawing.save_pretrained(folder)
    Ernie4_5_VLMoeImageProcessorPil().save_pretrained(folder)
    with torch.device("meta"):
        model_drawing = Ernie45VL.from_config(None, folder)
    assert model_drawing.processor_config.timestamp_font is not None
    for label, shapes in VIDEOS.items():
        clips = [np.ascontiguousarray(samples.video_like(t, h, w, seed=i))
                 for i, (t, h, w) in enumerate(shapes)]
        for name, ours, theirs in ((label, model, video),
                                   (f"{label}, timestamps", model_drawing, drawing)):
            fns = {"mmferry": lambda x=clips, m=ours: m.processor(videos=x, **FAST),
                   "transformers": lambda x=clips, p=theirs: p(videos=x, return_tensors="pt")}
            _row(name, "pixel_values_videos", fns["mmferry"](), fns["transformers"](),
                 "video_grid_thw", median_seconds(fns, args.rounds))


if __name__ == "__main__":
    main()
