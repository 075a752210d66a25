"""MOSS-Transcribe-Diarize: chunked features, token counts and embeddings equal transformers'
on the same tiny random weights (clips over 30 s take several chunks); both checkpoint
layouts load by name; the three length fields are read on the host only."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import mmferry as mf
from mmferry.errors import ArgumentError, ContractError, MediaError
from mmferry.media.samples import speech_like
from mmferry.models import moss_transcribe_diarize as moss
from mmferry.models.whisper import EncoderConfig

transformers = pytest.importorskip("transformers")
from transformers.models.moss_transcribe_diarize.feature_extraction_moss_transcribe_diarize import (  # noqa: E402
    MossTranscribeDiarizeFeatureExtractor,
)
from transformers.models.moss_transcribe_diarize.processing_moss_transcribe_diarize import (  # noqa: E402
    MossTranscribeDiarizeProcessor,
)

SECONDS = (0.05, 2.9, 30.0, 31.0, 61.3)  # 1 token, a partial chunk, exact, 2 and 3 chunks


@pytest.fixture(scope="module")
def model() -> moss.MossTranscribeDiarize:
    return mf.models.load("moss-transcribe-diarize")


@pytest.fixture(scope="module")
def clips() -> list[np.ndarray]:
    return [speech_like(s, seed=i) for i, s in enumerate(SECONDS)]


def _hf_config(audio: EncoderConfig, text_hidden: int) -> object:
    return transformers.MossTranscribeDiarizeConfig(
        audio_config=dict(num_mel_bins=audio.num_mel_bins, num_hidden_layers=audio.encoder_layers,
                          num_attention_heads=audio.encoder_attention_heads,
                          intermediate_size=audio.encoder_ffn_dim, hidden_size=audio.d_model,
                          max_source_positions=audio.max_source_positions),
        text_config=dict(model_type="qwen3", hidden_size=text_hidden, head_dim=8,
                         intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=64))


def _hf_tokens(fe: object, ref: dict, count: int, merge: int) -> list[int]:
    """Per clip, the placeholder count MossTranscribeDiarizeProcessor puts in the prompt."""
    window = fe.n_samples
    chunks = ((ref["padding_mask"].sum(-1) + window - 1) // window).clamp(min=1)
    mapping = torch.repeat_interleave(torch.arange(count), chunks)
    holder = type("Holder", (), {"audio_merge_size": merge})()
    return MossTranscribeDiarizeProcessor._get_audio_token_length(
        holder, ref["input_features_mask"].sum(-1), mapping).tolist()


def test_chunked_features_and_token_counts_equal_transformers(model, clips) -> None:
    out = model.processor(audios=[(c, 16000) for c in clips])
    fe = MossTranscribeDiarizeFeatureExtractor(feature_size=80)
    ref = fe(clips, sampling_rate=16000, return_tensors="pt")
    torch.testing.assert_close(out["input_features"], ref["input_features"], atol=1e-4, rtol=0)
    assert out["audio_chunk_counts"].tolist() == [1, 1, 1, 2, 3]
    tokens = _hf_tokens(fe, ref, len(clips), 4)
    assert out["audio_token_lengths"].tolist() == tokens == [1, 37, 375, 388, 767]
    items = mf.split_items(out, model.field_specs(out)).in_order()
    assert [model.tokens_per_item(i) for i in items] == tokens
    # vLLM's count from the raw length agrees: per chunk (samples - 1) // 1280 + 1.
    for clip, n in zip(clips, tokens, strict=True):
        assert n == sum((min(480000, len(clip) - s) - 1) // 1280 + 1 for s in range(0, len(clip), 480000))


def _reference(model: moss.MossTranscribeDiarize) -> object:
    ref = transformers.MossTranscribeDiarizeForConditionalGeneration(
        _hf_config(model.config.audio, model.hidden_size)).eval()
    missing = ref.model.load_state_dict(model.state_dict(), strict=False)
    assert not missing.unexpected_keys
    assert all(k.startswith("language_model.") for k in missing.missing_keys)
    return ref


def test_embeddings_equal_transformers_batched_and_alone(model, clips) -> None:
    ref = _reference(model)
    # A partial chunk; one full chunk (alone, every row kept); two chunks, the second partial.
    clips = [clips[1], clips[2], clips[3]]
    out = model.processor(audios=[(c, 16000) for c in clips])
    feats = MossTranscribeDiarizeFeatureExtractor(feature_size=80)(clips, sampling_rate=16000,
                                                                   return_tensors="pt")
    with torch.no_grad():
        expected = ref.model.get_audio_features(feats["input_features"], feats["input_features_mask"],
                                                feats["padding_mask"]).pooler_output
        got = model.encode(**out)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    start = 0
    for item in mf.split_items(out, model.field_specs(out)).in_order():
        n = model.tokens_per_item(item)
        alone = mf.EncoderRunner(model, device="cpu").encode([item])[0]
        torch.testing.assert_close(alone, expected[start:start + n], atol=1e-4, rtol=0)
        start += n
    assert start == len(expected)


def _tiny_hf(tmp_path: Path) -> tuple[object, Path]:
    """A sharded transformers checkpoint: 8 mel bins, 1 s chunks (100 frames), merge 2."""
    cfg = _hf_config(EncoderConfig(num_mel_bins=8, d_model=16, encoder_layers=1,
                                   encoder_attention_heads=2, encoder_ffn_dim=32,
                                   max_source_positions=50), 24)
    cfg.audio_merge_size = 2
    torch.manual_seed(1)
    ref = transformers.MossTranscribeDiarizeForConditionalGeneration(cfg).eval()
    ref.save_pretrained(tmp_path, max_shard_size="40KB")
    MossTranscribeDiarizeFeatureExtractor(feature_size=8, chunk_length=1).save_pretrained(tmp_path)
    return ref, tmp_path


def _check_against(ref: object, folder: Path) -> None:
    model = mf.models.load("moss-transcribe-diarize", weights=folder)
    assert (model.features.feature_size, model.features.n_samples) == (8, 16000)
    assert model.config.audio_merge_size == 2
    clips = [speech_like(s, seed=11 + i) for i, s in enumerate((0.41, 1.0, 2.53))]
    out = model.processor(audios=[(c, 16000) for c in clips])
    assert out["audio_chunk_counts"].tolist() == [1, 1, 3]
    fe = MossTranscribeDiarizeFeatureExtractor.from_pretrained(folder)
    feats = fe(clips, sampling_rate=16000, return_tensors="pt")
    assert out["audio_token_lengths"].tolist() == _hf_tokens(fe, feats, 3, 2)
    with torch.no_grad():
        expected = ref.model.get_audio_features(feats["input_features"], feats["input_features_mask"],
                                                feats["padding_mask"]).pooler_output
        torch.testing.assert_close(model.encode(**out), expected, atol=1e-4, rtol=0)


def test_save_pretrained_folder_loads_by_name_with_its_chunking(tmp_path: Path) -> None:
    ref, folder = _tiny_hf(tmp_path)
    assert (folder / "model.safetensors.index.json").is_file()
    _check_against(ref, folder)


def test_the_original_checkpoint_layout_loads(tmp_path: Path) -> None:
    """model.whisper_encoder.* and model.vq_adaptor.layers.{0,2,3}.*, as vLLM reads them."""
    ref, hf = _tiny_hf(tmp_path / "hf")
    state = {}
    for file in sorted(hf.glob("*.safetensors")):
        state.update(load_file(file))
    renames = {"model.audio_tower.": "model.whisper_encoder.",
               "model.multi_modal_projector.linear_1.": "model.vq_adaptor.layers.0.",
               "model.multi_modal_projector.linear_2.": "model.vq_adaptor.layers.2.",
               "model.multi_modal_projector.norm.": "model.vq_adaptor.layers.3."}
    original = {}
    for key, value in state.items():
        for old, new in renames.items():
            if key.startswith(old):
                key = new + key[len(old):]
        original[key] = value.contiguous()
    folder = tmp_path / "original"
    folder.mkdir()
    save_file(original, folder / "model.safetensors")
    (folder / "config.json").write_text((hf / "config.json").read_text())
    (folder / "preprocessor_config.json").write_text((hf / "preprocessor_config.json").read_text())
    assert not any(k.startswith("model.audio_tower.") for k in original)
    _check_against(ref, folder)


def _batch(model):
    outputs = model.dummy_inputs()
    batch = mf.batch_items(mf.split_items(outputs, model.field_specs(outputs)))[0]
    assert batch.data["audio_chunk_counts"].tolist() == [1, 2]  # the dummy chunks
    return batch


@pytest.mark.parametrize("field", ["audio_feature_lengths", "audio_chunk_counts", "audio_token_lengths"])
def test_each_length_field_on_the_device_is_caught_at_the_host_read(model, field: str) -> None:
    batch = _batch(model)
    wrong = {**batch.specs, field: dataclasses.replace(batch.specs[field], placement=mf.Placement.DEVICE)}
    report = mf.audit.audit(model.encode, batch.data, wrong)
    assert not report.ok
    assert {(f.kind, f.fields) for f in report.findings} == {("host_sync", (field,))}
    lines, first = inspect.getsourcelines(moss._ints)
    (offset,) = [i for i, line in enumerate(lines) if ".tolist()" in line]
    assert all(f.location.endswith(f"mmferry/models/moss_transcribe_diarize.py:{first + offset}")
               for f in report.findings), report.findings


def test_contract_audits_clean_and_nothing_is_uploaded(model) -> None:
    batch = _batch(model)
    report = mf.audit.audit(model.encode, batch.data, batch.specs)
    assert report.ok and report.findings == []
    assert {k for k, s in batch.specs.items() if s.placement != mf.Placement.HOST} == {"input_features"}


def test_processor_errors_name_the_file_or_item(model, tmp_path: Path) -> None:
    empty = tmp_path / "empty.ogg"
    empty.write_bytes(b"")
    with pytest.raises(MediaError) as e:
        model.processor(audios=[speech_like(0.5), empty])
    assert e.value.source == str(empty)
    with pytest.raises(MediaError) as e:
        model.processor(audios=[speech_like(0.5), b"\x00" * 64])
    assert e.value.source == "item 1"
    with pytest.raises(ArgumentError) as e:
        model.processor(audios=speech_like(0.5), chunk_length=10)
    assert e.value.argument == "chunk_length"


@pytest.mark.parametrize(("config", "key"), [
    ({"text_config": {}}, "audio_config"),
    ({"audio_config": {}, "audio_merge_size": 0}, "audio_merge_size"),
    ({"audio_config": {}, "audio_merge_size": 7}, "audio_merge_size"),
    ({"audio_config": {"hidden_size": -1}}, "audio_config.d_model"),
    ({"audio_config": {}, "text_config": {"rms_norm_eps": "x"}}, "text_config.rms_norm_eps"),
    ({"audio_config": {}, "projector_hidden_act": "tanh"}, "projector_hidden_act"),
])
def test_bad_config_names_the_key(config: dict, key: str) -> None:
    with pytest.raises(ArgumentError) as e:
        mf.models.load("moss-transcribe-diarize", config=config, materialize=False)
    assert e.value.argument == key


def test_the_published_config_builds_the_published_width() -> None:
    config = json.loads(json.dumps(transformers.MossTranscribeDiarizeConfig().to_dict()))
    model = mf.models.load("moss-transcribe-diarize", config=config, materialize=False)
    audio = model.config.audio
    assert (audio.d_model, audio.encoder_layers, audio.encoder_attention_heads) == (1024, 24, 16)
    assert model.hidden_size == 1024 and model.config.audio_merge_size == 4


def test_check_item_rejects_inconsistent_lengths(model) -> None:
    outputs = model.dummy_inputs()
    item = dict(mf.split_items(outputs, model.field_specs(outputs))["audio"][1])
    model.check_item(item)
    with pytest.raises(ContractError) as e:
        model.check_item({**item, "audio_token_lengths": item["audio_token_lengths"] + 1})
    assert e.value.field == "audio_token_lengths"
    with pytest.raises(ContractError) as e:
        model.check_item({**item, "audio_feature_lengths": torch.tensor([376, 1])})
    assert e.value.field == "audio_feature_lengths"
