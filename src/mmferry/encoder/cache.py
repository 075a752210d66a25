"""The encoder cache: per-item encoder outputs keyed by item hash, sized in tokens.

Entries are reference-counted per request; an entry no request references stays cached
("freeable") until space is needed, then the least recently used freeable entries go first.
"""

from __future__ import annotations

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
        if max_tokens < 1:
            raise EncoderCacheError(f"max_tokens must be positive, got {max_tokens}")
        self.max_tokens = max_tokens
        self.stats = CacheStats()
        self._entries: dict[str, torch.Tensor] = {}
        self._refs: dict[str, set[Hashable]] = {}  # entry -> requests referencing it
        self._held: dict[Hashable, set[str]] = {}  # request -> entries it references
        self._freeable: OrderedDict[str, None] = OrderedDict()  # unreferenced, least recent first
        self._last_use: dict[str, int] = {}
        self._clock = 0

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str, request: Hashable | None = None) -> torch.Tensor | None:
        """The cached output, or None; counts a hit or a miss and, with ``request``, references it."""
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
                f"item {key[:16]} has {tokens} tokens, more than the cache's {self.max_tokens}"
            )

    def put(self, key: str, value: torch.Tensor, request: Hashable | None = None) -> bool:
        """Store ``value``; evict freeable entries as needed. False when referenced entries
        leave no room (the caller still has the value; it just is not cached)."""
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
        self._refs[key].add(request)
        self._held.setdefault(request, set()).add(key)
        self._freeable.pop(key, None)

    def release(self, request: Hashable) -> None:
        """Drop every reference ``request`` holds; entries no request references any more
        become freeable, after those already freeable, least recently used first."""
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

    def clear(self) -> None:
        for key in list(self._entries):
            self._evict(key)
