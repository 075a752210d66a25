"""The encoder runner: cache lookup, batching within a step budget, transfer, encode, scatter."""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mmferry.batching import batch_items
from mmferry.encoder.cache import EncoderCache, EncoderCacheError
from mmferry.encoder.merge import scatter_output_slices
from mmferry.encoder.model import EncoderModel
from mmferry.errors import ContractError
from mmferry.items import Item, Items
from mmferry.transfer import Transfer

__all__ = ["EncoderRunner", "RunStats"]


@dataclass(slots=True)
class RunStats:
    """What the last :meth:`EncoderRunner.encode` call did, and where its host time went:
    seconds per stage (lookup: hashing and cache lookup; batch; transfer; encode: the model
    call, which on CUDA returns once its kernels are queued; scatter; cache: storing)."""

    items: int = 0
    status: list[str] = field(default_factory=list)  # per item: "hit", "miss" or "repeat"
    hits: int = 0
    encoded: int = 0
    encoder_calls: int = 0
    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, stage: str, seconds: float) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds


class EncoderRunner:
    """Encodes items with ``model``, each unique item once, reusing ``cache`` across calls.

    ``max_tokens_per_step`` bounds the output rows of one encoder call (default: no bound
    beyond the cache's capacity). Outputs stay on ``device``.
    """

    def __init__(
        self,
        model: EncoderModel,
        cache: EncoderCache | None = None,
        device: torch.device | str = "cpu",
        max_tokens_per_step: int | None = None,
        transfer: Transfer | None = None,
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.cache = cache if cache is not None else EncoderCache(max_tokens=1 << 20)
        if max_tokens_per_step is not None and max_tokens_per_step < 1:
            raise ValueError(f"max_tokens_per_step must be positive, got {max_tokens_per_step}")
        self.max_tokens_per_step = max_tokens_per_step or self.cache.max_tokens
        self.transfer = transfer if transfer is not None else Transfer(self.device)
        self._precomputed = frozenset(model.precomputed_fields)
        self.last = RunStats()

    def release(self, request: Hashable) -> None:
        """The request is done: its cache entries may be evicted."""
        self.cache.release(request)

    def encode(self, items: Items | Sequence[Item], *, request: Hashable = None) -> list[torch.Tensor]:
        """One ``[tokens, hidden]`` tensor per item, in input order.

        Cache hits skip everything; misses are de-duplicated by hash, batched in order within
        the step budget, transferred, encoded, cut into per-item rows by the host-known token
        counts, and cached under ``request`` (released with :meth:`release`).
        """
        seq = items.in_order() if isinstance(items, Items) else list(items)
        stats = self.last = RunStats(items=len(seq), status=["miss"] * len(seq))
        clock = time.perf_counter()

        def lap(stage: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            stats.add(stage, now - clock)
            clock = now

        out: list[torch.Tensor | None] = [None] * len(seq)
        todo: dict[str, list[int]] = {}  # hash -> positions, first occurrence order
        tokens: dict[str, int] = {}
        for i, item in enumerate(seq):
            key = item.hash
            if key in todo:
                todo[key].append(i)
                stats.status[i] = "repeat"
                continue
            hit = self.cache.get(key, request)
            if hit is not None:
                out[i] = hit
                stats.hits += 1
                stats.status[i] = "hit"
                continue
            self.model.check_item(item)
            n = self.model.tokens_per_item(item)
            self.cache.check_fits(key, n)
            if n > self.max_tokens_per_step:
                raise EncoderCacheError(
                    f"item {key[:16]} has {n} tokens, more than max_tokens_per_step="
                    f"{self.max_tokens_per_step}"
                )
            tokens[key] = n
            todo[key] = [i]
        lap("lookup")

        misses = [seq[positions[0]] for positions in todo.values()]
        results: dict[str, torch.Tensor] = {}
        for step in self._steps(misses, tokens):
            for batch in batch_items(step):
                lap("batch")
                device_batch = self.transfer.to_device(batch)
                lap("transfer")
                counts = [tokens[it.hash] for it in batch.items]
                embeds = next((name for name in batch.specs if name in self._precomputed), None)
                if embeds is not None:
                    output = device_batch[embeds]
                else:
                    with torch.inference_mode():
                        output = self.model.encode(**device_batch)
                    stats.encoder_calls += 1
                lap("encode")
                self._check(output, counts, batch.items)
                # Cut rows are views; a cache entry must not keep the whole batch output (or,
                # for precomputed embeddings, the whole transfer block) alive.
                scatter_output_slices(output, [it.hash for it in batch.items], counts, results,
                                      clone=embeds is not None or batch.num_items > 1)
                stats.encoded += batch.num_items
                lap("scatter")

        for key, positions in todo.items():
            value = results[key]
            self.cache.put(key, value, request)
            for i in positions:
                out[i] = value
        lap("cache")
        return out  # type: ignore[return-value]

    def _steps(self, misses: list[Item], tokens: dict[str, int]) -> list[list[Item]]:
        steps: list[list[Item]] = []
        budget = 0
        for item in misses:
            n = tokens[item.hash]
            if not steps or budget + n > self.max_tokens_per_step:
                steps.append([])
                budget = 0
            steps[-1].append(item)
            budget += n
        return steps

    def _check(self, output: Any, counts: list[int], items: Sequence[Item]) -> None:
        name = self.model.name
        if not isinstance(output, torch.Tensor) or output.ndim != 2:
            raise ContractError(
                f"model {name} returned {type(output).__name__}"
                f"{'' if not isinstance(output, torch.Tensor) else tuple(output.shape)}; "
                "expected one [tokens, hidden] tensor"
            )
        # Shapes are host metadata: these checks cost no sync.
        hidden = self.model.hidden_size
        if output.shape[1] != hidden:
            raise ContractError(
                f"model {name} returned rows of width {output.shape[1]}, expected its hidden size "
                f"{hidden}"
            )
        if output.shape[0] != sum(counts):
            per_item = ", ".join(f"{it.hash[:12]}={n}" for it, n in zip(items, counts, strict=True))
            raise ContractError(
                f"model {name} returned {output.shape[0]} rows for {len(items)} "
                f"{items[0].modality} items whose tokens_per_item sum to {sum(counts)} "
                f"({per_item})"
            )
