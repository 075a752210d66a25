"""Timing helpers shared by the side-by-side benchmarks.

The method (reference/vllm-baseline.md §4, §7): one torch thread, warm-ups, the competitors
of a stage called alternately in the same process, several repeats, and the median of the
per-repeat medians as the figure. Each run also reports the CPU seconds other processes used
while it ran; well above zero means the figures are contaminated.
"""

from __future__ import annotations

import gc
import os
import resource
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

__all__ = [
    "CpuWatch",
    "Timing",
    "configure_torch",
    "fmt_bytes",
    "fmt_ratio",
    "fmt_us",
    "time_interleaved",
    "verdict",
    "wait_for_idle",
]


def configure_torch(threads: int = 1) -> None:
    """Pin torch to ``threads`` intra-op threads; the default 1 keeps OpenMP stalls out of the
    figures on a shared machine (vllm-baseline.md §7)."""
    import torch

    torch.set_num_threads(threads)


def _cpu_seconds() -> tuple[float, float]:
    """(busy, steal): CPU seconds since boot that all processes here spent busy (idle and
    iowait left out), and that the hypervisor gave to other machines; NaN where /proc/stat is
    unreadable."""
    try:
        with open("/proc/stat") as f:
            parts = f.readline().split()
    except OSError:
        return float("nan"), float("nan")
    ticks = [int(p) for p in parts[1:]] + [0] * 8
    hz = os.sysconf("SC_CLK_TCK")
    # user nice system idle iowait irq softirq steal; guest time is already in user time.
    busy = sum(ticks[:7]) - ticks[3] - ticks[4]
    return busy / hz, ticks[7] / hz


def _busy_seconds() -> float:
    return _cpu_seconds()[0]


def wait_for_idle(
    timeout_s: float, *, busy_below: float = 0.08, window_s: float = 4.0, windows: int = 2
) -> bool:
    """Wait until ``windows`` consecutive ``window_s`` windows each kept the machine's CPUs
    under ``busy_below`` busy (this process sleeping meanwhile); False after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    cpus = os.cpu_count() or 1
    quiet = 0
    while quiet < windows:
        if time.monotonic() + window_s > deadline:
            return False
        before = _busy_seconds()
        time.sleep(window_s)
        busy = (_busy_seconds() - before) / (window_s * cpus)
        quiet = quiet + 1 if busy < busy_below else 0
    return True


def _own_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@dataclass
class CpuWatch:
    """Measures the CPU time other processes (and, as steal, other machines) use between
    :meth:`start` and :meth:`stop`."""

    foreign_s: float = 0.0
    steal_s: float = 0.0  # taken by the hypervisor: noise invisible to foreign_s
    wall_s: float = 0.0
    _busy: float = 0.0
    _steal: float = 0.0
    _own: float = 0.0
    _wall: float = 0.0

    def start(self) -> CpuWatch:
        (self._busy, self._steal), self._own = _cpu_seconds(), _own_seconds()
        self._wall = time.perf_counter()
        return self

    def stop(self) -> CpuWatch:
        self.wall_s = time.perf_counter() - self._wall
        busy, steal = _cpu_seconds()
        self.foreign_s = max(0.0, (busy - self._busy) - (_own_seconds() - self._own))
        self.steal_s = steal - self._steal
        return self


@dataclass
class Timing:
    """Per-call seconds and minor page faults of one competitor, grouped by repeat."""

    repeats: list[list[float]] = field(default_factory=list)
    faults: list[list[int]] = field(default_factory=list)

    @property
    def per_repeat(self) -> list[float]:
        return [statistics.median(r) for r in self.repeats]

    @property
    def median(self) -> float:
        """Median of the per-repeat medians: the reported figure."""
        return statistics.median(self.per_repeat)

    @property
    def min(self) -> float:
        return min(min(r) for r in self.repeats)

    @property
    def faults_per_call(self) -> float:
        """Median minor page faults per call: fresh pages for large outputs, which make
        memory-bound stages depend on allocator state (vllm-baseline.md §6.1)."""
        return statistics.median(f for r in self.faults for f in r)


def time_interleaved(
    fns: Mapping[str, Callable[[], object]],
    timings: Mapping[str, Timing],
    *,
    runs: int,
    warmups: int,
    clock: Callable[[], float] = time.perf_counter,
) -> None:
    """One repeat: warm every competitor up, then ``runs`` rounds calling each once, and
    append this repeat's samples to ``timings[name]``.

    ``clock`` gives the seconds read around each call: wall time by default;
    ``time.process_time`` (this process's CPU time) keeps a single-threaded stage's figure
    steady on a machine other processes share.

    The order within a round alternates, so neither side always runs right after the other
    (cache and allocator state left behind by the previous call).
    """
    names = list(fns)
    for _ in range(warmups):
        for name in names:
            fns[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    faults: dict[str, list[int]] = {name: [] for name in names}
    gc.collect()
    for r in range(runs):
        for name in names if r % 2 == 0 else reversed(names):
            fn = fns[name]
            f0 = _minor_faults()
            t0 = clock()
            fn()  # the result is freed inside the timed region, as a caller would free it
            samples[name].append(clock() - t0)
            faults[name].append(_minor_faults() - f0)
    for name in names:
        timings[name].repeats.append(samples[name])
        timings[name].faults.append(faults[name])


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def fmt_us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:,.0f}"


def fmt_ratio(ours: float | None, theirs: float | None) -> str:
    if ours is None or theirs is None or theirs <= 0:
        return "-"
    return f"{ours / theirs:.2f}x"


def fmt_bytes(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"
