"""Qwen2-Audio's audio encoder against transformers' ``Qwen2AudioEncoder`` and projector."""

from __future__ import annotations

from collections.abc import Callable

import torch

import mmferry as mf
from mmferry.media import samples

NAME = "qwen2-audio"
REFERENCE = "transformers Qwen2AudioEncoder + projector (Qwen2AudioModel.forward's audio path)"


def build(depth: int = 2, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
          ) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
    from transformers import Qwen2AudioEncoderConfig
    from transformers.masking_utils import create_bidirectional_mask
    from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder

    # Qwen2-Audio-7B's encoder (Whisper-large-v3: d 1280, 20 heads, 128 mel bins), its
    # projector to the 4096-wide language model, cut to `depth` layers.
    audio = {"num_mel_bins": 128, "d_model": 1280, "encoder_layers": depth,
             "encoder_attention_heads": 20, "encoder_ffn_dim": 5120, "max_source_positions": 1500}
    ours = mf.models.load(NAME, config={"model_type": "qwen2_audio", "audio_config": audio,
                                        "text_config": {"hidden_size": 4096}})
    tower = Qwen2AudioEncoder._from_config(Qwen2AudioEncoderConfig(**audio),
                                           attn_implementation="sdpa").eval()
    projector = torch.nn.Linear(1280, 4096)
    state = ours.state_dict()
    missing, unexpected = tower.load_state_dict(
        {k.removeprefix("audio_tower."): v for k, v in state.items() if k.startswith("audio_tower.")},
        strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    projector.load_state_dict({k.removeprefix("multi_modal_projector.linear."): v
                               for k, v in state.items() if k.startswith("multi_modal_projector.")})
    # Two requests' clips: 6.2 s and 17.9 s of speech-like audio.
    clips = [(samples.speech_like(s, 16000, seed=i), 16000) for i, s in enumerate((6.2, 17.9))]
    inputs = ours.processor(audios=clips)
    ours.to(device, dtype)
    tower.to(device, dtype)
    projector.to(device, dtype)
    # The features go to the device; the length fields stay on the host, where they belong.
    inputs["input_features"] = inputs["input_features"].to(device)
    features, mask = inputs["input_features"], inputs["feature_attention_mask"].to(device)

    def run_ours() -> torch.Tensor:
        with torch.inference_mode():
            return ours.encode(**inputs)

    def run_theirs() -> torch.Tensor:
        # Qwen2AudioModel.forward's audio lines: key mask from the frame mask, the whole padded
        # sequence, the projector, then a boolean-mask selection of each clip's tokens.
        with torch.inference_mode():
            feat_lengths, out_lengths = tower._get_feat_extract_output_lengths(mask.sum(-1))
            b, _, frames = features.shape
            positions = (frames - 2) // 2 + 1
            valid = (torch.arange(positions, device=mask.device)[None, :] < feat_lengths[:, None]).long()
            attention = create_bidirectional_mask(
                config=tower.config, inputs_embeds=torch.zeros(b, positions, 1, dtype=dtype,
                                                               device=mask.device),
                attention_mask=valid)
            embeds = projector(tower(features, attention_mask=attention).last_hidden_state)
            keep = torch.arange(embeds.shape[1], device=mask.device)[None, :] < out_lengths[:, None]
            return embeds[keep]

    return run_ours, run_theirs
