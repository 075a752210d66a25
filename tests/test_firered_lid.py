"""FireRedLID (``firered-lid``): features against kaldi-native-fbank (the library vLLM's
processor calls), the encoder against a literal transcription of vLLM's ``ConformerEncoder``
(``benchmarks/parity_firered_lid.py`` checks our encoder against vLLM's own module on CPU),
token counts against vLLM's mask code, the published checkpoint names, placement flips.

Where an expectation comes from vLLM, the test names the file: ``conformer_encoder.py``
(vLLM 0.33.0, shared with FireRedASR2), ``fireredlid.py`` and
``transformers_utils/processors/fireredlid.py`` (last shipped in vLLM 0.28; 0.33 lists the
model as previously supported and keeps the same fbank + CMVN code for FireRedASR2).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import mmferry as mf
from mmferry.errors import ArgumentError, CheckpointError, ContractError, MediaError
from mmferry.media.samples import speech_like
from mmferry.models import firered_lid
from mmferry.models.firered_lid import encoder_lengths, kaldi_fbank

knf = pytest.importorskip("kaldi_native_fbank")

MODEL_FILE = Path(firered_lid.__file__)
# Kaldi's fbank and ours both run in float32. Within 60 dB (e^14 in power) of a frame's
# loudest mel bin they agree to this (log units); further below, a bin holds float32
# rounding noise of the FFT in both (the far bins of a pure tone), and the test only asks
# that both see it as that far down.
FBANK_ATOL = 2e-4
DYNAMIC_RANGE = 14.0


def assert_fbank_close(ours: np.ndarray, ref_raw: np.ndarray, ref: np.ndarray | None = None) -> None:
    """``ours`` against ``ref`` (default ``ref_raw``); the dynamic range is judged on the raw
    log-mel ``ref_raw``."""
    ref = ref_raw if ref is None else ref
    assert ours.shape == ref.shape and ours.dtype == np.float32
    near = ref_raw.max(1, keepdims=True) - ref_raw < DYNAMIC_RANGE
    diff = np.abs(ours - ref)
    assert diff[near].max(initial=0) <= FBANK_ATOL, diff[near].max()
    if ref is ref_raw:
        assert (ours.max(1, keepdims=True) - ours)[~near].min(initial=np.inf) > DYNAMIC_RANGE - 1


def kaldi_reference(wave: np.ndarray, bins: int = 80) -> np.ndarray:
    """vLLM's ``KaldifeatFbank``: kaldi-native-fbank with its options (dither 0, snip_edges)."""
    opts = knf.FbankOptions()
    opts.frame_opts.dither = 0.0
    opts.mel_opts.num_bins = bins
    opts.frame_opts.snip_edges = True
    opts.mel_opts.debug_mel = False
    fbank = knf.OnlineFbank(opts)
    fbank.accept_waveform(16000, wave.tolist())
    frames = [fbank.get_frame(i) for i in range(fbank.num_frames_ready)]
    return np.vstack(frames) if frames else np.zeros((0, bins))


def clips() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    t = np.arange(8000) / 16000
    sweep = (0.3 * np.sin(2 * np.pi * (200 + 3000 * t) * t)).astype(np.float32)
    return {
        "speech 0.8 s": speech_like(0.8, seed=1),
        "speech 2.1 s": speech_like(2.1, seed=5),
        "noise with a DC offset": (0.2 + 0.05 * rng.standard_normal(5000)).astype(np.float32),
        "one frame": sweep[:400],
        "frame + 159 samples": sweep[:559],
        "loud tone": (0.99 * np.sin(2 * np.pi * 440 * t)).astype(np.float32),
        "silence": np.zeros(3200, dtype=np.float32),
    }


@pytest.mark.parametrize("name", list(clips()))
def test_fbank_matches_kaldi_native_fbank(name: str) -> None:
    wave = clips()[name] * 32768
    assert_fbank_close(kaldi_fbank(torch.from_numpy(wave)).numpy(), kaldi_reference(wave))


