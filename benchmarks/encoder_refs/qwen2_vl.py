"""Qwen2-VL's vision tower against transformers' ``Qwen2VisionTransformerPretrainedModel``."""

from __future__ import annotations

from collections.abc import Callable

import torch

import mmferry as mf
from mmferry.media import samples

NAME = "qwen2-vl"
REFERENCE = "transformers Qwen2VisionTransformerPretrainedModel"


def build(depth: int = 2) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
    )

    # Qwen2-VL-7B's vision tower (embed 1280, 16 heads, merger to 3584), cut to `depth`.
    vision = {"depth": depth, "embed_dim": 1280, "hidden_size": 3584, "num_heads": 16,
              "mlp_ratio": 4, "patch_size": 14, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "in_chans": 3}
    ours = mf.models.load(NAME, config={"vision_config": vision})
    theirs = Qwen2VisionTransformerPretrainedModel._from_config(
        Qwen2VLVisionConfig(**vision), attn_implementation="sdpa").eval()
    missing, unexpected = theirs.load_state_dict(
        {k.removeprefix("visual."): v for k, v in ours.state_dict().items()}, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    images = [samples.photo_like(h, w, seed=i) for i, (h, w) in enumerate(((448, 448), (336, 504)))]
    inputs = ours.processor(images=images)
    pixels, grid = inputs["pixel_values"], inputs["image_grid_thw"]

    def run_ours() -> torch.Tensor:
        with torch.inference_mode():
            return ours.encode(pixel_values=pixels, image_grid_thw=grid)

    def run_theirs() -> torch.Tensor:
        with torch.inference_mode():
            return theirs(pixels, grid_thw=grid).pooler_output

    return run_ours, run_theirs
