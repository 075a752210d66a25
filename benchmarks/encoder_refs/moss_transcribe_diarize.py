"""MOSS-Transcribe-Diarize's audio encoder against transformers'
``MossTranscribeDiarizeModel.get_audio_features``."""

from __future__ import annotations

from collections.abc import Callable

import torch

import mmferry as mf
from mmferry.media import samples

NAME = "moss-transcribe-diarize"
REFERENCE = "transformers MossTranscribeDiarizeModel.get_audio_features"


def build(depth: int = 2, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
          ) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
    from transformers import MossTranscribeDiarizeConfig
    from transformers.models.moss_transcribe_diarize.feature_extraction_moss_transcribe_diarize import (
        MossTranscribeDiarizeFeatureExtractor,
    )
    from transformers.models.moss_transcribe_diarize.modeling_moss_transcribe_diarize import (
        MossTranscribeDiarizeModel,
    )

    # The published model: Whisper-medium encoder (d 1024, 16 heads, 80 mel bins), 4x merge,
    # adaptor to Qwen3-0.6B's width 1024; encoder cut to `depth` layers. The reference's
    # language model is one tiny layer (never run).
    audio = {"num_mel_bins": 80, "hidden_size": 1024, "num_hidden_layers": depth,
             "num_attention_heads": 16, "intermediate_size": 4096, "max_source_positions": 1500}
    text = {"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 16, "num_key_value_heads": 8,
            "head_dim": 64, "vocab_size": 16}
    config = MossTranscribeDiarizeConfig(audio_config=audio, text_config=text)
    ours = mf.models.load(NAME, config=config.to_dict())
    config._attn_implementation = "sdpa"
    theirs = MossTranscribeDiarizeModel(config).eval()
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("language_model.") for k in missing), missing
    # One 41.5 s recording: two 30 s windows, the second partial.
    clip = samples.speech_like(41.5, 16000, seed=0)
    inputs = ours.processor(audios=[(clip, 16000)])
    fe = MossTranscribeDiarizeFeatureExtractor(feature_size=80)
    ref = fe([clip], sampling_rate=16000, return_tensors="pt")
    ours.to(device, dtype)
    theirs.to(device, dtype)
    # The features go to the device; our three length fields stay on the host.
    inputs["input_features"] = inputs["input_features"].to(device)
    ref = {k: v.to(device) for k, v in ref.items()}

    def run_ours() -> torch.Tensor:
        with torch.inference_mode():
            return ours.encode(**inputs)

    def run_theirs() -> torch.Tensor:
        with torch.inference_mode():
            return theirs.get_audio_features(ref["input_features"], ref["input_features_mask"],
                                             ref["padding_mask"]).pooler_output

    return run_ours, run_theirs
