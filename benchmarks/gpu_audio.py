"""The audio encoders on a GPU: sync-free as the CPU audit says, equal to the CPU, and timed
against transformers' at the published size.

For ``qwen2-audio`` and ``moss-transcribe-diarize``:

1. tiny model, processor output for clips of several lengths (MOSS: over 30 s, chunked),
   split, batched and moved with ``mf.Transfer`` (one pinned copy); ``encode`` runs under
   ``torch.cuda.set_sync_debug_mode("error")`` after a warm-up: any device-to-host sync
   raises. Output equal to the CPU's (atol 1e-4, TF32 off).
2. the same batch with one host length field moved to the device by hand: the sync the
   audit predicts must now raise, at the line it names.
3. the published encoder (full depth, bfloat16) against transformers' on the same weights
   and inputs (``benchmarks/encoder_refs``): CUDA-event medians, ours / transformers, and
   max |diff|.

Needs mmferry's core dependencies (msgspec, blake3) where it runs; the clips are arrays at
16 kHz, so neither soundfile, soxr nor PyAV is imported.

Without CUDA it runs steps 1-2 on the CPU (no sync checks) so the script itself is tested.

    python benchmarks/gpu_audio.py [--depth N] [--runs 10]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
import traceback
from collections.abc import Callable

import torch

import mmferry as mf
from mmferry.media import samples

MODELS = {"qwen2-audio": ("audio_feature_lengths",),
          "moss-transcribe-diarize": ("audio_feature_lengths", "audio_chunk_counts",
                                      "audio_token_lengths")}
CLIPS = {"qwen2-audio": (0.4, 3.3, 12.7, 31.0), "moss-transcribe-diarize": (2.1, 31.0, 65.5)}


def _batch(model: mf.encoder.model.EncoderModel, seconds: tuple[float, ...]) -> mf.Batch:
    clips = [(samples.speech_like(s, 16000, seed=i), 16000) for i, s in enumerate(seconds)]
    outputs = model.processor(audios=clips)
    (batch,) = mf.batch_items(mf.split_items(outputs, model.field_specs(outputs)))
    return batch


def sync_free(name: str, device: torch.device) -> list[str]:
    """Steps 1 and 2; returns the failures."""
    failures = []
    model = mf.models.load(name)
    batch = _batch(model, CLIPS[name])
    with torch.no_grad():
        expected = model.encode(**batch.data)
    model = model.to(device)
    transfer = mf.Transfer(device)
    data = dict(transfer.to_device(batch))
    cuda = device.type == "cuda"
    with torch.no_grad():
        model.encode(**data)  # warm-up: kernels load, allocator grows
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.set_sync_debug_mode("error")
        try:
            out = model.encode(**data)
        except RuntimeError as e:
            failures.append(f"{name}: a sync in the right placement: {e}")
            out = None
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    if out is not None:
        diff = (out.cpu() - expected).abs().max().item()
        print(f"{name}: {out.shape[0]} tokens from {batch.num_items} clips on {device}, no sync; "
              f"max |gpu - cpu| {diff:.2e}")
        if diff > 1e-4:
            failures.append(f"{name}: gpu and cpu differ by {diff}")
    for field in MODELS[name]:
        wrong = dict(data)
        wrong[field] = batch.data[field].to(device)
        report = mf.audit.audit(model.encode, batch.data, {
            **batch.specs, field: dataclasses.replace(batch.specs[field], placement="device")},
            module=model)
        lines = sorted({f.location.rpartition("/")[2] for f in report.findings})
        if not cuda:
            print(f"{name}: {field} on the device: audit predicts {lines}")
            continue
        torch.cuda.synchronize(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.no_grad():
                model.encode(**wrong)
            failures.append(f"{name}: {field} on the device ran without a sync")
        except RuntimeError as e:
            frame = traceback.extract_tb(e.__traceback__)[-1]
            site = f"{frame.filename.rpartition('/')[2]}:{frame.lineno}"
            ok = site in lines
            print(f"{name}: {field} on the device: sync raised at {site}; audit predicted {lines}"
                  f" -> {'agree' if ok else 'DIFFER'}")
            if not ok:
                failures.append(f"{name}: {field} synced at {site}, audit said {lines}")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return failures


def _time(fn: Callable[[], torch.Tensor], runs: int, device: torch.device) -> float:
    fn()
    fn()
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def published(name: str, depth: int | None, runs: int, device: torch.device,
              dtype: torch.dtype) -> str:
    """Step 3: ours and transformers' at the published width (depth cut when given)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from encoder_refs import moss_transcribe_diarize, qwen2_audio

    module = qwen2_audio if name == "qwen2-audio" else moss_transcribe_diarize
    try:
        ours, theirs = module.build(depth=depth or (32 if name == "qwen2-audio" else 24),
                                    device=device, dtype=dtype)
    except ImportError as e:  # transformers older than the model (MOSS needs >= 5.24)
        return f"{name}: reference unavailable ({e})"
    diff = (ours().float() - theirs().float()).abs().max().item()
    t_ours, t_theirs = _time(ours, runs, device), _time(theirs, runs, device)
    return (f"{name} ({dtype}, {device}): ours {t_ours * 1e3:.2f} ms, transformers "
            f"{t_theirs * 1e3:.2f} ms, ratio {t_ours / t_theirs:.2f}x, max |diff| {diff:.2e}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=None, help="default: the published depth")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--skip-published", action="store_true")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if not cuda:
        print("no CUDA: steps 1-2 on the CPU, without sync checks")
    failures = []
    for name in MODELS:
        failures += sync_free(name, device)
    if not args.skip_published:
        for name in MODELS:
            dtype = torch.bfloat16 if cuda else torch.float32
            print(published(name, args.depth if cuda else 1, args.runs if cuda else 1, device, dtype))
    for failure in failures:
        print("FAIL", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
