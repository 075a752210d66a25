"""Qwen2-Audio: features, token counts and embeddings equal transformers' on the same tiny
random weights; a save_pretrained folder loads by name with its features; host length
fields are read on the host only (placement flips are caught at the reading line)."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import numpy as np
import pytest
import torch

import mmferry as mf
from mmferry.errors import ArgumentError, ContractError, MediaError
from mmferry.media.samples import speech_like
from mmferry.models import qwen2_audio

transformers = pytest.importorskip("transformers")

SECONDS = (0.05, 1.3, 2.9, 12.34, 31.0)  # one frame pair, odd/even positions, truncated


@pytest.fixture(scope="module")
def model() -> qwen2_audio.Qwen2Audio:
    return mf.models.load("qwen2-audio")


@pytest.fixture(scope="module")
def clips() -> list[np.ndarray]:
    return [speech_like(s, seed=i) for i, s in enumerate(SECONDS)]


def _hf_config(audio: mf.models.whisper.EncoderConfig, text_hidden: int) -> object:
    return transformers.Qwen2AudioConfig(
        audio_config=dict(num_mel_bins=audio.num_mel_bins, encoder_layers=audio.encoder_layers,
                          encoder_attention_heads=audio.encoder_attention_heads,
                          encoder_ffn_dim=audio.encoder_ffn_dim, d_model=audio.d_model,
                          max_source_positions=audio.max_source_positions),
        text_config=dict(model_type="qwen2", hidden_size=text_hidden, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         vocab_size=64))


def _reference(model: qwen2_audio.Qwen2Audio) -> object:
    ref = transformers.Qwen2AudioForConditionalGeneration(
        _hf_config(model.config.audio, model.hidden_size)).eval()
    missing = ref.model.load_state_dict(model.state_dict(), strict=False)
    assert not missing.unexpected_keys
    assert all(k.startswith("language_model.") for k in missing.missing_keys)
    return ref


def _reference_embeddings(ref: object, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """What Qwen2AudioModel.forward merges into the text: its own lines, minus the text."""
    from transformers.masking_utils import create_bidirectional_mask

    tower = ref.model.audio_tower
    feat_lengths, out_lengths = tower._get_feat_extract_output_lengths(mask.sum(-1))
    b, _, frames = features.shape
    positions = (frames - 2) // 2 + 1
    valid = (torch.arange(positions)[None, :] < feat_lengths[:, None]).long()
    attention = create_bidirectional_mask(config=tower.config,
                                          inputs_embeds=torch.zeros(b, positions, 1),
                                          attention_mask=valid)
    with torch.no_grad():
        hidden = tower(features, attention_mask=attention).last_hidden_state
        embeds = ref.model.multi_modal_projector(hidden)
    keep = torch.arange(embeds.shape[1])[None, :] < out_lengths[:, None]
    return embeds[keep]


def test_features_and_token_counts_equal_transformers(model, clips) -> None:
    out = model.processor(audios=[(c, 16000) for c in clips])
    fe = transformers.WhisperFeatureExtractor(feature_size=128)
    # What Qwen2AudioProcessor asks of its feature extractor (vLLM adds truncation=True).
    ref = fe(clips, sampling_rate=16000, return_attention_mask=True, padding="max_length",
             truncation=True, return_tensors="pt")
    torch.testing.assert_close(out["input_features"], ref["input_features"], atol=1e-4, rtol=0)
    assert torch.equal(out["feature_attention_mask"], ref["attention_mask"])
    assert out["audio_feature_lengths"].tolist() == ref["attention_mask"].sum(-1).tolist()
    items = mf.split_items(out, model.field_specs(out)).in_order()
    lengths = ref["attention_mask"].sum(-1)
    hf_tokens = [(((n - 1) // 2 + 1) - 2) // 2 + 1 for n in lengths.tolist()]  # Qwen2AudioProcessor
    assert [model.tokens_per_item(i) for i in items] == hf_tokens == [1, 32, 72, 308, 750]


def test_embeddings_equal_transformers_batched_and_alone(model, clips) -> None:
    ref = _reference(model)
    out = model.processor(audios=[(c, 16000) for c in clips])
    expected = _reference_embeddings(ref, out["input_features"], out["feature_attention_mask"])
    with torch.no_grad():
        got = model.encode(**out)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    # Alone, a short clip runs far fewer positions than the reference's 1500: same rows.
    start = 0
    for i, n in enumerate(model.tokens_per_item(it) for it in
                          mf.split_items(out, model.field_specs(out)).in_order()):
        one = {k: v[i:i + 1] for k, v in out.items()}
        with torch.no_grad():
            torch.testing.assert_close(model.encode(**one), expected[start:start + n], atol=1e-4, rtol=0)
        start += n


def test_save_pretrained_folder_loads_by_name_with_its_features(tmp_path: Path) -> None:
    """A sharded transformers checkpoint with 8 mel bins and 1 s chunks (100 frames)."""
    cfg = _hf_config(mf.models.whisper.EncoderConfig(num_mel_bins=8, d_model=16, encoder_layers=1,
                                                     encoder_attention_heads=2, encoder_ffn_dim=32,
                                                     max_source_positions=50), 24)
    torch.manual_seed(0)
    ref = transformers.Qwen2AudioForConditionalGeneration(cfg).eval()
    ref.save_pretrained(tmp_path, max_shard_size="40KB")
    transformers.WhisperFeatureExtractor(feature_size=8, chunk_length=1).save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model = mf.models.load("qwen2-audio", weights=tmp_path)
    assert (model.features.feature_size, model.features.nb_max_frames) == (8, 100)
    assert model.hidden_size == 24
    clips = [speech_like(s, seed=7 + i) for i, s in enumerate((0.37, 1.0, 2.5))]
    out = model.processor(audios=[(c, 16000) for c in clips])
    fe = transformers.WhisperFeatureExtractor.from_pretrained(tmp_path)
    feats = fe(clips, sampling_rate=16000, return_attention_mask=True, padding="max_length",
               truncation=True, return_tensors="pt")
    torch.testing.assert_close(out["input_features"], feats["input_features"], atol=1e-4, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(model.encode(**out), _reference_embeddings(
            ref, feats["input_features"], feats["attention_mask"]), atol=1e-4, rtol=0)


def _batch(model):
    outputs = model.dummy_inputs()
    return mf.batch_items(mf.split_items(outputs, model.field_specs(outputs)))[0]


def _flip(batch, name: str, placement: str):
    return {**batch.specs, name: dataclasses.replace(batch.specs[name], placement=mf.Placement(placement))}


def test_lengths_on_the_device_are_caught_at_the_host_read(model) -> None:
    batch = _batch(model)
    report = mf.audit.audit(model.encode, batch.data, _flip(batch, "audio_feature_lengths", "device"))
    assert not report.ok
    assert {(f.kind, f.fields) for f in report.findings} == {("host_sync", ("audio_feature_lengths",))}
    lines, first = inspect.getsourcelines(qwen2_audio._lengths)
    (offset,) = [i for i, line in enumerate(lines) if ".tolist()" in line]
    assert all(f.location.endswith(f"mmferry/models/qwen2_audio.py:{first + offset}")
               for f in report.findings), report.findings
    assert mf.audit.recommend(model.encode, batch.data, _flip(batch, "audio_feature_lengths", "device"))[
        "audio_feature_lengths"] == mf.Placement.HOST


def test_the_encoder_never_reads_the_frame_mask(model) -> None:
    """Why feature_attention_mask is placed on the host: on the device it is never touched."""
    batch = _batch(model)
    report = mf.audit.audit(model.encode, batch.data, _flip(batch, "feature_attention_mask", "device"))
    assert report.ok and report.findings == []
    data = {k: v for k, v in batch.data.items() if k != "feature_attention_mask"}
    torch.testing.assert_close(model.encode(**data), model.encode(**batch.data), atol=0, rtol=0)


def test_processor_errors_name_the_file_or_item(model, tmp_path: Path) -> None:
    bad = tmp_path / "notes.wav"
    bad.write_text("not audio")
    with pytest.raises(MediaError) as e:
        model.processor(audios=[(speech_like(1.0), 16000), bad])
    assert e.value.source == str(bad)
    with pytest.raises(MediaError, match="needs at least 321") as e:
        model.processor(audios=[speech_like(1.0), np.zeros(300, np.float32)])
    assert e.value.source == "item 1"
    with pytest.raises(ArgumentError) as e:
        model.processor(audios=speech_like(1.0), sampling_rate=16000)
    assert e.value.argument == "sampling_rate"
    with pytest.raises(ArgumentError) as e:
        model.processor(images=[np.zeros((4, 4, 3), np.uint8)])
    assert e.value.argument == "images"
    assert model.processor(audios=None) == {}


def test_a_path_and_bytes_give_the_array_s_features(model, tmp_path: Path) -> None:
    sf = pytest.importorskip("soundfile")
    clip = speech_like(1.7, seed=3)
    path = tmp_path / "clip.wav"
    sf.write(path, clip, 16000, subtype="FLOAT")  # lossless float: the same samples back
    by_path = model.processor(audios=[path, path.read_bytes()])
    by_array = model.processor(audios=[clip, clip])
    assert all(torch.equal(by_path[k], by_array[k]) for k in by_array)


@pytest.mark.parametrize(("config", "key"), [
    ({"model_type": "qwen2_audio"}, "audio_config"),
    ({"audio_config": {"d_model": 0}}, "audio_config.d_model"),
    ({"audio_config": {"d_model": 30, "encoder_attention_heads": 4}}, "audio_config.encoder_attention_heads"),
    ({"audio_config": {}, "text_config": {"hidden_size": "big"}}, "text_config.hidden_size"),
    ({"audio_config": {"num_mel_bins": 80}}, "feature_size"),
    ({"model_type": "whisper", "audio_config": {}}, "config"),
])
def test_bad_config_names_the_key(config: dict, key: str) -> None:
    with pytest.raises(ArgumentError) as e:
        mf.models.load("qwen2-audio", config=config, materialize=False)
    assert e.value.argument == key


def test_check_item_rejects_a_mask_that_disagrees_with_the_length(model) -> None:
    outputs = model.dummy_inputs()
    item = dict(mf.split_items(outputs, model.field_specs(outputs))["audio"][0])
    model.check_item(item)
    item["feature_attention_mask"] = torch.ones_like(item["feature_attention_mask"])
    with pytest.raises(ContractError) as e:
        model.check_item(item)
    assert e.value.field == "feature_attention_mask"
    with pytest.raises(ContractError) as e:
        model.check_item({**item, "audio_feature_lengths": torch.tensor(2)})
    assert e.value.field == "audio_feature_lengths"