def test_fbank_of_less_than_a_frame_is_empty() -> None:
    assert kaldi_fbank(torch.zeros(399)).shape == (0, 80)
    assert kaldi_reference(np.zeros(399, dtype=np.float32)).shape == (0, 80)


def _cmvn_stats(dim: int = 80) -> tuple[list[float], list[float]]:
    rng = np.random.default_rng(11)
    return rng.uniform(5, 15, dim).tolist(), rng.uniform(0.1, 0.5, dim).tolist()


def _vllm_fake_token_length(length: int, context: int = 7) -> int:
    """``FireRedLIDFeatureExtractor.__call__`` (processors/fireredlid.py): pad the features by
    ``context - 1`` frames, mask the real ones, subsample the mask twice with ``[:-2:2]``,
    count, clamp to at least 1."""
    mask = torch.ones(1, length + context - 1)
    mask[0, length:] = 0
    mask = mask.unsqueeze(1).to(torch.uint8)[:, :, :-2:2][:, :, :-2:2]
    return int(torch.clamp(mask[:, -1, :].sum(dim=-1), min=1))


def write_checkpoint(folder: Path, model: torch.nn.Module, *, drop: str | None = None,
                     preprocessor: dict | None = None) -> None:
    """A folder in the published layout: the encoder under ``encoder.``, the LID decoder
    under ``lid_decoder.`` (never read), the saved positional table vLLM skips."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    config = {"model_type": "fireredlid", "architectures": ["FireRedLIDForConditionalGeneration"],
              "idim": cfg.idim, "d_model": cfg.d_model, "n_head": cfg.n_head,
              "n_layers_enc": cfg.n_layers_enc, "kernel_size": cfg.kernel_size,
              "pe_maxlen": cfg.pe_maxlen, "n_layers_lid_dec": 1, "vocab_size": 120}
    (folder / "config.json").write_text(json.dumps(config))
    means, istd = _cmvn_stats(cfg.idim)
    pre = preprocessor if preprocessor is not None else {
        "feature_extractor_type": "FireRedLIDFeatureExtractor", "sampling_rate": 16000,
        "dim": cfg.idim, "num_mel_bins": cfg.idim, "means": means, "inverse_std_variences": istd}
    (folder / "preprocessor_config.json").write_text(json.dumps(pre))
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k != drop}
    tensors["encoder.positional_encoding.pe"] = torch.zeros(1, 2 * cfg.pe_maxlen - 1, cfg.d_model)
    tensors["lid_decoder.tgt_word_emb.weight"] = torch.zeros(120, cfg.d_model)
    save_file(tensors, str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return mf.models.load("firered-lid")


def test_processor_matches_vllm_feature_extractor(tmp_path: Path, model) -> None:
    write_checkpoint(tmp_path, model)
    loaded = mf.models.load("firered-lid", weights=tmp_path)
    waves = [clips()["speech 0.8 s"], clips()["speech 2.1 s"], clips()["frame + 159 samples"]]
    out = loaded.processor(audios=waves, sampling_rate=16000)
    means, istd = _cmvn_stats()
    assert set(out) == {"input_features", "speech_lengths", "fake_token_lengths"}
    assert isinstance(out["input_features"], list)  # the clips have different lengths
    for wave, feat in zip(waves, out["input_features"], strict=True):
        # CMVN as the reference's numpy class computes it (float64), then float32.
        raw = kaldi_reference(wave * 32768)
        ref = ((raw - np.array(means)) * np.array(istd)).astype(np.float32)
        assert_fbank_close(feat.numpy(), raw, ref)
    lengths = [len(kaldi_reference(w * 32768)) for w in waves]
    assert out["speech_lengths"].dtype == torch.int64
    assert out["speech_lengths"].tolist() == lengths
    assert out["fake_token_lengths"].tolist() == [_vllm_fake_token_length(n) for n in lengths]
    # Equal lengths stack into one [B, T, 80] tensor.
    same = loaded.processor(audios=[waves[0], waves[0] * 0.5])
    assert same["input_features"].shape == (2, lengths[0], 80)


def test_processor_reads_files_and_other_rates(tmp_path: Path, model) -> None:
    import soundfile

    wave = speech_like(0.6, seed=9)
    path = tmp_path / "a.wav"
    soundfile.write(path, wave, 16000, subtype="FLOAT")
    from_array = model.processor(audios=wave)
    for source in (path, str(path), path.read_bytes()):
        out = model.processor(audios=[source])
        torch.testing.assert_close(out["input_features"], from_array["input_features"])
    # A stereo pair at 8 kHz is downmixed and resampled to 16 kHz first.
    stereo = np.stack([wave[::2], wave[::2]], axis=1)
    out = model.processor(audios=[(stereo, 8000)])
    assert abs(int(out["speech_lengths"][0]) - int(from_array["speech_lengths"][0])) <= 1


def test_processor_rejects_bad_input(model) -> None:
    with pytest.raises(MediaError) as e:
        model.processor(audios=[speech_like(0.5), np.zeros(399, dtype=np.float32)])
    assert e.value.source == "item 1"
    with pytest.raises(MediaError) as e:
        model.processor(audios=[speech_like(0.5), b"not audio at all"])
    assert e.value.source == "item 1"
    with pytest.raises(ArgumentError) as e:
        model.processor(audios=[speech_like(0.5)], padding="longest")
    assert e.value.argument == "padding"
    with pytest.raises(ArgumentError):
        model.processor(audios=[speech_like(0.5)], sampling_rate=8000)
    with pytest.raises(ArgumentError):
        model.processor(images=[np.zeros((8, 8, 3), dtype=np.uint8)])


def test_token_counts_follow_vllm_subsampling_mask() -> None:
    for length in range(1, 400):
        assert encoder_lengths(length) == _vllm_fake_token_length(length) == math.ceil(length / 4)
    # conformer_encoder.py: the batch mask (padded to the longest + 6, subsampled twice) must
    # be as long as the two k3 s2 convolutions' output, for every batch length.
    for longest in range(1, 400):
        padded = longest + 6
        conv = ((padded - 3) // 2 + 1 - 3) // 2 + 1
        mask = torch.ones(padded)[:-2:2][:-2:2]
        assert len(mask) == conv == encoder_lengths(longest)


def test_token_counts_match_encoder_rows(model) -> None:
    out = model.dummy_inputs()
    items = mf.split_items(out, model.field_specs(out)).in_order()
    counts = [model.tokens_per_item(i) for i in items]
    assert counts == [math.ceil(n / 4) for n in out["speech_lengths"].tolist()]
    assert counts == out["fake_token_lengths"].tolist()
    rows = model.encode(**mf.batch_items(items)[0].data)
    assert rows.shape == (sum(counts), model.hidden_size)


# -- the encoder against vLLM's code -------------------------------------------------------


def reference_encode(sd: dict[str, torch.Tensor], cfg, feats: list[torch.Tensor]) -> torch.Tensor:
    """vLLM's ``embed_multimodal`` + ``ConformerEncoder.forward`` (conformer_encoder.py), step
    by step as written there: zero-padded batch, int32 lengths, uint8 masks, rel-shift by
    padding, masked softmax, channels-first convolutions; per-item rows by encoder length."""
    lengths = torch.tensor([len(f) for f in feats], dtype=torch.int32)
    x = torch.zeros(len(feats), int(lengths.max()), feats[0].shape[1])
    for i, f in enumerate(feats):
        x[i, : len(f)] = f
    x = F.pad(x, (0, 0, 0, 6))
    mask = (torch.arange(x.shape[1])[None] < lengths[:, None]).to(torch.uint8).unsqueeze(1)
    p = "encoder.input_preprocessor."
    x = F.relu(F.conv2d(x.unsqueeze(1), sd[p + "conv.0.weight"], sd[p + "conv.0.bias"], 2))
    x = F.relu(F.conv2d(x, sd[p + "conv.2.weight"], sd[p + "conv.2.bias"], 2))
    n, c, t, d = x.shape
    x = F.linear(x.transpose(1, 2).contiguous().view(n, t, c * d), sd[p + "out.weight"], sd[p + "out.bias"])
    mask = mask[:, :, :-2:2][:, :, :-2:2]
    enc_lengths = mask[:, -1, :].sum(dim=-1)
    # RelPositionalEncoding over pe_maxlen, sliced around its centre.
    pos = torch.arange(0, cfg.pe_maxlen).unsqueeze(1).float()
    div = torch.exp(torch.arange(0, cfg.d_model, 2).float()
                    * -(torch.log(torch.tensor(10000.0)).item() / cfg.d_model))
    pe_pos, pe_neg = torch.zeros(cfg.pe_maxlen, cfg.d_model), torch.zeros(cfg.pe_maxlen, cfg.d_model)
    pe_pos[:, 0::2], pe_pos[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
    pe_neg[:, 0::2], pe_neg[:, 1::2] = torch.sin(-1 * pos * div), torch.cos(-1 * pos * div)
    pe = torch.cat([torch.flip(pe_pos, [0]).unsqueeze(0), pe_neg[1:].unsqueeze(0)], dim=1)
    pos_emb = pe[:, pe.size(1) // 2 - t + 1 : pe.size(1) // 2 + t]

    def ln(v, name):
        return F.layer_norm(v, v.shape[-1:], sd[name + ".weight"], sd[name + ".bias"])

    def ffn(v, q):
        h = F.linear(ln(v, q + "net.0"), sd[q + "net.1.weight"], sd[q + "net.1.bias"])
        return F.linear(h * torch.sigmoid(h), sd[q + "net.4.weight"], sd[q + "net.4.bias"]) + v

    h, dk = cfg.n_head, cfg.d_model // cfg.n_head
    for i in range(cfg.n_layers_enc):
        q_ = f"encoder.layer_stack.{i}."
        out = 0.5 * x + 0.5 * ffn(x, q_ + "ffn1.")
        m = q_ + "mhsa."
        q = F.linear(ln(out, m + "layer_norm_q"), sd[m + "w_qs.weight"]).view(n, t, h, dk)
        k = F.linear(ln(out, m + "layer_norm_k"), sd[m + "w_ks.weight"]).view(n, t, h, dk).transpose(1, 2)
        v = F.linear(ln(out, m + "layer_norm_v"), sd[m + "w_vs.weight"]).view(n, t, h, dk).transpose(1, 2)
        pp = F.linear(pos_emb, sd[m + "linear_pos.weight"]).view(1, -1, h, dk).transpose(1, 2)
        ac = torch.matmul((q + sd[m + "pos_bias_u"]).transpose(1, 2), k.transpose(-2, -1))
        bd = torch.matmul((q + sd[m + "pos_bias_v"]).transpose(1, 2), pp.transpose(-2, -1))
        b_, h_, t1, t2 = bd.shape
        bd = torch.cat([torch.zeros(b_, h_, t1, 1), bd], dim=-1).view(b_, h_, t2 + 1, t1)
        bd = bd[:, :, 1:].view(b_, h_, t1, t2)[:, :, :, : t2 // 2 + 1]
        scores = (ac + bd) * (1.0 / dk**0.5)
        pad = mask.unsqueeze(1).eq(0)
        attn = torch.softmax(scores.masked_fill(pad, -float("inf")), dim=-1).masked_fill(pad, 0.0)
        o = torch.matmul(attn, v).transpose(1, 2).contiguous().view(n, t, -1)
        out = F.linear(o, sd[m + "fc.weight"]) + out
        cv = q_ + "conv."
        y = ln(out, cv + "pre_layer_norm").transpose(1, 2).masked_fill(mask.ne(1), 0.0)
        y = F.glu(F.conv1d(y, sd[cv + "pointwise_conv1.weight"]), dim=1)
        y = F.conv1d(y, sd[cv + "depthwise_conv.weight"], padding=(cfg.kernel_size - 1) // 2,
                     groups=y.shape[1])
        y = ln(y.transpose(1, 2), cv + "batch_norm")
        y = (y * torch.sigmoid(y)).transpose(1, 2)
        y = F.conv1d(y, sd[cv + "pointwise_conv2.weight"]).masked_fill(mask.ne(1), 0.0)
        out = y.transpose(1, 2) + out
        out = 0.5 * out + 0.5 * ffn(out, q_ + "ffn2.")
        x = ln(out, q_ + "layer_norm")
    return torch.cat([x[i, : int(enc_lengths[i])] for i in range(n)])


@pytest.mark.parametrize("lengths", [(37, 4, 81, 1), (40, 40), (9,)])
def test_encoder_matches_vllm_conformer(model, lengths: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(sum(lengths))
    feats = [torch.randn(n, 80, generator=gen) for n in lengths]
    same = len(set(lengths)) == 1
    ours = model.encode(input_features=torch.stack(feats) if same else feats,
                        speech_lengths=torch.tensor(lengths))
    sd = {k: v.float() for k, v in model.state_dict().items()}
    ref = reference_encode(sd, model.config, feats)
    assert ours.shape == ref.shape == (sum(encoder_lengths(n) for n in lengths), model.hidden_size)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


# -- checkpoints -----------------------------------------------------------------------------

# vLLM 0.33.0's ConformerEncoder(idim=80, n_layers_enc=1, ...).state_dict() keys, printed from
# the module; fireredlid.py's hf_to_vllm_mapper maps the published names onto them
# ("encoder." -> "model.encoder.", "net.0/1/4" -> pre_layer_norm / linear_expand /
# linear_project).
_SUB = ("conv.0.weight", "conv.0.bias", "conv.2.weight", "conv.2.bias", "out.weight", "out.bias")
_FFN = ("pre_layer_norm.weight", "pre_layer_norm.bias", "linear_expand.weight", "linear_expand.bias",
        "linear_project.weight", "linear_project.bias")
_MHSA = ("pos_bias_u", "pos_bias_v", "w_qs.weight", "w_ks.weight", "w_vs.weight",
         "layer_norm_q.weight", "layer_norm_q.bias", "layer_norm_k.weight", "layer_norm_k.bias",
         "layer_norm_v.weight", "layer_norm_v.bias", "fc.weight", "linear_pos.weight")
_CONV = ("pre_layer_norm.weight", "pre_layer_norm.bias", "pointwise_conv1.weight",
         "depthwise_conv.weight", "batch_norm.weight", "batch_norm.bias", "pointwise_conv2.weight")
VLLM_ENCODER_KEYS = (
    [f"input_preprocessor.{k}" for k in _SUB]
    + [f"layer_stack.0.{m}.{k}" for m in ("ffn1", "ffn2") for k in _FFN]
    + [f"layer_stack.0.mhsa.{k}" for k in _MHSA]
    + [f"layer_stack.0.conv.{k}" for k in _CONV]
    + ["layer_stack.0.layer_norm.weight", "layer_stack.0.layer_norm.bias"])


def test_parameter_names_are_the_published_ones(model) -> None:
    mapper = {"net.0": "pre_layer_norm", "net.1": "linear_expand", "net.4": "linear_project"}
    layer0 = set()
    for name in model.state_dict():
        assert name.startswith("encoder.")
        if re.match(r"encoder\.layer_stack\.[1-9]", name):
            continue
        vllm_name = name.replace("encoder.", "model.encoder.", 1).removeprefix("model.encoder.")
        for old, new in mapper.items():
            vllm_name = vllm_name.replace(old, new)
        layer0.add(vllm_name)
    assert layer0 == set(VLLM_ENCODER_KEYS)


def test_checkpoint_folder_loads_by_name(tmp_path: Path, model) -> None:
    write_checkpoint(tmp_path, model)
    loaded = mf.models.load("firered-lid", weights=tmp_path)
    state, expected = loaded.state_dict(), model.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k]) for k in state)
    assert loaded.features.means is not None and len(loaded.features.means) == 80
    feats = [torch.randn(12, 80), torch.randn(7, 80)]
    torch.testing.assert_close(loaded.encode(input_features=feats, speech_lengths=torch.tensor([12, 7])),
                               model.encode(input_features=feats, speech_lengths=torch.tensor([12, 7])))


def test_missing_weight_is_a_checkpoint_error(tmp_path: Path, model) -> None:
    key = "encoder.layer_stack.1.mhsa.pos_bias_u"
    write_checkpoint(tmp_path, model, drop=key)
    with pytest.raises(CheckpointError) as e:
        mf.models.load("firered-lid", weights=tmp_path)
    assert e.value.parameter == key


def test_cmvn_statistics_are_required_from_the_checkpoint(tmp_path: Path, model) -> None:
    write_checkpoint(tmp_path, model, preprocessor={"sampling_rate": 16000, "means": [0.0] * 80})
    with pytest.raises(CheckpointError) as e:
        mf.models.load("firered-lid", weights=tmp_path)
    assert e.value.parameter == "inverse_std_variences"
    with pytest.raises(ArgumentError) as e:
        mf.models.load("firered-lid", config={"model_type": "fireredlid", "d_model": 30, "n_head": 4})
    assert e.value.argument == "n_head"


def test_check_item_blames_the_features(model) -> None:
    item = {"input_features": torch.zeros(10, 80), "speech_lengths": torch.tensor(12)}
    with pytest.raises(ContractError) as e:
        model.check_item(item)
    assert e.value.field == "input_features"
    with pytest.raises(ContractError) as e:
        model.check_item({**item, "speech_lengths": torch.tensor(0)})
    assert e.value.field == "speech_lengths"
    model.check_item({**item, "speech_lengths": torch.tensor(10)})


# -- placement -------------------------------------------------------------------------------


def line_of(text: str) -> str:
    lines = MODEL_FILE.read_text().splitlines()
    (number,) = [i + 1 for i, line in enumerate(lines) if text in line]
    return f"{MODEL_FILE.name}:{number}"


def lid_batch(model):
    out = model.dummy_inputs()
    (batch,) = mf.batch_items(mf.split_items(out, model.field_specs(out)))
    assert batch.specs["speech_lengths"].placement == mf.Placement.BOTH
    assert batch.specs["fake_token_lengths"].placement == mf.Placement.HOST
    return batch


def test_speech_lengths_on_the_host_meet_the_device_mask(model) -> None:
    batch = lid_batch(model)
    wrong = {**batch.specs, "speech_lengths": mf.FieldSpec.batched("audio", placement="host")}
    report = mf.audit.audit(model.encode, batch.data, wrong)
    assert not report.ok
    assert {(f.kind, f.fields) for f in report.findings} == {("device_mismatch", ("speech_lengths",))}
    assert all(f.location.endswith(line_of("mask = frames[None, :] < lengths[:, None]"))
               for f in report.findings)


def test_speech_lengths_on_the_device_sync_where_read_on_the_host(model) -> None:
    batch = lid_batch(model)
    wrong = {**batch.specs, "speech_lengths": mf.FieldSpec.batched("audio", placement="device")}
    report = mf.audit.audit(model.encode, batch.data, wrong)
    assert not report.ok
    assert {(f.kind, f.fields) for f in report.findings} == {("host_sync", ("speech_lengths",))}
    assert all(f.location.endswith(line_of("host_lengths.reshape(-1).tolist()"))
               for f in report.findings)


def test_features_on_the_host_are_named_where_they_meet_the_weights(model) -> None:
    batch = lid_batch(model)
    wrong = {**batch.specs, "input_features": mf.FieldSpec.batched("audio", placement="host")}
    report = mf.audit.audit(model.encode, batch.data, wrong)
    # The padding keeps the features' provenance up to the first convolution.
    assert ("device_mismatch", ("input_features",)) in {(f.kind, f.fields) for f in report.findings}
