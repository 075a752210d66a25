"""Encoder benchmark hook for ``firered-lid``: our Conformer encoder against vLLM's
``ConformerEncoder`` (``vllm/model_executor/models/conformer_encoder.py``, which FireRedLID
used up to vLLM 0.28 and FireRedASR2 still uses in 0.33) on the same weights, at the
published width (d_model 1280, 20 heads, kernel 33) with the depth cut to ``depth`` blocks,
on three speech-like clips (3 s, 5 s, 8 s) through our processor.

The reference path is vLLM's ``embed_multimodal``: features zero-padded into one batch,
lengths moved as an int32 tensor, the encoder, and per-item rows cut at each
``enc_lengths[i].item()``. vLLM's linear layers need its tensor-parallel group, so
:func:`vllm_encoder` sets up a one-process CPU group (gloo) the first time.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

import torch

import mmferry as mf

NAME = "firered-lid"
REFERENCE = "vLLM 0.33 ConformerEncoder (FireRedLID / FireRedASR2 encoder)"

CLIP_SECONDS = (3.0, 5.0, 8.0)
# fireredlid.py's hf_to_vllm_mapper: the published FFN Sequential indices -> vLLM's names.
_CONTEXT: list[object] = []
_FFN_NAMES = {"net.0": "pre_layer_norm", "net.1": "linear_expand", "net.4": "linear_project"}


def real_config(depth: int) -> dict[str, object]:
    """The published FireRedLID encoder (vLLM's ``FireRedLIDConfig`` defaults), ``depth`` blocks."""
    return {"model_type": "fireredlid", "idim": 80, "d_model": 1280, "n_head": 20,
            "n_layers_enc": depth, "kernel_size": 33, "pe_maxlen": 5000}


def _init_vllm_cpu() -> None:
    """A current vLLM config and a one-process tensor-parallel group on the CPU."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    # The context stays entered for the process (vLLM layers look the config up when built
    # and run); the module holds it so it is never closed.
    _CONTEXT.append(set_current_vllm_config(config))
    _CONTEXT[-1].__enter__()
    init = os.path.join(tempfile.mkdtemp(prefix="mmferry-vllm-"), "init")
    parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                                distributed_init_method=f"file://{init}",
                                                backend="gloo")
    parallel_state.initialize_model_parallel(1, 1)


def _vllm_conformer() -> type[torch.nn.Module]:
    """vLLM's ``ConformerEncoder`` class, with vLLM set up to build it on the CPU."""
    try:
        from vllm.model_executor.models.conformer_encoder import ConformerEncoder

        _init_vllm_cpu()
    except Exception as e:  # not installed, or an install that cannot run on this machine
        raise ImportError(f"reference unavailable: vLLM's ConformerEncoder cannot be built here "
                          f"({type(e).__name__}: {e})") from e
    return ConformerEncoder


def vllm_encoder(model: torch.nn.Module) -> torch.nn.Module:
    """vLLM's ``ConformerEncoder`` built like ``model``'s encoder and loaded (strictly) with
    its weights, renamed as vLLM's FireRedLID loader renames the published names.

    Raises:
        ImportError: vLLM (or its conformer encoder) is not importable here, or its CPU
            setup fails; the message says so.
    """
    conformer_encoder = _vllm_conformer()
    cfg = model.config
    ref = conformer_encoder(idim=cfg.idim, n_layers_enc=cfg.n_layers_enc, n_head=cfg.n_head,
                           d_model=cfg.d_model, kernel_size=cfg.kernel_size, pe_maxlen=cfg.pe_maxlen)
    state = {}
    for name, value in model.state_dict().items():
        name = name.removeprefix("encoder.")
        for old, new in _FFN_NAMES.items():
            name = name.replace(old, new)
        state[name] = value
    ref.load_state_dict(state, strict=True)
    weight = model.encoder.input_preprocessor.out.weight
    return ref.to(weight.dtype).eval().requires_grad_(False)


def vllm_embed(encoder: torch.nn.Module, feats: list[torch.Tensor]) -> torch.Tensor:
    """vLLM's ``FireRedLIDForConditionalGeneration.embed_multimodal`` on per-clip features
    ``[T_i, 80]``, the per-item outputs concatenated."""
    lengths = torch.tensor([f.size(0) for f in feats], dtype=torch.int32)
    speech = torch.zeros(len(feats), int(lengths.max().item()), feats[0].shape[-1],
                         dtype=feats[0].dtype)
    for i, f in enumerate(feats):
        speech[i, : f.size(0)] = f
    out, enc_lengths, _ = encoder(speech, lengths)
    return torch.cat([out[i, : max(0, int(enc_lengths[i].item()))] for i in range(out.size(0))])


def build(depth: int = 2) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
    """(ours, reference) on the same weights and clips, each returning ``[Σ tokens, 1280]``.

    Raises:
        ImportError: vLLM's module is not importable here ("reference unavailable").
    """
    from mmferry.media.samples import speech_like

    _vllm_conformer()  # fail before building anything when the reference is unavailable
    model = mf.models.load(NAME, config=real_config(depth))
    ref = vllm_encoder(model)
    clips = [speech_like(s, seed=i) for i, s in enumerate(CLIP_SECONDS)]
    outputs = model.processor(audios=clips)
    (batch,) = mf.batch_items(mf.split_items(outputs, model.field_specs(outputs)))
    data = mf.Transfer("cpu").to_device(batch)
    feats = list(outputs["input_features"])

    @torch.inference_mode()
    def ours() -> torch.Tensor:
        return model.encode(**data)

    @torch.inference_mode()
    def reference() -> torch.Tensor:
        return vllm_embed(ref, feats)

    return ours, reference
