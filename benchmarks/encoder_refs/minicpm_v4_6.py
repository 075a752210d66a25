"""MiniCPM-V 4.6 encoder hook for ``benchmarks/encoders.py``: ours against transformers'
image-feature path (``MiniCPMV4_6VisionModel`` then ``MiniCPMV4_6Merger``, which is what
``MiniCPMV4_6Model.get_image_features`` runs) on the same weights.

Published width: the SigLIP-400M tower (1152 wide, 4304 MLP, 16 heads, patch 14, a 70×70
position table), depth cut to ``depth`` with the window merger after layer 0 so both sides
of it run; the merger's output width 2048 stands for the language model's (it only sizes
the last matmul). Inputs: two photo-like images through each side's own processor at the
default 448 resolution, "16x" mode: one sliced (source + 1×2 grid), one unsliced.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from PIL import Image
from torch import Tensor

NAME = "minicpm-v-4.6"
REFERENCE = "transformers 5.24 MiniCPMV4_6VisionModel + MiniCPMV4_6Merger (get_image_features)"

VISION = dict(hidden_size=1152, intermediate_size=4304, num_attention_heads=16, image_size=980,
              patch_size=14, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)
LM_WIDTH = 2048


def _photo(h: int, w: int, seed: int) -> np.ndarray:
    """Gradients, a few filled shapes and mild noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.stack([x / w * 200 + 30, y / h * 180 + 40, (x + y) / (w + h) * 120 + 60], -1)
    for _ in range(6):
        cy, cx, r = rng.uniform(0, h), rng.uniform(0, w), rng.uniform(0.05, 0.25) * min(h, w)
        img[(y - cy) ** 2 + (x - cx) ** 2 < r * r] = rng.uniform(0, 255, 3)
        y0, x0 = int(rng.uniform(0, h)), int(rng.uniform(0, w))
        img[y0:y0 + int(r), x0:x0 + int(2 * r)] = rng.uniform(0, 255, 3)
    img += rng.normal(0, 6, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def build(depth: int = 2) -> tuple[Callable[[], Tensor], Callable[[], Tensor]]:
    from transformers import MiniCPMV4_6Config
    from transformers.models.minicpmv4_6.image_processing_pil_minicpmv4_6 import (
        MiniCPMV4_6ImageProcessorPil,
    )
    from transformers.models.minicpmv4_6.modeling_minicpmv4_6 import (
        MiniCPMV4_6Merger,
        MiniCPMV4_6VisionModel,
    )

    import mmferry as mf
    from mmferry.models.minicpm_v4_6 import MiniCPMV46, VisionConfig

    config = MiniCPMV4_6Config(vision_config={**VISION, "num_hidden_layers": depth},
                               text_config={"model_type": "qwen3_5_text",
                                            "hidden_size": LM_WIDTH},
                               insert_layer_id=0)
    torch.manual_seed(0)
    tower = MiniCPMV4_6VisionModel._from_config(config.vision_config).eval()
    merger = MiniCPMV4_6Merger(config).eval()
    with torch.no_grad():
        for p in [*tower.parameters(), *merger.parameters()]:
            p.copy_(torch.randn(p.shape) * 0.02 + (1.0 if p.ndim == 1 else 0.0))

    ours = MiniCPMV46(VisionConfig.from_dict(config.to_dict())).eval().requires_grad_(False)
    state = {f"vision_tower.{k}": v for k, v in tower.state_dict().items()}
    state.update({f"merger.{k}": v for k, v in merger.state_dict().items()})
    ours.load_state_dict(state)

    images = [_photo(336, 600, 1), _photo(250, 380, 2)]
    outputs = ours.processor(images=images)
    (batch,) = mf.batch_items(mf.split_items(outputs, ours.field_specs(outputs)))
    data = dict(batch.data)
    hf = MiniCPMV4_6ImageProcessorPil()([Image.fromarray(i) for i in images], return_tensors="pt")
    pixels, sizes = hf["pixel_values"], hf["target_sizes"]

    def run_ours() -> Tensor:
        with torch.inference_mode():
            return ours.encode(**data)

    def run_reference() -> Tensor:
        with torch.inference_mode():
            hidden = tower(pixels, target_sizes=sizes, use_vit_merger=True).last_hidden_state
            return torch.cat(merger(hidden, sizes // 2))

    return run_ours, run_reference
