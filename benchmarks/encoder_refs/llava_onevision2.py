"""LLaVA-OneVision-2's vision tower against vLLM 0.33's ``LlavaOnevision2VisionTower``.

OV2 is not in transformers, so the reference is vLLM's module, run on the CPU. vLLM is not a
dependency of this project: in the project environment ``build`` raises ImportError (the
harness reports the reference as unavailable). Run the harness with the vLLM venv instead:

    PYTHONPATH=src /work/venv-vllm/bin/python benchmarks/encoders.py --only llava-onevision2
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

import mmferry as mf
from mmferry.media import samples

NAME = "llava-onevision2"
REFERENCE = "vLLM 0.33 LlavaOnevision2VisionTower (CPU platform, torch SDPA)"

# LLaVA-OneVision-2-8B: the OneVision encoder (hidden 1024, 16 heads, MLP 4096, patch 14,
# merge 2, windows of 4 frames) merged into Qwen3-8B's width 4096.
PUBLISHED = {
    "model_type": "llava_onevision2",
    "vision_config": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
                      "intermediate_size": 4096, "patch_size": 14, "spatial_merge_size": 2,
                      "num_channels": 3, "frame_windows_size": 4, "rope_theta": 10000.0,
                      "layer_norm_eps": 1e-6},
    "text_config": {"hidden_size": 4096},
}

_context: Any = None


def vllm_module() -> Any:
    """vLLM's ``llava_onevision2`` module, set up to build its tower on the CPU: the CPU
    platform, a default config context and a one-process gloo group (once per process).

    Raises ImportError when vLLM is not installed."""
    global _context
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise ImportError(f"vLLM is not installed in this environment ({e}); run with the "
                          "vLLM venv's python") from None
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    if _context is None:
        _context = set_current_vllm_config(VllmConfig())
        _context.__enter__()
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method="tcp://127.0.0.1:29517")
        initialize_model_parallel(1, 1)
    import vllm.model_executor.models.llava_onevision2 as ov2
    return ov2


def vllm_tower(model: Any) -> torch.nn.Module:
    """vLLM's tower for ``model``'s config, holding ``model``'s weights (copied by name).

    vLLM's CPU GEMM dispatch needs the compiled ``vllm._C`` of its CPU wheel; each linear
    layer gets ``torch.nn.functional.linear`` instead, the kernel its fallback uses."""
    ov2 = vllm_module()
    cfg = model.config
    vision = SimpleNamespace(
        patch_size=cfg.patch_size, spatial_merge_size=cfg.spatial_merge_size,
        num_channels=cfg.num_channels, hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        intermediate_size=cfg.intermediate_size, frame_windows_size=cfg.frame_windows_size,
        rope_theta=cfg.rope_theta)
    tower = ov2.LlavaOnevision2VisionTower(vision, text_hidden_size=cfg.text_hidden_size,
                                           norm_eps=cfg.layer_norm_eps, prefix="visual")
    state = model.state_dict()
    with torch.no_grad():
        for name, p in tower.named_parameters():
            p.copy_(state["visual." + name])
    for m in tower.modules():
        if hasattr(m, "quant_method"):
            m.cpu_linear = torch.nn.functional.linear
    return tower.eval()


def build(depth: int = 2) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
    vllm_module()
    config = {**PUBLISHED, "vision_config": {**PUBLISHED["vision_config"],
                                             "num_hidden_layers": depth}}
    ours = mf.models.load(NAME, config=config)
    theirs = vllm_tower(ours)
    images = [samples.photo_like(h, w, seed=i) for i, (h, w) in enumerate(((448, 448), (336, 504)))]
    inputs = ours.processor(images=images)
    pixels, grid, positions = (inputs[k] for k in ("pixel_values", "image_grid_thw",
                                                   "patch_positions"))

    def run_ours() -> torch.Tensor:
        with torch.inference_mode():
            return ours.encode(pixel_values=pixels, image_grid_thw=grid,
                               patch_positions=positions)

    def run_theirs() -> torch.Tensor:
        with torch.inference_mode():
            return theirs(pixels, grid, positions)

    return run_ours, run_theirs
