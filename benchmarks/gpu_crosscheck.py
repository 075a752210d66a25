"""Cross-check the CPU placement audit against a real GPU.

For every example encoder (``mmferry.audit.examples``) and each of its cases:

1. audit on the CPU: the predicted sync sites (``host_sync`` and ``implicit_h2d``
   findings, both synchronise the host with the device), mismatch sites and pageable
   ``non_blocking`` copies;
2. run the same code on ``cuda`` with the fields placed as the case's specs say, through
   ``mf.Transfer`` (one pinned asynchronous copy; ``both`` fields as ``Mirrored``) when the
   inputs split into one batch, after one warm-up call;
3. observe under ``torch.cuda.set_sync_debug_mode("warn")`` the Python line of every sync
   warning, the line where a device mismatch raised (a GPU run stops at the first), and
   the profiler's ``cudaStreamSynchronize`` / memcpy events (``Memcpy HtoD (Pageable ->
   Device)`` is the ground truth for pageable copies, which sync-debug mode does not
   report);
4. print where prediction and observation agree or differ; exit 1 on any difference.

Explicit ``torch.cuda.synchronize()`` lines are deliberate syncs and are not compared;
``async_copy_race`` findings cannot be observed this way and are only listed.

Without CUDA it prints that it skipped and exits 0.

    python3 benchmarks/gpu_crosscheck.py [--example NAME]... [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import linecache
import os
import sys
import warnings
from collections import Counter
from typing import Any

import torch

from mmferry.audit import AuditReport, audit
from mmferry.audit.examples import EXAMPLES, Case, Example
from mmferry.audit.tracer import skipped_frame
from mmferry.batching import batch_items
from mmferry.errors import MmferryError
from mmferry.fields import FieldSpec, Placement
from mmferry.items import Item, split_items
from mmferry.transfer import Mirrored, Transfer


def _site(filename: str, line: int) -> str:
    return f"{os.path.basename(filename)}:{line}"


def _site_of(location: str) -> str:
    path, _, line = location.rpartition(":")
    return _site(path, int(line))


def predicted(report: AuditReport) -> dict[str, Any]:
    """What the CPU audit says a GPU run will show."""
    sites: dict[str, set[str]] = {"sync": set(), "mismatch": set(), "race": set()}
    pageable = 0
    for f in report.findings:
        if f.kind in ("host_sync", "implicit_h2d"):
            sites["sync"].add(_site_of(f.location))
        elif f.kind == "device_mismatch":
            sites["mismatch"].add(_site_of(f.location))
        elif f.kind == "async_copy_race":
            sites["race"].add(_site_of(f.location))
        elif f.kind == "pageable_async_copy":
            pageable += f.count
    return {**{k: sorted(v) for k, v in sites.items()}, "pageable": pageable}


def _user_site(frames: list[tuple[str, int]]) -> str | None:
    """The innermost frame outside torch, mmferry's machinery and the warnings module."""
    for filename, line in reversed(frames):
        if not skipped_frame(filename) and not filename.endswith(os.sep + "warnings.py"):
            return _site(filename, line)
    return None


def _stack() -> list[tuple[str, int]]:
    frames = []
    frame = sys._getframe(1)
    while frame is not None:
        frames.append((frame.f_code.co_filename, frame.f_lineno))
        frame = frame.f_back
    return frames[::-1]


def _deliberate(site: str, frames_by_site: dict[str, tuple[str, int]]) -> bool:
    filename, line = frames_by_site[site]
    return "synchronize(" in linecache.getline(filename, line)


def _place(value: Any, placement: Placement, device: torch.device) -> Any:
    if isinstance(value, list | tuple):
        return type(value)(_place(v, placement, device) for v in value)
    if not isinstance(value, torch.Tensor) or placement is Placement.HOST:
        return value
    on_device = value.pin_memory().to(device, non_blocking=True)
    return Mirrored(host=value, device=on_device) if placement is Placement.BOTH else on_device


def _placed(inputs: dict[str, Any], case: Case, device: torch.device) -> tuple[dict[str, Any], str]:
    """The inputs where the case's specs put them: through ``mf.Transfer`` (the path an engine
    takes) when they split into one batch, else field by field. Names without a spec are
    untracked device values, uploaded as they are."""
    tracked = {k: v for k, v in inputs.items() if k in case.specs}
    untracked = {k: _place(v, Placement.DEVICE, device) for k, v in inputs.items()
                 if k not in case.specs}
    try:
        batches = batch_items(split_items(tracked, case.specs))
    except MmferryError:
        # Batch-level specs without split sizes: the inputs as one item whose fields are
        # flat, which a one-item batch reduces to themselves.
        modality = next(iter(case.specs.values())).modality
        specs = {k: FieldSpec("flat", modality, case.specs[k].placement) for k in tracked}
        batches = batch_items([Item(modality, tracked, specs)])
    if len(batches) == 1:
        return {**dict(Transfer(device).to_device(batches[0])), **untracked}, "Transfer"
    placed = {k: _place(v, case.specs[k].placement, device) for k, v in tracked.items()}
    return {**placed, **untracked}, "per field"


