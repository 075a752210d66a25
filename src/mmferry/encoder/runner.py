"""The encoder runner: per-item checks, cache lookup, batching within a step budget,
transfer, encode, scatter.

A malformed item fails alone: it gets status ``"error"``, its error in
:attr:`RunStats.errors` and ``None`` in place of its embedding, while every other item of the
call is encoded and cached as usual. Nothing an item that failed a check could have shifted
is ever cached.

Thread safety: one :class:`EncoderRunner` may be shared by threads. :meth:`EncoderRunner.encode`
holds the runner's lock for the whole call (the model, the transfer's staging blocks and the
device stream are one resource), so calls run one at a time in arrival order; the cache has a
lock of its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mmferry.batching import batch_items
from mmferry.encoder.cache import EncoderCache, EncoderCacheError
from mmferry.encoder.merge import scatter_output_slices
from mmferry.encoder.model import EncoderModel
from mmferry.errors import ArgumentError, ContractError, MmferryError
from mmferry.fields import concatenable
from mmferry.hashing import hash_model
from mmferry.items import Item, Items
from mmferry.transfer import Transfer

__all__ = ["EncoderRunner", "RunStats"]

# What model code raises when an item lacks, or mistypes, what it reads.
_ITEM_ERRORS = (TypeError, AttributeError, KeyError, IndexError, ValueError)


@dataclass(slots=True)
class RunStats:
    """What one :meth:`EncoderRunner.encode` call did, and where its host time went:
    seconds per stage (lookup: checks, hashing and cache lookup; batch; transfer; encode: the
    model call, which on CUDA returns once its kernels are queued; scatter; cache: storing).

    ``status[i]`` is ``"hit"``, ``"miss"``, ``"repeat"`` (the same item earlier in the call)
    or ``"error"``; ``errors`` maps the position of each failed item to its typed error (a
    :class:`~mmferry.errors.ContractError` naming item and field, or an
    :class:`~mmferry.errors.EncoderCacheError` for an item no step or cache can hold).
    """

    items: int = 0
    status: list[str] = field(default_factory=list)
    hits: int = 0
    encoded: int = 0
    encoder_calls: int = 0
    errors: dict[int, MmferryError] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, stage: str, seconds: float) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds


def _named(error: MmferryError, position: int, item: Item) -> MmferryError:
    """``error`` with the item's position and hash prefixed, same type and attributes."""
    where = f"item {position} ({item.modality}, {(item.known_hash or 'unhashable')[:12]})"
    if str(error).startswith(where):
        return error
    named = type(error).__new__(type(error))
    named.__dict__.update(error.__dict__)
    named.args = (f"{where}: {error}",)
    return named


