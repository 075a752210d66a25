"""Isaac's processor: mmferry's modes against the reference processors, time and pixels.

Isaac has no Pillow processor anywhere, so the peers are:

* vLLM 0.33's ``IsaacImageProcessor`` (what vLLM serves Isaac with; vLLM builds it with its
  defaults: patch 16, 6144 / 256 patches, pixel shuffle 2): torch's bilinear resize on the
  uint8 pixels, then float normalising and patchifying. mmferry's pixels are its pixels bit
  for bit in both modes, so it is the peer of ``exact`` and, as no torchvision processor is
  installed, of ``fast`` too.
* transformers main's ``IsaacImageProcessor`` (a ``TorchvisionBackend``; transformers 5.24
  has no Isaac): it resizes in float32 and rounds to uint8. Not installed, so its steps are
  restated here (from PIL image to patches, without the class's own overhead: a lower bound
  of its time) to measure its pixels against vLLM's and time it.

1 torch thread, photo-like images as PIL images, interleaved runs, medians of CPU time.
Run in the vLLM environment from the repository root (not a test):

    PYTHONPATH=src /work/venv-vllm/bin/python benchmarks/speed_isaac.py [--runs 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

import mmferry.models as models
from mmferry.media.samples import photo_like
from mmferry.models.isaac import target_size

SIZES = [(448, 448), (1024, 768), (1920, 1080)]  # width × height
CONFIG = {"model_type": "isaac", "hidden_size": 40, "vision_config": {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 2, "patch_size": 16, "num_patches": 256,
    "pixel_shuffle_scale_factor": 2}}


def transformers_main_steps(image: Image.Image, patch: int = 16) -> dict[str, torch.Tensor]:
    """transformers main's Isaac processor restated: uint8 CHW tensor, float32 bilinear
    resize, clamp and round to uint8, rescale and normalise (mean = std = 0.5), patches."""
    chw = torch.from_numpy(np.array(image)).permute(2, 0, 1)[None]
    h, w = target_size(image.height, image.width, patch, 2, 6144, 256)
    resized = F.interpolate(chw.float(), size=(h, w), mode="bilinear", align_corners=False)
    levels = resized.clamp(0, 255).round().to(torch.uint8)
    x = (levels.float() * (1 / 255) - 0.5) / 0.5
    patches = F.unfold(x, (patch, patch), stride=(patch, patch)).view(1, 3, patch, patch, -1)
    return {"pixel_values": patches.permute(0, 4, 2, 3, 1).reshape(-1, 3 * patch * patch),
            "levels": levels}


def cpu_times(fns: dict[str, Callable[[], object]], runs: int) -> dict[str, float]:
    """Median CPU seconds of each function, the functions interleaved run by run (in
    alternating order, so none always runs right after the same one)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm up
    for r in range(runs):
        for name in list(fns) if r % 2 == 0 else reversed(list(fns)):
            start = time.process_time()
            fns[name]()
            times[name].append(time.process_time() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def contenders(vllm: Callable[[Image.Image], object], model: torch.nn.Module,
               image: Image.Image) -> dict[str, Callable[[], object]]:
    return {
        "vllm": lambda: vllm(image),
        "transformers_main_steps": lambda: transformers_main_steps(image),
        "exact_uint8": lambda: model.processor(images=image, resize_mode="exact"),
        "fast_uint8": lambda: model.processor(images=image, resize_mode="fast"),
        "exact_float32": lambda: model.processor(images=image, resize_mode="exact",
                                                 pixel_dtype="float32"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from vllm.transformers_utils.processors.isaac import IsaacImageProcessor

    vllm = IsaacImageProcessor()
    model = models.load("isaac", config=CONFIG, materialize=False)
    for width, height in SIZES:
        image = Image.fromarray(photo_like(height, width))
        ref = vllm(image)["pixel_values"]
        exact = model.processor(images=image, resize_mode="exact", pixel_dtype="float32")
        fast_u8 = model.processor(images=image, resize_mode="fast")["pixel_values"]
        assert torch.equal(exact["pixel_values"], ref), "exact is not vLLM's pixels"
        levels = (ref * 0.5 + 0.5) * 255  # vLLM's pixels back to levels, exact to 1e-4
        fast_diff = (fast_u8.float() - levels).abs()
        peer = transformers_main_steps(image)
        peer_diff = (peer["pixel_values"] - ref).abs() * 127.5
        t = cpu_times(contenders(vllm, model, image), args.runs)
        grid = exact["image_grid_thw"][0].tolist()
        print(f"{width}x{height} -> grid {grid}: vLLM {t['vllm'] * 1e3:.2f} ms, transformers "
              f"main steps {t['transformers_main_steps'] * 1e3:.2f} ms")
        print(f"   exact uint8 {t['exact_uint8'] / t['vllm']:.2f}x vLLM; fast uint8 "
              f"{t['fast_uint8'] / t['vllm']:.2f}x vLLM, "
              f"{t['fast_uint8'] / t['transformers_main_steps']:.2f}x transformers main steps; "
              f"exact float32 {t['exact_float32'] / t['vllm']:.2f}x vLLM")
        print(f"   bytes uint8 {fast_u8.nbytes} vs float32 {ref.nbytes} "
              f"({fast_u8.nbytes / ref.nbytes:.2f}x)")
        print(f"   fast vs exact: max {fast_diff.max().item():.4f} mean "
              f"{fast_diff.mean().item():.4f} levels; transformers main vs vLLM: max "
              f"{peer_diff.max().item():.4f} mean {peer_diff.mean().item():.4f} levels")


if __name__ == "__main__":
    main()
