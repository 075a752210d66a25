"""Per-stage data path benchmark: mmferry against vLLM 0.33.0 on identical data.

    python benchmarks/datapath.py                  # mmferry alone
    python benchmarks/datapath.py --peer vllm      # side by side, vLLM in the same process
    python benchmarks/datapath.py --quick          # smoke run, a few seconds

For the peer, vLLM 0.33.0 and mmferry must be importable from one interpreter: a separate
venv as in reference/vllm-baseline.md §1, with ``pip install -e . --no-deps`` into it.

Stages: split (field contract + per-item split), encode and decode (wire, in process, no
transport), batch (group and reduce every field on the host), transfer (mmferry only: to
"cpu", i.e. the packing without a device copy, of an already grouped batch), batch+transfer
(what the engine does before the encoder; vLLM's batch call with device="cpu" is both) and end
to end (split + encode + decode + batch + transfer).
The floor is a bare torch.cat / torch.stack of the same per-item tensors. Synthetic tensors
with the shapes the Hugging Face processors emit; nothing is downloaded. Method and caveats:
reference/vllm-baseline.md §4 and §7 (compare ratios from one run, never one absolute time).
"""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from _common import (
    CpuWatch,
    Timing,
    configure_torch,
    fmt_bytes,
    fmt_ratio,
    fmt_us,
    time_interleaved,
    verdict,
    wait_for_idle,
)

import mmferry as mf

STAGES = ("split", "encode", "decode", "batch", "transfer", "batch+transfer", "end_to_end")
FLOOR = "floor"
OURS, PEER = "mmferry", "vLLM"
# Targets (issue 2): end to end and header bytes on the many-small-items case, batching
# against the bare copy on the large-tensor cases.
E2E_TARGET, HEADER_TARGET, FLOOR_TARGET = 0.5, 0.1, 1.1
SMALL_CASE = "qwen2vl_small64"
CASES = ("qwen2vl_f32", "qwen2vl_bf16", SMALL_CASE, "qwen2audio")


@dataclass
class Case:
    """Processor output of one request, and how each library declares its fields."""

    name: str
    modality: str
    outputs: dict[str, torch.Tensor]
    ours_specs: Callable[[], dict[str, mf.FieldSpec]]
    peer_config: Callable[[Any], dict[str, Any]]  # takes vLLM's MultiModalFieldConfig
    floor_ops: dict[str, str]  # field -> "cat" | "stack": the reduction's bare copy
    large: bool  # whether the batching-vs-floor target applies
    num_items: int = 0
    payload_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.payload_bytes = sum(t.nbytes for t in self.outputs.values())


def qwen2vl_case(name: str, items: int, side: int, dtype: torch.dtype) -> Case:
    """Qwen2-VL image processor output: ``items`` images of ``side`` x ``side`` patches."""
    grid = torch.tensor([[1, side, side]] * items, dtype=torch.int64)
    pixels = torch.randn(int(grid.prod(-1).sum()), 1176).to(dtype)

    # Built per request, as a model's field config is (vLLM: _get_mm_fields_config). Only
    # the fields present are declared on both sides.
    def ours() -> dict[str, mf.FieldSpec]:
        return {
            "pixel_values": mf.FieldSpec.flat_from_sizes("image", grid.prod(-1)),
            "image_grid_thw": mf.FieldSpec.batched("image", placement="host"),
        }

    def peer(config: Any) -> dict[str, Any]:
        return {
            "pixel_values": config.flat_from_sizes("image", grid.prod(-1)),
            "image_grid_thw": config.batched("image", keep_on_cpu=True),
        }

    return Case(name, "image", {"pixel_values": pixels, "image_grid_thw": grid}, ours, peer,
                {"pixel_values": "cat", "image_grid_thw": "stack"}, large=items <= 8,
                num_items=items)


def qwen2audio_case(name: str, items: int) -> Case:
    """Qwen2-Audio feature extractor output: ``items`` 30 s clips of varying valid length."""
    features = torch.randn(items, 128, 3000)
    lengths = torch.randint(500, 3001, (items,))
    mask = (torch.arange(3000) < lengths[:, None]).to(torch.int32)

    def ours() -> dict[str, mf.FieldSpec]:
        return {
            "input_features": mf.FieldSpec.batched("audio"),
            "feature_attention_mask": mf.FieldSpec.batched("audio"),
        }

    def peer(config: Any) -> dict[str, Any]:
        return {
            "input_features": config.batched("audio"),
            "feature_attention_mask": config.batched("audio"),
        }

    return Case(name, "audio", {"input_features": features, "feature_attention_mask": mask},
                ours, peer, {"input_features": "stack", "feature_attention_mask": "stack"},
                large=True, num_items=items)


