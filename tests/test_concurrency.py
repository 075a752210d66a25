"""Issue 9, class 4: EncoderCache and EncoderRunner shared by threads."""

from __future__ import annotations

import random
import threading
import time
from typing import ClassVar

import torch

import mmferry as mf

F = mf.FieldSpec
SECONDS = 1.0
THREADS = 8


def test_eight_threads_mixing_put_lookup_release_and_eviction() -> None:
    cache = mf.EncoderCache(max_tokens=64)
    values = {f"k{i}": torch.full((1 + i % 7, 4), float(i)) for i in range(40)}
    errors: list[BaseException] = []
    ops = [0] * THREADS
    start = threading.Barrier(THREADS)

    def work(t: int) -> None:
        rng = random.Random(t)
        start.wait()  # all threads contend from the same moment
        stop = time.perf_counter() + SECONDS
        try:
            while time.perf_counter() < stop or ops[t] < 200:
                key = rng.choice(list(values))
                request = f"r{t}-{rng.randrange(4)}"
                op = rng.random()
                if op < 0.35:
                    cache.put(key, values[key], request if rng.random() < 0.7 else None)
                elif op < 0.7:
                    got = cache.get(key, request if rng.random() < 0.5 else None)
                    # A hit is always the value stored under that key, never another's.
                    assert got is None or got is values[key]
                elif op < 0.9:
                    cache.release(request)
                else:
                    key in cache  # noqa: B015
                    len(cache)
                ops[t] += 1
        except BaseException as e:  # handed to the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[0]
    assert min(ops) >= 200  # every thread really ran
    cache.check_consistency()
    assert cache.stats.evictions > 0  # the run did exercise eviction under contention
    for t in range(THREADS):
        for r in range(4):
            cache.release(f"r{t}-{r}")
    cache.check_consistency()
    # Everything released: a fresh entry as large as the cache must now fit.
    assert cache.put("big", torch.zeros(64, 4))
    assert len(cache) == 1 and cache.stats.tokens == 64


class Slow(torch.nn.Module):
    """Rows of each item times a weight; sleeps in encode so calls overlap in time."""

    name = "slow"
    modalities = ("image",)
    hidden_size = 2
    precomputed_fields: ClassVar[frozenset[str]] = frozenset()
    checkpoint_prefixes: ClassVar[dict[str, str]] = {}

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.0, -1.0]))
        self.inside = 0
        self.overlaps = 0

    def check_item(self, item) -> None:
        pass

    def tokens_per_item(self, item) -> int:
        return item["x"].shape[0]

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        self.inside += 1
        self.overlaps += self.inside > 1
        time.sleep(0.001)
        self.inside -= 1
        return x[:, :1] * self.w


def test_a_runner_shared_by_threads_serialises_calls_and_answers_each_correctly() -> None:
    model = Slow()
    runner = mf.EncoderRunner(model, mf.EncoderCache(max_tokens=40))
    items = [mf.Item("image", {"x": torch.full((1 + i % 3, 1), float(i))},
                     {"x": F.flat("image", [slice(None)])}) for i in range(30)]
    want = [torch.full((1 + i % 3, 1), float(i)) * model.w.detach() for i in range(30)]
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)
    calls = [0] * THREADS

    def work(t: int) -> None:
        rng = random.Random(t)
        n = 0
        start.wait()
        stop = time.perf_counter() + SECONDS
        try:
            while time.perf_counter() < stop or n < 20:
                picks = rng.sample(range(30), 4)
                outs = runner.encode([items[i] for i in picks], request=(t, n))
                for i, out in zip(picks, outs, strict=True):
                    assert torch.equal(out, want[i])
                    out.mul_(0)  # the caller's copy: must not leak to others
                runner.release((t, n))
                n += 1
            calls[t] = n
        except BaseException as e:  # handed to the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[0]
    assert min(calls) >= 20
    assert model.overlaps == 0  # encoder calls never ran concurrently
    runner.cache.check_consistency()
