"""Ernie4.5-VL's vision transformer and resampler against transformers'
``Ernie4_5_VLMoeVisionTransformerPretrainedModel`` + ``VariableResolutionResamplerModel``."""

from __future__ import annotations

from collections.abc import Callable

import torch

import mmferry as mf
from mmferry.media import samples

NAME = "ernie4.5-vl"
REFERENCE = "transformers Ernie4_5_VLMoe vision tower + resampler"


def build(depth: int = 2) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
    from transformers import Ernie4_5_VLMoeConfig
    from transformers.models.ernie4_5_vl_moe.modeling_ernie4_5_vl_moe import (
        Ernie4_5_VLMoeVariableResolutionResamplerModel,
        Ernie4_5_VLMoeVisionTransformerPretrainedModel,
    )

    # ERNIE-4.5-VL-28B-A3B's encoder (vision width 1280, 16 heads, MLP 5120; resampler to the
    # language model's 2560), cut to `depth` blocks.
    config = Ernie4_5_VLMoeConfig(
        vision_config={"depth": depth, "hidden_size": 1280, "intermediate_size": 5120,
                       "num_heads": 16, "patch_size": 14, "spatial_merge_size": 2,
                       "temporal_merge_size": 2},
        text_config={"hidden_size": 2560, "num_hidden_layers": 1})
    ours = mf.models.load(NAME, config=config.to_dict())
    tower = Ernie4_5_VLMoeVisionTransformerPretrainedModel._from_config(
        config.vision_config, attn_implementation="sdpa").eval()
    resampler = Ernie4_5_VLMoeVariableResolutionResamplerModel(config).eval()
    state = ours.state_dict()
    missing, unexpected = tower.load_state_dict(
        {k.removeprefix("vision_model."): v for k, v in state.items()
         if k.startswith("vision_model.")}, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    names = {".0.": ".fc1.", ".2.": ".fc2.", ".3.": ".ln."}
    renamed = {}
    for k, v in state.items():
        if k.startswith("resampler_model."):
            k = k.removeprefix("resampler_model.")
            for a, b in names.items():
                k = k.replace(a, b)
            renamed[k] = v
    missing, unexpected = resampler.load_state_dict(renamed, strict=False)
    assert not missing and not unexpected, (missing, unexpected)

    images = [samples.photo_like(h, w, seed=i) for i, (h, w) in enumerate(((448, 448), (336, 504)))]
    inputs = ours.processor(images=images)
    pixels, grid = inputs["pixel_values"], inputs["image_grid_thw"]

    def run_ours() -> torch.Tensor:
        with torch.inference_mode():
            return ours.encode(pixel_values=pixels, image_grid_thw=grid)

    def run_theirs() -> torch.Tensor:
        with torch.inference_mode():
            return resampler(tower(pixels, grid_thw=grid).last_hidden_state, grid)

    return run_ours, run_theirs