def make_cases() -> list[Case]:
    torch.manual_seed(0)
    f32, bf16, small, audio = CASES
    return [
        qwen2vl_case(f32, 8, 32, torch.float32),
        qwen2vl_case(bf16, 8, 32, torch.bfloat16),
        qwen2vl_case(small, 64, 8, torch.float32),
        qwen2audio_case(audio, 8),
    ]


# -- the two sides ----------------------------------------------------------------------


@dataclass
class Side:
    """One library's stage callables for one case, built on data its own chain produced."""

    stages: dict[str, Callable[[], object]]
    frame_bytes: int


def _check_equal(who: str, case: Case, batched: Mapping[str, Any]) -> None:
    """The chain must give back every input tensor exactly (same dtype, same values)."""
    if set(batched) != set(case.outputs):
        raise AssertionError(f"{who} on {case.name}: fields {sorted(batched)}")
    for key, want in case.outputs.items():
        got = batched[key]
        if not (isinstance(got, torch.Tensor) and got.dtype == want.dtype
                and got.device.type == "cpu" and torch.equal(got, want)):
            raise AssertionError(f"{who} on {case.name}: {key} does not reproduce the input")


def _frame_bytes(frames: list[Any]) -> int:
    return sum(memoryview(f).nbytes for f in frames)


def build_ours(case: Case, transfer: mf.Transfer) -> tuple[Side, Callable[[], object]]:
    """mmferry's stages, and the floor over the same per-item tensors its batch reads."""
    outputs, specs = case.outputs, case.ours_specs
    items = mf.split_items(outputs, specs())
    frames = mf.wire.encode(items)
    decoded = mf.wire.decode(frames)
    if decoded != items:
        raise AssertionError(f"mmferry on {case.name}: decode(encode(items)) != items")
    batches = mf.batch_items(decoded)
    if [(b.modality, b.num_items) for b in batches] != [(case.modality, case.num_items)]:
        raise AssertionError(f"mmferry on {case.name}: batches {batches}")
    _check_equal("mmferry batch", case, dict(batches[0].data))
    moved = transfer.to_device(mf.batch_items(decoded)[0])
    _check_equal("mmferry transfer", case, dict(moved))
    del moved
    # The transfer stage alone moves one grouped batch over and over: its host fields are
    # reduced on the first call and kept by the batch, its device fields packed every call.
    to_move = mf.batch_items(decoded)

    def split() -> object:
        return mf.split_items(outputs, specs())

    def batch() -> object:
        return [dict(b.data) for b in mf.batch_items(decoded)]

    def batch_transfer() -> object:
        return [transfer.to_device(b) for b in mf.batch_items(decoded)]

    def end_to_end() -> object:
        got = mf.wire.decode(mf.wire.encode(mf.split_items(outputs, specs())))
        return [transfer.to_device(b) for b in mf.batch_items(got)]

    per_item = {k: [it[k] for it in decoded[case.modality]] for k in case.floor_ops}
    ops = {k: torch.cat if op == "cat" else torch.stack for k, op in case.floor_ops.items()}

    def floor() -> object:
        return [ops[k](v) for k, v in per_item.items()]

    stages = {
        "split": split,
        "encode": lambda: mf.wire.encode(items),
        "decode": lambda: mf.wire.decode(frames),
        "batch": batch,
        "transfer": lambda: [transfer.to_device(b) for b in to_move],
        "batch+transfer": batch_transfer,
        "end_to_end": end_to_end,
    }
    return Side(stages, _frame_bytes(frames)), floor