def observe(fn: Any, inputs: dict[str, Any], case: Case, device: torch.device) -> dict[str, Any]:
    """Run ``fn`` on the GPU with the case's placements and record what happens."""
    placed, path = _placed(inputs, case, device)
    torch.cuda.synchronize()
    with contextlib.suppress(RuntimeError):  # mismatch cases fail here too
        fn(**placed)  # warm-up: allocator, kernels, lazy initialisation
    torch.cuda.synchronize()

    syncs: dict[str, tuple[str, int]] = {}

    def record(message: Any, category: Any, filename: str, lineno: int, *args: Any) -> None:
        if "synchroniz" in str(message):
            frames = _stack()
            site = _user_site(frames) or _site(filename, lineno)
            user = next((fr for fr in reversed(frames) if _site(*fr) == site), (filename, lineno))
            syncs[site] = user

    mismatch = None
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with warnings.catch_warnings(), torch.profiler.profile(activities=activities) as prof:
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn(**placed)
        except RuntimeError as e:
            tb, frames = e.__traceback__, []
            while tb is not None:
                frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno))
                tb = tb.tb_next
            mismatch = _user_site(frames)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # Our own wait for the queued work is outside the profiled region, so every
    # synchronisation the profiler counts is the encoder's.
    torch.cuda.synchronize()
    events = Counter(e.name for e in prof.events()
                     if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                   "cudaEventSynchronize") or e.name.startswith("Memcpy"))
    observed_syncs = sorted(s for s in syncs if not _deliberate(s, syncs))
    return {"sync": observed_syncs, "mismatch": mismatch, "placed by": path,
            "pageable": sum(n for name, n in events.items() if "Pageable -> Device" in name),
            "events": dict(events)}


def compare(pred: dict[str, Any], obs: dict[str, Any]) -> list[str]:
    """Differences between prediction and observation (empty: they agree)."""
    diffs = []
    if pred["mismatch"]:
        if obs["mismatch"] not in pred["mismatch"]:
            diffs.append(f"predicted a mismatch at {pred['mismatch']}, the GPU raised at "
                         f"{obs['mismatch']}")
        return diffs  # the GPU run stopped at the first mismatch; syncs after it are unseen
    if obs["mismatch"]:
        diffs.append(f"the GPU raised at {obs['mismatch']}, no mismatch predicted")
    missed = sorted(set(obs["sync"]) - set(pred["sync"]))
    extra = sorted(set(pred["sync"]) - set(obs["sync"]))
    if missed:
        diffs.append(f"syncs the audit missed: {missed}")
    if extra:
        diffs.append(f"predicted syncs the GPU did not report: {extra}")
    if pred["pageable"] and not obs["pageable"]:
        diffs.append("predicted pageable copies, the profiler saw none")
    return diffs


def _cases(example: Example) -> list[tuple[str, Case]]:
    return [("correct", example.correct), *example.wrong.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--example", action="append", choices=sorted(EXAMPLES),
                        help="only these examples (default: all)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_crosscheck: skipped, no CUDA device on this machine "
              "(run it on a GPU machine to compare the audit with the GPU)")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    rows, failures = [], 0
    for name in args.example or list(EXAMPLES):
        example = EXAMPLES[name]
        for case_name, case in _cases(example):
            report = audit(example.build(case.variant), example.inputs(), case.specs)
            pred = predicted(report)
            fn = example.build(case.variant)
            if isinstance(fn, torch.nn.Module):
                fn = fn.to(device)
            obs = observe(fn, example.inputs(), case, device)
            diffs = compare(pred, obs)
            failures += bool(diffs)
            rows.append({"example": name, "case": case_name, "agree": not diffs,
                         "differences": diffs, "predicted": pred, "observed": obs})
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            status = "agree" if r["agree"] else "DIFFER"
            print(f"{r['example']:14s} {r['case']:24s} {status}")
            print(f"    predicted syncs {r['predicted']['sync']}  mismatch "
                  f"{r['predicted']['mismatch']}  pageable {r['predicted']['pageable']}  "
                  f"races (not observable) {r['predicted']['race']}")
            print(f"    observed  syncs {r['observed']['sync']}  mismatch "
                  f"{r['observed']['mismatch']}  pageable {r['observed']['pageable']}  "
                  f"profiler {r['observed']['events']}")
            for d in r["differences"]:
                print(f"    - {d}")
        print(f"{len(rows) - failures}/{len(rows)} cases agree")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
