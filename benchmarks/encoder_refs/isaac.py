"""Isaac's encoder, ours against vLLM 0.33's ``IsaacVisionEmbedding``, on the same weights.

The reference is vLLM's own module (Siglip2 NaViT + pixel shuffle + projector), built on the
CPU in a single-process gloo context and loaded through its ``load_weights`` from our state
dict; its input is what vLLM's ``_process_image_input`` gives it (the grid's ``(h, w)``
columns as int32). vLLM is not a project dependency: in the project environment ``build``
raises ``ImportError``; run the harness with vLLM's environment (``/work/venv-vllm``) to time
it.

Width: Isaac-0.1's published encoder (SigLIP2-so400m/16: 1152 wide, 16 heads, MLP 4304,
16×16 position grid, pixel shuffle 2) into a 2048-wide language model; depth cut to
``depth``. Inputs: three photo-like images (``mmferry.media.samples.photo_like``) of
different aspect ratios through our processor at up to 768 patches each.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable

import torch

import mmferry as mf
from mmferry.media import samples

NAME = "isaac"
REFERENCE = "vLLM 0.33 IsaacVisionEmbedding (CPU, torch SDPA over cu_seqlens)"

PUBLISHED = {"model_type": "isaac", "hidden_size": 2048, "vision_config": {
    "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_channels": 3, "patch_size": 16, "num_patches": 256,
    "pixel_shuffle_scale_factor": 2, "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6}}
IMAGES = [(480, 640), (640, 400), (360, 360)]
BOUNDS = dict(max_num_patches=768, min_num_patches=256)

_READY: list[bool] = []
_CONTEXT: list = []  # vLLM's config context, held open: its layers read it when built


def vllm_context() -> None:
    """Enter the vLLM config and single-process distributed context its layers need (once)."""
    try:
        from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel
    except ImportError as e:
        raise ImportError(f"vLLM is not installed here ({e}); run "
                          "with /work/venv-vllm/bin/python") from e
    if _READY:
        return
    _CONTEXT.append(set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))))
    _CONTEXT[-1].__enter__()
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"file://{tempfile.mktemp()}")
    initialize_model_parallel(1, 1)
    _READY.append(True)


def vllm_reference(config: dict, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """vLLM's ``IsaacVisionEmbedding`` for ``config`` (a config.json dict), loaded from our
    state dict by vLLM's own loader (checkpoint ``0`` -> transformer, ``1`` / ``3`` ->
    projector)."""
    vllm_context()
    from vllm.model_executor.models.isaac import IsaacVisionEmbedding
    from vllm.transformers_utils.configs.isaac import IsaacConfig

    cfg = IsaacConfig(**config)
    vision = cfg.vision_config
    shuffled = vision.hidden_size * vision.pixel_shuffle_scale_factor ** 2
    ref = IsaacVisionEmbedding(vision_cfg=vision, hidden_dim=shuffled,
                               output_dim=cfg.hidden_size).eval()
    tower = [(k.removeprefix("vision_embedding.0."), v) for k, v in state.items()
             if k.startswith("vision_embedding.0.")]
    loaded = ref.transformer.load_weights(tower)
    if len(loaded) != sum(1 for _ in ref.transformer.parameters()):
        raise RuntimeError(f"vLLM loaded {len(loaded)} of its tower's parameters")
    with torch.inference_mode():
        ref.linear_fc1.weight.copy_(state["vision_embedding.1.weight"])
        ref.linear_fc2.weight.copy_(state["vision_embedding.3.weight"])
    return ref.requires_grad_(False)


def build(depth: int = 2) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
    """(ours, reference) at the published width with ``depth`` layers, on the same weights."""
    vllm_context()  # fail early, before building anything, when vLLM is absent
    config = {**PUBLISHED, "vision_config": {**PUBLISHED["vision_config"],
                                             "num_hidden_layers": depth}}
    ours = mf.models.load(NAME, config=config)
    ref = vllm_reference(config, ours.state_dict())
    images = [samples.photo_like(h, w, seed=i) for i, (h, w) in enumerate(IMAGES)]
    batch = ours.processor(images=images, **BOUNDS)
    pixels, grid = batch["pixel_values"], batch["image_grid_thw"]

    def run_ours() -> torch.Tensor:
        with torch.inference_mode():
            return ours.encode(pixel_values=pixels, image_grid_thw=grid)

    def run_reference() -> torch.Tensor:
        # As vLLM's _process_image_input feeds it (on the CPU the pinned staging is a no-op).
        with torch.inference_mode():
            spatial = grid[:, 1:3].to(torch.int32)
            return ref((pixels.to(ref.linear_fc1.weight.dtype), spatial))

    return run_ours, run_reference