class Vllm:
    """vLLM 0.33.0's multimodal input API (reference/vllm-baseline.md §3), CPU only."""

    def __init__(self) -> None:
        from vllm.multimodal.inputs import (
            MultiModalFieldConfig,
            MultiModalKwargsItem,
            MultiModalKwargsItems,
        )
        from vllm.multimodal.utils import group_and_batch_mm_kwargs
        from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

        self.config = MultiModalFieldConfig
        self.items_type = MultiModalKwargsItems
        self.group = group_and_batch_mm_kwargs
        # One encoder and decoder per process, as the frontend and engine core keep them.
        self.encoder = MsgpackEncoder()
        self.decoder = MsgpackDecoder(list[MultiModalKwargsItem])

    @staticmethod
    def version() -> str:
        import vllm

        return vllm.__version__

    def build(self, case: Case) -> Side:
        outputs, modality = case.outputs, case.modality
        config = self.config

        def split() -> Any:
            return self.items_type.from_hf_inputs(outputs, case.peer_config(config))

        def encode(items: Any) -> list[Any]:
            return self.encoder.encode(list(items[modality]))

        def batch(decoded: list[Any]) -> list[dict[str, Any]]:
            # The model runner's call, with device="cpu"; pinning fails without a driver (§2).
            pairs = [(modality, it) for it in decoded]
            return [kw for _, _, kw in self.group(pairs, device="cpu", pin_memory=False)]

        items = split()
        frames = encode(items)
        decoded = self.decoder.decode(frames)
        batches = batch(decoded)
        if len(batches) != 1:
            raise AssertionError(f"vLLM on {case.name}: {len(batches)} batches")
        _check_equal("vLLM batch", case, batches[0])

        def end_to_end() -> object:
            return batch(self.decoder.decode(encode(split())))

        stages = {
            "split": split,
            "encode": lambda: encode(items),
            "decode": lambda: self.decoder.decode(frames),
            "batch": lambda: batch(decoded),
            # vLLM's reduce moves each tensor itself (.to(device)): batch+transfer is one call.
            "batch+transfer": lambda: batch(decoded),
            "end_to_end": end_to_end,
        }
        return Side(stages, _frame_bytes(frames))


def load_peer(name: str | None) -> Vllm | None:
    if name is None:
        print("peer: none (pass --peer vllm for the side-by-side run); mmferry alone")
        return None
    try:
        peer = Vllm()
    except Exception as e:  # not installed, or an install whose import fails on this machine
        print(f"peer: vLLM is not importable ({type(e).__name__}: {e}); mmferry alone")
        return None
    print(f"peer: vLLM {peer.version()} in this process (device='cpu', pin_memory=False)")
    return peer


# -- run and report ---------------------------------------------------------------------


@dataclass
class Result:
    case: Case
    timings: dict[str, dict[str, Timing]]  # stage -> competitor -> timing
    header: dict[str, int]  # competitor -> header bytes


def run(cases: list[Case], peer: Vllm | None, args: argparse.Namespace) -> list[Result]:
    transfer = mf.Transfer("cpu")
    built = []
    for case in cases:
        ours, floor = build_ours(case, transfer)
        sides = {OURS: ours}
        if peer is not None:
            sides[PEER] = peer.build(case)
        header = {who: s.frame_bytes - case.payload_bytes for who, s in sides.items()}
        timings: dict[str, dict[str, Timing]] = {}
        for stage in STAGES:
            timings[stage] = {who: Timing() for who, s in sides.items() if stage in s.stages}
        timings["batch"][FLOOR] = Timing()
        built.append((Result(case, timings, header), sides, floor))
    print(f"exactness: every input tensor reproduced by {' and '.join(built[0][1])} "
          f"(torch.equal, same dtype) on {len(cases)} cases")
    for _ in range(args.repeats):
        for result, sides, floor in built:
            for stage in STAGES:
                fns = {who: s.stages[stage] for who, s in sides.items() if stage in s.stages}
                if stage == "batch":
                    fns[FLOOR] = floor
                time_interleaved(fns, result.timings[stage], runs=args.runs,
                                 warmups=args.warmups)
    return [r for r, _, _ in built]


def _median(result: Result, stage: str, who: str) -> float | None:
    t = result.timings[stage].get(who)
    return None if t is None else t.median


def _spread(t: Timing | None) -> str:
    if t is None:
        return "-"
    return f"{'/'.join(fmt_us(m) for m in t.per_repeat)} ({t.faults_per_call:,.0f} flt)"


