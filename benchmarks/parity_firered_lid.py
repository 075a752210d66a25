"""FireRedLID parity against vLLM: our encoder vs vLLM's ``ConformerEncoder`` on the CPU, on
the same weights, and our fbank + CMVN vs the feature code vLLM calls.

FireRedLID is not in transformers, and vLLM 0.33 lists it as previously supported (its model
file last shipped in 0.28); the encoder it used, ``conformer_encoder.py``, is still in 0.33
(FireRedASR2's), as are the fbank (kaldi-native-fbank) and CMVN helpers its processor used
(``transformers_utils/processors/fireredasr2.py``: ``KaldifeatFbank``, ``CMVN``). Run from an
interpreter that has vLLM and mmferry::

    PYTHONPATH=src /path/to/vllm-venv/bin/python benchmarks/parity_firered_lid.py

Prints max |diff| per case and exits 1 if one exceeds its tolerance. The feature check needs
``kaldi-native-fbank`` importable too; without it that part says so and is skipped.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from encoder_refs.firered_lid import real_config, vllm_embed, vllm_encoder

import mmferry as mf
from mmferry.media.samples import speech_like
from mmferry.models.firered_lid import encoder_lengths

ENCODER_ATOL = 1e-4
FBANK_ATOL = 2e-4  # within 60 dB of each frame's loudest bin; see tests/test_firered_lid.py


def encoder_cases(quick: bool) -> list[tuple[str, dict | None, list[float]]]:
    cases = [("tiny (d_model 32, 2 blocks)", None, [0.5, 1.3, 0.03, 2.0]),
             ("tiny, equal lengths", None, [1.0, 1.0])]
    if not quick:
        cases.append(("published width (d_model 1280, 20 heads, k 33), 2 blocks",
                      real_config(2), [3.0, 5.0, 8.0]))
    return cases


def check_encoders(quick: bool) -> bool:
    ok = True
    for label, config, seconds in encoder_cases(quick):
        model = mf.models.load("firered-lid", config="tiny" if config is None else config)
        ref = vllm_encoder(model)
        outputs = model.processor(audios=[speech_like(s, seed=i) for i, s in enumerate(seconds)])
        (batch,) = mf.batch_items(mf.split_items(outputs, model.field_specs(outputs)))
        data = mf.Transfer("cpu").to_device(batch)
        feats = list(outputs["input_features"])
        with torch.inference_mode():
            ours = model.encode(**data)
            theirs = vllm_embed(ref, feats)
        lengths = outputs["speech_lengths"].tolist()
        counts_ok = ours.shape == theirs.shape and ours.shape[0] == sum(map(encoder_lengths, lengths))
        fake_ok = outputs["fake_token_lengths"].tolist() == [encoder_lengths(n) for n in lengths]
        diff = (ours - theirs).abs().max().item() if counts_ok else float("inf")
        good = counts_ok and fake_ok and diff <= ENCODER_ATOL
        ok &= good
        print(f"encoder  {label}: frames {lengths} -> rows {list(ours.shape)} vs vLLM "
              f"{list(theirs.shape)}; max |diff| {diff:.2e} (atol {ENCODER_ATOL:g}) "
              f"{'ok' if good else 'FAIL'}")
    return ok


def check_features() -> bool:
    try:
        from vllm.transformers_utils.processors.fireredasr2 import CMVN, KaldifeatFbank

        KaldifeatFbank()  # imports kaldi_native_fbank lazily
    except Exception as e:
        print(f"features: skipped, vLLM's fbank is not usable here ({type(e).__name__}: {e})")
        return True
    rng = np.random.default_rng(0)
    means, istd = rng.uniform(5, 15, 80).tolist(), rng.uniform(0.1, 0.5, 80).tolist()
    model = mf.models.load("firered-lid")
    # A checkpoint-like processor: CMVN statistics as in preprocessor_config.json.
    from mmferry.models.firered_lid import FeatureConfig

    model.features = FeatureConfig.from_dict(
        {"means": means, "inverse_std_variences": istd}, "preprocessor_config.json")
    fbank, cmvn = KaldifeatFbank(num_mel_bins=80, dither=0.0), CMVN(80, means, istd)
    ok = True
    for seconds in (0.8, 2.1, 30.0):
        wave = speech_like(seconds, seed=int(seconds * 10))
        raw = fbank(16000, wave * 32768)
        ref = torch.from_numpy(cmvn(raw)).float().numpy()
        ours = model.processor(audios=[wave])["input_features"][0].numpy()
        near = raw.max(1, keepdims=True) - raw < 14.0
        diff = np.abs(ours - ref)
        good = ours.shape == ref.shape and diff[near].max() <= FBANK_ATOL
        ok &= good
        print(f"features {seconds:>4} s: {list(ours.shape)} max |diff| {diff[near].max():.2e} "
              f"within 60 dB of each frame's peak ({near.mean():.1%} of values), "
              f"{diff.max():.2e} overall {'ok' if good else 'FAIL'}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny encoder only")
    args = parser.parse_args()
    torch.manual_seed(0)
    ok = check_encoders(args.quick)
    ok &= check_features()
    print("parity:", "ok" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