class EncoderRunner:
    """Encodes items with ``model``, each unique item once, reusing ``cache`` across calls.

    ``max_tokens_per_step`` bounds the output rows of one encoder call (default: no bound
    beyond the cache's capacity). Outputs stay on ``device``.

    Cache keys are ``"<model id>:<item hash>"``, the model id being ``model_id`` or, by
    default, :func:`mmferry.hashing.hash_model` of the model (name, config and every weight,
    dtype included), computed once here: two runners of different models, weights or dtypes
    can share one cache and never see each other's entries. :meth:`cache_key` gives an
    item's key.
    """

    def __init__(
        self,
        model: EncoderModel,
        cache: EncoderCache | None = None,
        device: torch.device | str = "cpu",
        max_tokens_per_step: int | None = None,
        transfer: Transfer | None = None,
        *,
        model_id: str | None = None,
    ) -> None:
        self.model = model
        self.transfer = transfer if transfer is not None else Transfer(device)
        self.device = self.transfer.device
        self.cache = cache if cache is not None else EncoderCache(max_tokens=1 << 20)
        if max_tokens_per_step is not None and (
                not isinstance(max_tokens_per_step, int) or isinstance(max_tokens_per_step, bool)
                or max_tokens_per_step < 1):
            raise ArgumentError(f"must be a positive int, got {max_tokens_per_step!r}",
                                argument="max_tokens_per_step")
        self.max_tokens_per_step = max_tokens_per_step or self.cache.max_tokens
        self._precomputed = frozenset(model.precomputed_fields)
        if model_id is not None and (not isinstance(model_id, str) or not model_id):
            raise ArgumentError(f"must be a non-empty str, got {model_id!r}", argument="model_id")
        self.model_id = model_id if model_id is not None else f"{model.name}@{hash_model(model)[:32]}"
        self._lock = threading.RLock()
        self.last = RunStats()

    def cache_key(self, item: Item | str) -> str:
        """The key an item's embedding is cached under: this model's id and the item's hash
        (``item`` is the item or its hash)."""
        return f"{self.model_id}:{item if isinstance(item, str) else item.hash}"

    def release(self, request: Hashable) -> None:
        """The request is done: its cache entries may be evicted."""
        self.cache.release(request)

    def encode(self, items: Items | Sequence[Item], *,
               request: Hashable = None) -> list[torch.Tensor | None]:
        """One ``[tokens, hidden]`` tensor per item, in input order; ``None`` for an item that
        failed (see :attr:`last`: status ``"error"`` and the typed error in ``errors``).

        Every item is first vetted by ``model.check_item`` and counted by
        ``model.tokens_per_item``; an item that fails either, or that no step or cache can
        hold, fails alone. Cache hits skip everything; misses are de-duplicated by hash,
        batched in order within the step budget, transferred, encoded, cut into per-item rows
        by the host-known token counts, and cached under ``request`` (released with
        :meth:`release`). A batch whose encoder output breaks the contract is retried item by
        item, so the item at fault is found and its neighbours still encode.

        Each returned tensor is the caller's own copy: editing it in place (``e /= e.norm()``)
        changes neither the cache nor any other returned tensor, repeats within the call
        included. The cache keeps its own copy of each row. :attr:`last` holds this call's
        :class:`RunStats` (with concurrent callers, read it under your own coordination; calls
        themselves are serialised).
        """
        with self._lock:
            stats = RunStats()
            out = self._encode(items, request, stats)
            self.last = stats
            return out

    def _encode(self, items: Items | Sequence[Item], request: Hashable,
                stats: RunStats) -> list[torch.Tensor | None]:
        seq = items.in_order() if isinstance(items, Items) else list(items)
        stats.items = len(seq)
        stats.status = ["miss"] * len(seq)
        clock = time.perf_counter()

        def lap(stage: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            stats.add(stage, now - clock)
            clock = now

        def fail(positions: list[int], item: Item, error: MmferryError) -> None:
            for i in positions:
                stats.status[i] = "error"
                stats.errors[i] = _named(error, positions[0], item)

        out: list[torch.Tensor | None] = [None] * len(seq)
        todo: dict[str, list[int]] = {}  # key -> positions, first occurrence order
        tokens: dict[str, int] = {}
        failed: dict[str, list[int]] = {}
        for i, item in enumerate(seq):
            if not isinstance(item, Item):
                raise ArgumentError(f"item {i} is a {type(item).__name__}, not an Item",
                                    argument="items")
            try:
                key = self.cache_key(item)
            except MmferryError as e:  # an unhashable value
                fail([i], item, e)
                continue
            if key in failed:
                fail([i], item, stats.errors[failed[key][0]])
                continue
            if key in todo:
                todo[key].append(i)
                stats.status[i] = "repeat"
                continue
            hit = self.cache.get(key, request)
            if hit is not None:
                out[i] = hit.clone()
                stats.hits += 1
                stats.status[i] = "hit"
                continue
            try:
                tokens[key] = self._vet(item, key)
            except MmferryError as e:
                failed[key] = [i]
                fail([i], item, e)
                continue
            todo[key] = [i]
        lap("lookup")

        results: dict[str, torch.Tensor] = {}
        misses = [seq[positions[0]] for positions in todo.values()]
        for step in self._steps(misses, tokens):
            for batch_seq in _groups(step):
                bad = self._run(batch_seq, tokens, results, stats, lap)
                for item, error in bad:
                    key = self.cache_key(item)
                    fail(todo.pop(key), item, error)

        for key, positions in todo.items():
            value = results[key]
            self.cache.put(key, value, request)
            for i in positions:
                out[i] = value.clone()
        lap("cache")
        return out

    def _vet(self, item: Item, key: str) -> int:
        """The item's token count after the model's own checks and the budgets. A model that
        trips over a malformed item with a plain Python error (an item that reached a model
        whose check_item is not exhaustive) gets it reported as that item's ContractError."""
        try:
            self.model.check_item(item)
            n = self.model.tokens_per_item(item)
        except MmferryError:
            raise
        except _ITEM_ERRORS as e:
            raise ContractError(f"model {self.model.name} cannot read this item: "
                                f"{type(e).__name__}: {e}") from e
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ContractError(f"model {self.model.name} counted {n!r} tokens; expected a "
                                "non-negative int")
        self.cache.check_fits(key, n)
        if n > self.max_tokens_per_step:
            raise EncoderCacheError(
                f"{n} tokens, more than max_tokens_per_step={self.max_tokens_per_step}")
        return n

    def _run(self, items: list[Item], tokens: dict[str, int], results: dict[str, torch.Tensor],
             stats: RunStats, lap: Any) -> list[tuple[Item, MmferryError]]:
        """Encode one batch into ``results``; on a contract error, retry item by item and
        return the items that fail alone."""
        try:
            self._encode_batch(items, tokens, results, stats, lap)
            return []
        except MmferryError as e:
            if len(items) == 1:
                return [(items[0], e)]
        bad = []
        for item in items:
            try:
                self._encode_batch([item], tokens, results, stats, lap)
            except MmferryError as e:
                bad.append((item, e))
        return bad

    def _encode_batch(self, items: list[Item], tokens: dict[str, int],
                      results: dict[str, torch.Tensor], stats: RunStats, lap: Any) -> None:
        (batch,) = batch_items(items)
        lap("batch")
        device_batch = self.transfer.to_device(batch)
        lap("transfer")
        keys = [self.cache_key(it) for it in batch.items]
        counts = [tokens[k] for k in keys]
        # The one place precomputed embeddings bypass the encoder: the batch already holds
        # the output (each item was checked against its own metadata by check_item).
        embeds = next((name for name in batch.specs if name in self._precomputed), None)
        if embeds is not None:
            output = device_batch[embeds]
        else:
            with torch.inference_mode():
                output = self.model.encode(**device_batch)
            stats.encoder_calls += 1
        lap("encode")
        self._check(output, counts, batch.items)
        # Cut rows are views; a cache entry must not keep the whole batch output (or, for
        # precomputed embeddings, the transfer block or the caller's tensor) alive or shared.
        scatter_output_slices(output, keys, counts, results,
                              clone=embeds is not None or batch.num_items > 1)
        stats.encoded += batch.num_items
        lap("scatter")

    def _steps(self, misses: list[Item], tokens: dict[str, int]) -> list[list[Item]]:
        """Misses in order, cut into steps of at most ``max_tokens_per_step`` output rows (the
        one place the step budget is enforced; every item was checked to fit one step)."""
        steps: list[list[Item]] = []
        budget = 0
        for item in misses:
            n = tokens[self.cache_key(item)]
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


def _groups(step: list[Item]) -> list[list[Item]]:
    """The items of one step in encoder calls: :func:`batch_items`'s groups, each cut again
    where a flat field's items differ beyond the concatenated dimension, since reducing them
    would zero-pad one item's rows to another's width and the model would then see an item
    batched differently from alone. Items that cannot share a batch (mixed dtypes, an item
    without data) go one per call, where the item at fault fails alone."""
    if not step:
        return []
    try:
        batches = [list(b.items) for b in batch_items(step)]
    except MmferryError:
        return [[item] for item in step]
    groups = []
    for items in batches:
        group = [items[0]]
        for item in items[1:]:
            if _pads(group[0], item):
                groups.append(group)
                group = []
            group.append(item)
        groups.append(group)
    return groups


def _pads(first: Item, item: Item) -> bool:
    for name, spec in first.specs.items():
        a, b = first[name], item[name]
        if (spec.kind == "flat" and isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and not concatenable([a, b], spec.dim)):
            return True
    return False
