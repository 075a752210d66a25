"""Host-to-device transfer of a batch: host fields stay, device and both fields travel in
one coalesced, pinned, asynchronous copy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Mirrored"]


@dataclass(frozen=True, slots=True)
class Mirrored:
    """A ``both``-placed field: the same value on the host and on the device."""

    host: Any
    device: Any
