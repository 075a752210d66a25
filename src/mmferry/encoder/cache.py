"""The encoder cache: per-item encoder outputs keyed by item hash, sized in tokens.

Entries are reference-counted per request; an entry no request references stays cached
("freeable") until space is needed, then the least recently used freeable entries go first.

Thread safety: every public method holds the cache's lock for its whole bookkeeping (the
entry table, references, recency and stats change together), so one cache may be shared by
threads, e.g. several runners or server handlers. The tensors it returns are shared with the
cache: :class:`~mmferry.encoder.runner.EncoderRunner` hands callers copies.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from mmferry.errors import EncoderCacheError

__all__ = ["CacheStats", "EncoderCache", "EncoderCacheError"]


@dataclass(slots=True)
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    tokens: int = 0
    bytes: int = 0
    entries: int = 0


class EncoderCache:
    """Encoder outputs (``[tokens, hidden]`` tensors) by item hash, at most ``max_tokens`` rows."""

    def __init__(self, max_tokens: int) -> None:
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise EncoderCacheError(f"max_tokens must be a positive int, got {max_tokens!r}")
        self.max_tokens = max_tokens
        self.stats = CacheStats()
        self._entries: dict[str, torch.Tensor] = {}
        self._refs: dict[str, set[Hashable]] = {}  # entry -> requests referencing it
        self._held: dict[Hashable, set[str]] = {}  # request -> entries it references
        self._freeable: OrderedDict[str, None] = OrderedDict()  # unreferenced, least recent first
        self._last_use: dict[str, int] = {}
        self._clock = 0
        self._lock = threading.RLock()

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def get(self, key: str, request: Hashable | None = None) -> torch.Tensor | None:
        """The cached output, or None; counts a hit or a miss and, with ``request``, references it."""
        with self._lock:
            value = self._entries.get(key)
            if value is None:
                self.stats.misses += 1
                return None
            self.stats.hits += 1
            self._touch(key)
            if request is not None:
                self.reference(key, request)
            elif key in self._freeable:
                self._freeable.move_to_end(key)
            return value

    def check_fits(self, key: str, tokens: int) -> None:
        if tokens > self.max_tokens:
            raise EncoderCacheError(
                f"item {str(key)[:16]} has {tokens} tokens, more than the cache's "
                f"{self.max_tokens}"
            )

    def put(self, key: str, value: torch.Tensor, request: Hashable | None = None) -> bool:
        """Store ``value``; evict freeable entries as needed. False when referenced entries
        leave no room (the caller still has the value; it just is not cached)."""
        if not isinstance(key, str):
            raise EncoderCacheError(f"cache keys are str, got {type(key).__name__}")
        if not isinstance(value, torch.Tensor) or value.ndim != 2:
            raise EncoderCacheError(f"cache values are [tokens, hidden] tensors, got "
                                    f"{getattr(value, 'shape', type(value).__name__)}")
        with self._lock:
            tokens = value.shape[0]
            self.check_fits(key, tokens)
            if key in self._entries:
                if request is not None:
                    self.reference(key, request)
                return True
            while self.stats.tokens + tokens > self.max_tokens and self._freeable:
                self._evict(next(iter(self._freeable)))
            if self.stats.tokens + tokens > self.max_tokens:
                return False
            self._entries[key] = value
            self._refs[key] = set()
            self._touch(key)
            self.stats.tokens += tokens
            self.stats.bytes += value.nbytes
            self.stats.entries += 1
            if request is not None:
                self.reference(key, request)
            else:
                self._freeable[key] = None
            return True

    def _touch(self, key: str) -> None:
        self._clock += 1
        self._last_use[key] = self._clock

    def reference(self, key: str, request: Hashable) -> None:
        """``request`` holds ``key`` (not evictable until released).

        Raises:
            EncoderCacheError: ``key`` is not cached.
        """
        with self._lock:
            refs = self._refs.get(key)
            if refs is None:
                raise EncoderCacheError(f"no cache entry {str(key)[:40]!r} to reference")
            refs.add(request)
            self._held.setdefault(request, set()).add(key)
            self._freeable.pop(key, None)

    def release(self, request: Hashable) -> None:
        """Drop every reference ``request`` holds; entries no request references any more
        become freeable, after those already freeable, least recently used first."""
        with self._lock:
            freed = []
            for key in self._held.pop(request, ()):
                refs = self._refs.get(key)
                if refs is not None:
                    refs.discard(request)
                    if not refs:
                        freed.append(key)
            for key in sorted(freed, key=self._last_use.__getitem__):
                self._freeable[key] = None

    def _evict(self, key: str) -> None:
        value = self._entries.pop(key)
        for request in self._refs.pop(key):
            self._held[request].discard(key)
        del self._last_use[key]
        self._freeable.pop(key, None)
        self.stats.tokens -= value.shape[0]
        self.stats.bytes -= value.nbytes
        self.stats.entries -= 1
        self.stats.evictions += 1

    def check_consistency(self) -> None:
        """Raise :class:`EncoderCacheError` if the bookkeeping disagrees with itself (stats
        against entries, references in both directions, freeable entries unreferenced, the
        capacity kept). For tests and debugging; O(entries)."""
        with self._lock:
            problems = []
            tokens = sum(v.shape[0] for v in self._entries.values())
            nbytes = sum(v.nbytes for v in self._entries.values())
            if (self.stats.tokens, self.stats.bytes, self.stats.entries) != (
                    tokens, nbytes, len(self._entries)):
                problems.append(f"stats {self.stats} disagree with entries ({tokens} tokens, "
                                f"{nbytes} bytes, {len(self._entries)} entries)")
            if tokens > self.max_tokens:
                problems.append(f"{tokens} tokens exceed max_tokens {self.max_tokens}")
            if self._refs.keys() != self._entries.keys() or self._last_use.keys() != (
                    self._entries.keys()):
                problems.append("reference or recency tables name other keys than the entries")
            for key, requests in self._refs.items():
                if any(key not in self._held.get(r, ()) for r in requests):
                    problems.append(f"entry {key[:16]} is referenced by a request not holding it")
                if requests and key in self._freeable:
                    problems.append(f"entry {key[:16]} is referenced yet freeable")
            for request, keys in self._held.items():
                if any(request not in self._refs.get(k, ()) for k in keys):
                    problems.append(f"request {request!r} holds an entry that does not list it")
            if any(k not in self._entries for k in self._freeable):
                problems.append("a freeable key is not cached")
            if problems:
                raise EncoderCacheError("; ".join(problems[:3]))

    def clear(self) -> None:
        with self._lock:
            for key in list(self._entries):
                self._evict(key)
