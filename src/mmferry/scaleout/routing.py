"""Which encoder replica should take a request: rendezvous hashing on an item hash.

Rendezvous (highest-random-weight) hashing gives every (key, replica) pair a pseudo-random
weight and ranks the replicas by it. While the replica set is unchanged a key always gets
the same first choice; removing a replica moves only the keys it ranked first (each to its
own second choice), and adding one takes from every other replica about an equal share.
No ring, no virtual nodes, no state: the ranking is a pure function of its arguments.

The encoder cache only pays when a repeated item reaches the replica that holds it, so the
key is the hash of the request's largest item (most tokens: the costliest to encode again).
Affinity yields to load when the preferred replica's queue is longer than the shortest by
more than ``imbalance_threshold`` requests: then the least loaded replicas come first.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

__all__ = ["rank_replicas", "weight"]


def weight(key: str, replica: str) -> int:
    """The rendezvous weight of ``replica`` for ``key``: 64 bits of a keyed hash."""
    digest = hashlib.blake2b(f"{key}\0{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def rank_replicas(key: str, replicas: Sequence[str], loads: Mapping[str, int] | None = None, *,
                  imbalance_threshold: int = 8, fallbacks: int = 2) -> list[str]:
    """The replicas to try for ``key``, most preferred first: the rendezvous order, or, when
    the first choice's load exceeds the lightest replica's by more than
    ``imbalance_threshold``, every replica by load (ties in rendezvous order). At most
    ``1 + fallbacks`` replicas; ``loads`` maps a replica to its outstanding requests
    (missing: 0)."""
    order = sorted(replicas, key=lambda r: (weight(key, r), r), reverse=True)
    if loads and order:
        load = [loads.get(r, 0) for r in order]
        if load[0] - min(load) > imbalance_threshold:
            order = [r for _, _, r in sorted(zip(load, range(len(order)), order, strict=True))]
    return order[:1 + fallbacks]