def report(results: list[Result]) -> list[tuple[str, bool | None]]:
    """Print one table per case and return the targets as (description, met or None)."""
    head = (f"{'stage':<15}{'mmferry us':>12}{'vLLM us':>12}{'ratio':>9}{'floor us':>11}"
            f"{'vs floor':>10}   per-repeat medians us, faults/call (mmferry | vLLM)")
    for r in results:
        c = r.case
        print(f"\n{c.name}: {c.num_items} {c.modality} items, "
              f"{fmt_bytes(c.payload_bytes)} tensor bytes")
        print(head)
        for stage in STAGES:
            ours, theirs = _median(r, stage, OURS), _median(r, stage, PEER)
            fl = _median(r, stage, FLOOR)
            print(f"{stage:<15}{fmt_us(ours):>12}{fmt_us(theirs):>12}"
                  f"{fmt_ratio(ours, theirs):>9}{fmt_us(fl):>11}{fmt_ratio(ours, fl):>10}   "
                  f"{_spread(r.timings[stage].get(OURS))} | "
                  f"{_spread(r.timings[stage].get(PEER))}"
                  + (f" | floor {_spread(r.timings[stage][FLOOR])}" if fl is not None else ""))
        h_ours, h_peer = r.header[OURS], r.header.get(PEER)
        print(f"{'header bytes':<15}{fmt_bytes(h_ours):>12}{fmt_bytes(h_peer):>12}"
              f"{fmt_ratio(h_ours, h_peer):>9}   (all frame bytes minus tensor payload bytes)")

    targets: list[tuple[str, bool | None]] = []
    by_name = {r.case.name: r for r in results}
    small = by_name.get(SMALL_CASE)
    if small is not None:
        ours, theirs = _median(small, "end_to_end", OURS), _median(small, "end_to_end", PEER)
        targets.append((f"{SMALL_CASE} end_to_end <= {E2E_TARGET}x vLLM: "
                        f"{fmt_ratio(ours, theirs)}",
                        None if theirs is None else ours <= E2E_TARGET * theirs))
        h_ours, h_peer = small.header[OURS], small.header.get(PEER)
        targets.append((f"{SMALL_CASE} header bytes <= {HEADER_TARGET}x vLLM: "
                        f"{fmt_bytes(h_ours)} vs {fmt_bytes(h_peer)} = {fmt_ratio(h_ours, h_peer)}",
                        None if h_peer is None else h_ours <= HEADER_TARGET * h_peer))
    for r in results:
        if r.case.large:
            ours, fl = _median(r, "batch", OURS), _median(r, "batch", FLOOR)
            targets.append((f"{r.case.name} batch <= {FLOOR_TARGET}x torch.cat/stack floor: "
                            f"{fmt_ratio(ours, fl)}", ours <= FLOOR_TARGET * fl))
    print("\ntargets")
    for text, met in targets:
        print(f"  {'n/a (no peer)' if met is None else verdict(met):<14}{text}")
    return targets


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--peer", choices=["vllm"], default=None,
                   help="run the same data through this library in the same process")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 repeat, 3 runs")
    p.add_argument("--repeats", type=int, default=3, help="times the whole case set runs")
    p.add_argument("--runs", type=int, default=30, help="timed calls per stage per repeat")
    p.add_argument("--warmups", type=int, default=3, help="untimed calls before each stage")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--cases", nargs="+", choices=CASES, default=None,
                   help="run only these cases")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                   help="first wait up to this long for two quiet 4 s windows (< 8%% CPU)")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.runs, args.warmups = 1, 3, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_torch(args.threads)
    print(f"python {platform.python_version()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} torch thread(s), mmferry {mf.__version__}; "
          f"{args.repeats} repeat(s) x {args.runs} runs after {args.warmups} warm-up(s); "
          "figures are medians of per-repeat medians")
    peer = load_peer(args.peer)
    cases = [c for c in make_cases() if not args.cases or c.name in args.cases]
    if args.wait_idle > 0:
        quiet = wait_for_idle(args.wait_idle)
        print(f"idle wait: {'machine quiet' if quiet else 'gave up, machine still busy'}")
    watch = CpuWatch().start()
    results = run(cases, peer, args)
    watch.stop()
    report(results)
    print(f"\nforeign CPU: {watch.foreign_s:.2f} s used by other processes, steal "
          f"{watch.steal_s:.2f} s, during {watch.wall_s:.1f} s of timing "
          "(well above 0 means contaminated figures)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
