"""Ernie4.5-VL image preprocessing, uint8 pixels: mmferry's ``exact`` against transformers'
``Ernie4_5_VLMoeImageProcessorPil`` and ``fast`` against its torchvision
``Ernie4_5_VLMoeImageProcessor`` (what vLLM loads by default), one image per call, one torch
thread, photo-like images, CPU-time medians of interleaved runs in rotating order. Also the
fast-vs-exact difference in pixel levels, ours and transformers' own, the bytes of uint8 and
float32 pixels, and one video set (uint8 ``fast`` against ``Ernie4_5_VLMoeVideoProcessor``).

    python3 benchmarks/ernie4_5_vl_pixels.py [--rounds 15]

Needs torchvision (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import time

import torch
from ernie4_5_vl_processor import median_seconds
from PIL import Image

import mmferry.models as mf_models
from mmferry.media import samples

SIZES = [(448, 448), (1024, 768), (1920, 1080)]  # width x height


def _levels(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> tuple[float, float]:
    d = (a.double() - b.double()).abs().view(a.shape[0], 3, -1) / scale[:, None]
    return d.max().item(), d.mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers.models.ernie4_5_vl_moe.image_processing_ernie4_5_vl_moe import (
        Ernie4_5_VLMoeImageProcessor,
    )
    from transformers.models.ernie4_5_vl_moe.image_processing_pil_ernie4_5_vl_moe import (
        Ernie4_5_VLMoeImageProcessorPil,
    )

    model = mf_models.load("ernie4.5-vl")
    pil, tv = Ernie4_5_VLMoeImageProcessorPil(), Ernie4_5_VLMoeImageProcessor()
    a, _ = model.normalize.affine()  # normalised units per level
    for w, h in SIZES:
        image = Image.fromarray(samples.photo_like(h, w))
        fns = {
            "pil": lambda x=image: pil(images=[x], return_tensors="pt"),
            "torchvision": lambda x=image: tv(images=[x], return_tensors="pt"),
            "exact": lambda x=image: model.processor(images=[x], resize_mode="exact"),
            "fast": lambda x=image: model.processor(images=[x], resize_mode="fast"),
        }
        out = {name: fn() for name, fn in fns.items()}
        floats = {m: model.processor(images=[image], resize_mode=m, pixel_dtype="float32")
                  for m in ("exact", "fast")}
        same = (torch.equal(floats["exact"]["pixel_values"], out["pil"]["pixel_values"]),
                torch.equal(floats["fast"]["pixel_values"], out["torchvision"]["pixel_values"]))
        ours = _levels(out["fast"]["pixel_values"], out["exact"]["pixel_values"], torch.ones(3))
        theirs = _levels(out["torchvision"]["pixel_values"], out["pil"]["pixel_values"], a)
        s = median_seconds(fns, args.rounds, time.process_time)
        print(f"{w}x{h}: pil {s['pil'] * 1e3:6.1f} ms  exact {s['exact'] * 1e3:6.1f} ms "
              f"({s['exact'] / s['pil']:.2f}x) | torchvision {s['torchvision'] * 1e3:6.1f} ms  "
              f"fast {s['fast'] * 1e3:6.1f} ms ({s['fast'] / s['torchvision']:.2f}x) | float32 "
              f"exact==pil {same[0]}, fast==torchvision {same[1]} | fast-exact levels max "
              f"{ours[0]:.0f} mean {ours[1]:.3f}, transformers tv-pil max {theirs[0]:.2f} mean "
              f"{theirs[1]:.3f} | bytes uint8 {out['fast']['pixel_values'].nbytes} vs float32 "
              f"{floats['fast']['pixel_values'].nbytes}")
    from transformers.models.ernie4_5_vl_moe.video_processing_ernie4_5_vl_moe import (
        Ernie4_5_VLMoeVideoProcessor,
    )

    video = Ernie4_5_VLMoeVideoProcessor(draw_on_frames=False)
    clips = [samples.video_like(16, 360, 640, seed=0), samples.video_like(9, 240, 320, seed=1)]
    s = median_seconds({"torchvision": lambda: video(videos=clips, return_tensors="pt"),
                        "fast": lambda: model.processor(videos=clips)}, max(args.rounds // 3, 3),
                       time.process_time)
    print(f"videos 16x640x360 + 9x320x240: torchvision video processor "
          f"{s['torchvision'] * 1e3:6.1f} ms  fast uint8 {s['fast'] * 1e3:6.1f} ms "
          f"({s['fast'] / s['torchvision']:.2f}x)")


if __name__ == "__main__":
    main()
