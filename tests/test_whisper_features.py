"""Whisper log-mel features equal transformers' WhisperFeatureExtractor (values, padding,
truncation, attention mask), for its defaults and for configs read from a checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmferry.errors import ArgumentError
from mmferry.media.samples import speech_like
from mmferry.models.whisper import FeatureConfig, log_mel, mel_filters

transformers = pytest.importorskip("transformers")


def _reference(clips: list[np.ndarray], cfg: FeatureConfig) -> dict[str, torch.Tensor]:
    fe = transformers.WhisperFeatureExtractor(
        feature_size=cfg.feature_size, sampling_rate=cfg.sampling_rate, hop_length=cfg.hop_length,
        chunk_length=cfg.chunk_length, n_fft=cfg.n_fft, padding_value=cfg.padding_value)
    return fe(clips, sampling_rate=cfg.sampling_rate, return_attention_mask=True,
              padding="max_length", truncation=True, return_tensors="pt")


@pytest.fixture(scope="module")
def clips() -> list[np.ndarray]:
    # Shorter than a frame, hop multiples and not, a full chunk, and longer (truncated).
    seconds = (0.005, 0.3, 1.0, 7.31, 30.0, 33.0)
    out = [speech_like(s, seed=i) for i, s in enumerate(seconds)]
    out.append(np.zeros(16000, np.float32))  # silence: every bin at the floor
    return out


@pytest.mark.parametrize("mels", [80, 128])
def test_log_mel_equals_the_feature_extractor(mels: int, clips: list[np.ndarray]) -> None:
    cfg = FeatureConfig(feature_size=mels)
    features, mask = log_mel(clips, cfg)
    ref = _reference(clips, cfg)
    assert features.dtype == torch.float32 and features.shape == ref["input_features"].shape
    torch.testing.assert_close(features, ref["input_features"], atol=1e-4, rtol=0)
    assert mask.dtype == ref["attention_mask"].dtype
    assert torch.equal(mask, ref["attention_mask"])
    assert mask.sum(-1).tolist() == [min(3000, -(-len(c) // 160)) for c in clips]


def test_filters_equal_transformers() -> None:
    from transformers.audio_utils import mel_filter_bank

    for mels, rate in ((80, 16000), (128, 16000), (64, 24000)):
        ref = mel_filter_bank(num_frequency_bins=201, num_mel_filters=mels, min_frequency=0.0,
                              max_frequency=8000.0, sampling_rate=rate, norm="slaney",
                              mel_scale="slaney")
        np.testing.assert_allclose(mel_filters(mels, 400, rate), ref, rtol=1e-12, atol=1e-15)


def test_a_checkpoint_config_sets_the_features() -> None:
    raw = {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 64, "chunk_length": 2,
           "hop_length": 200, "n_fft": 512, "sampling_rate": 16000, "padding_value": 0.5,
           "n_samples": 999, "nb_max_frames": 1, "return_attention_mask": True}
    cfg = FeatureConfig.from_dict(raw)
    assert (cfg.feature_size, cfg.n_samples, cfg.nb_max_frames) == (64, 32000, 160)
    clips = [speech_like(s, seed=3) for s in (0.7, 2.5)]
    features, mask = log_mel(clips, cfg)
    ref = _reference(clips, cfg)
    torch.testing.assert_close(features, ref["input_features"], atol=1e-4, rtol=0)
    assert torch.equal(mask, ref["attention_mask"])


@pytest.mark.parametrize(("key", "value"), [("feature_size", 0), ("hop_length", "160"),
                                            ("chunk_length", 2.5), ("dither", 1e-4),
                                            ("sampling_rate", True)])
def test_bad_feature_config_names_the_key(key: str, value: object) -> None:
    with pytest.raises(ArgumentError) as e:
        FeatureConfig.from_dict({key: value})
    assert e.value.argument == key


def test_speech_like_is_deterministic_voiced_and_has_pauses() -> None:
    a, b = speech_like(3.0, seed=1), speech_like(3.0, seed=1)
    assert a.dtype == np.float32 and len(a) == 48000 and np.array_equal(a, b)
    assert not np.array_equal(a, speech_like(3.0, seed=2))
    frames = np.abs(a[: len(a) // 160 * 160]).reshape(-1, 160).max(axis=1)
    assert (frames < 0.02).mean() > 0.1 and (frames > 0.2).mean() > 0.2  # pauses and syllables
    spectrum = np.abs(np.fft.rfft(a))
    freqs = np.fft.rfftfreq(len(a), 1 / 16000)
    # Voiced: most energy below 4 kHz, not flat like noise.
    assert spectrum[freqs < 4000].sum() > 5 * spectrum[freqs >= 4000].sum()


def test_frames_that_stop_short_of_the_chunk_and_tiny_clips() -> None:
    """A hop longer than half a window: the last frame ends before the chunk does, and a
    one-sample clip still reflects at the left edge."""
    cfg = FeatureConfig(feature_size=40, hop_length=512, chunk_length=1)
    clips = [np.random.default_rng(n).standard_normal(n).astype(np.float32) for n in (1, 100, 16000, 20000)]
    features, mask = log_mel(clips, cfg)
    ref = _reference(clips, cfg)
    torch.testing.assert_close(features, ref["input_features"], atol=1e-4, rtol=0)
    assert torch.equal(mask, ref["attention_mask"])


def test_a_folder_s_processor_files_set_the_features(tmp_path) -> None:
    import json

    from mmferry.models.whisper import features_from_folder

    base = FeatureConfig(feature_size=128)
    assert features_from_folder(None, base) is base
    assert features_from_folder(tmp_path, base) is base
    (tmp_path / "processor_config.json").write_text(json.dumps(
        {"processor_class": "X", "feature_extractor": {"feature_size": 64, "chunk_length": 10}}))
    assert features_from_folder(tmp_path, base) == FeatureConfig(feature_size=64, chunk_length=10)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"feature_size": 80}))
    assert features_from_folder(tmp_path, base) == FeatureConfig(feature_size=80)
