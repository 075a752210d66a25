"""Host-to-device transfer of a batch: host fields stay, device and both fields travel in
one coalesced, pinned, asynchronous copy.

Every device and both field of a batch is packed into one staging block (each tensor at an
aligned offset), the block is copied to the device with a single ``copy_(non_blocking=True)``
on the current stream, and each field becomes a view into the device block. Device fields are
reduced straight from the items into the staging block, so their bytes are copied once on
the host. A staging block goes back to the pool only after an event recorded behind its copy
has completed; the pool is bounded, and when every block is in flight the caller waits for
the oldest copy rather than allocating more pinned memory.

Without CUDA, ``device="cpu"`` runs the same packing and hands out views of the packed block
(no copy), and ``device="meta"`` gives meta tensors of the right shapes and dtypes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from mmferry.batching import Batch
from mmferry.errors import ArgumentError, ContractError
from mmferry.fields import (
    Placement,
    Reduction,
    plan_copy,
    plan_reduction,
    reduce_field,
    value_devices,
)

__all__ = [
    "DeviceBatch",
    "Mirrored",
    "StagingPool",
    "Transfer",
    "TransferStats",
    "host_and_device",
    "parse_device",
    "upload",
]

# Offsets of packed tensors are multiples of this: enough for any dtype's alignment and for
# vectorised device loads, and what the CUDA caching allocator itself guarantees.
ALIGNMENT = 256
_MIN_BLOCK = 1 << 16


@dataclass(frozen=True, slots=True)
class Mirrored:
    """A ``both``-placed field: the same value on the host and on the device."""

    host: Any
    device: Any


def host_and_device(value: Any) -> tuple[Any, Any]:
    """``(host, device)`` sides of a field a model needs in both places.

    A :class:`Mirrored` gives its two sides; any other value is given twice, so model code
    that does its host math on the first and its kernels on the second runs unchanged when
    the field is placed ``both`` (the right placement), ``host`` or ``device`` (which the
    placement audit then reports at the line that reads the wrong side).
    """
    if isinstance(value, Mirrored):
        return value.host, value.device
    return value, value


class Event(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


@dataclass(slots=True)
class TransferStats:
    """Counters of one :class:`Transfer`."""

    batches: int = 0
    copies: int = 0
    bytes: int = 0
    staging_blocks: int = 0
    staging_in_use: int = 0
    staging_bytes: int = 0
    waits: int = 0


@dataclass(slots=True)
class _Block:
    buffer: torch.Tensor
    event: Event | None = None

    def free(self) -> bool:
        return self.event is None or self.event.query()


class StagingPool:
    """A bounded pool of host staging blocks, each recycled only after its copy completed.

    ``acquire(nbytes)`` returns a block no other copy is reading: a completed one when there
    is one big enough, else a new one while the pool has room, else it waits for the oldest
    copy in flight. ``release(block, event)`` hands the block back with the event recorded
    behind the copy that reads it.
    """

    def __init__(self, max_blocks: int, *, pin_memory: bool, stats: TransferStats) -> None:
        if not isinstance(max_blocks, int) or isinstance(max_blocks, bool) or max_blocks < 1:
            raise ArgumentError(f"must be a positive int, got {max_blocks!r}",
                                argument="max_blocks")
        self.max_blocks = max_blocks
        self.pin_memory = pin_memory
        self.stats = stats
        self._blocks: list[_Block] = []  # released blocks, oldest release first
        self._out = 0  # acquired, not yet released

    def _new(self, nbytes: int) -> _Block:
        size = max(_MIN_BLOCK, 1 << (nbytes - 1).bit_length())
        buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)
        self.stats.staging_bytes += size
        return _Block(buffer)

    def acquire(self, nbytes: int) -> _Block:
        # Prefer, in order: a completed block big enough; a new block while there is room; a
        # completed block too small (replaced, no wait); only then wait for the oldest copy.
        for i, block in enumerate(self._blocks):
            if block.buffer.numel() >= nbytes and block.free():
                return self._take(i)
        if self.stats.staging_blocks < self.max_blocks:
            self.stats.staging_blocks += 1
            self._out += 1
            return self._new(nbytes)
        index = next((i for i, b in enumerate(self._blocks) if b.free()), None)
        if index is None:
            index = 0
            self.stats.waits += 1
            oldest = self._blocks[0]
            assert oldest.event is not None
            oldest.event.synchronize()
        block = self._take(index)
        if block.buffer.numel() < nbytes:
            self.stats.staging_bytes -= block.buffer.numel()
            block.buffer = torch.empty(0, dtype=torch.uint8)
            if self.pin_memory:
                # The outgrown block's copy has completed; without this PyTorch's caching
                # host allocator would keep it pinned for the life of the process.
                torch._C._host_emptyCache()
            block = self._new(nbytes)
        return block

    def _take(self, index: int) -> _Block:
        block = self._blocks.pop(index)
        block.event = None
        self._out += 1
        return block

    def release(self, block: _Block, event: Event | None) -> None:
        block.event = event
        self._out -= 1
        self._blocks.append(block)

    def in_use(self) -> int:
        """Blocks being packed or read by a copy that has not completed."""
        return self._out + sum(not b.free() for b in self._blocks)


class DeviceBatch(Mapping[str, Any]):
    """A batch where its contract says: host fields as they were, device fields as views into
    one device block, both fields as :class:`Mirrored`.

    The copy runs on the device's current stream at :meth:`Transfer.to_device` time, so an
    encoder on that stream reads the block in order and needs no wait. A consumer on another
    stream calls :meth:`wait` first. ``ready()`` tells whether the copy has completed;
    ``synchronize()`` blocks the host until it has.
    """

    __slots__ = ("_data", "block", "event", "modality", "nbytes", "num_items", "specs")

    def __init__(self, batch: Batch, data: dict[str, Any], event: Event | None, nbytes: int,
                 block: torch.Tensor | None = None) -> None:
        self.modality = batch.modality
        self.num_items = batch.num_items
        self.specs = batch.specs
        self._data = data
        self.event = event
        self.nbytes = nbytes
        self.block = block  # the device block every copied field is a view of

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def synchronize(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def wait(self, stream: Any = None) -> None:
        """Make ``stream`` (default: the device's current stream) wait for the copy, without
        blocking the host, and record the device block as in use by that stream, so the
        caching allocator does not hand the block to anyone else while that stream may still
        read it. Call it before reading the batch on a stream other than the copy's."""
        if self.event is None or self.block is None:
            return
        if stream is None:
            stream = torch.cuda.current_stream(self.block.device)
        stream.wait_event(self.event)
        self.block.record_stream(stream)

    def __repr__(self) -> str:
        return f"DeviceBatch({self.modality!r}, num_items={self.num_items}, fields={list(self)})"


def _views(block: torch.Tensor, offsets: list[int], plans: list[Reduction]) -> list[list[torch.Tensor]]:
    out, k = [], 0
    for plan in plans:
        views = []
        for shape, dtype in zip(plan.shapes, plan.dtypes, strict=True):
            nbytes = shape.numel() * dtype.itemsize
            views.append(block[offsets[k]:offsets[k] + nbytes].view(dtype).view(shape))
            k += 1
        out.append(views)
    return out


def _swap(value: Any, mapping: dict[int, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return mapping[id(value)]
    if isinstance(value, list):
        return [_swap(v, mapping) for v in value]
    return value


def parse_device(device: torch.device | str, *, argument: str = "device",
                 types: tuple[str, ...] = ("cuda", "cpu", "meta"),
                 simulated: bool = False) -> torch.device:
    """The one validation of a device argument (library, CLI, servers and audit alike).

    ``device`` must be a ``torch.device`` or a string torch parses, of one of ``types``. A
    real CUDA device must exist on this machine (its index below the device count; no
    index means the current device). ``simulated=True`` (the audit's device) accepts any
    accelerator type, none of which needs to exist, and no index means index 0.

    Raises:
        ArgumentError: naming ``argument``.
    """
    if not isinstance(device, torch.device | str) or isinstance(device, bool):
        raise ArgumentError(f"expected a device string such as 'cuda' or 'cpu', got "
                            f"{type(device).__name__}", argument=argument)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ArgumentError(f"not a device: {device!r} ({e})", argument=argument) from None
    if simulated:
        if dev.type in ("cpu", "meta"):
            raise ArgumentError(f"the simulated device must be an accelerator, got {dev.type!r}",
                                argument=argument)
        return torch.device(dev.type, 0 if dev.index is None else dev.index)
    if dev.type not in types:
        raise ArgumentError(f"unsupported device {device!r}; expected {', '.join(types)}",
                            argument=argument)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ArgumentError("CUDA is not available on this machine", argument=argument)
        if dev.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        if dev.index >= torch.cuda.device_count():
            raise ArgumentError(f"{dev} does not exist; this machine has "
                                f"{torch.cuda.device_count()} CUDA device(s)", argument=argument)
    return dev


class Transfer:
    """Moves batches to ``device`` with one coalesced copy each; see the module docstring.

    ``max_staging_blocks`` bounds the pinned memory held for copies in flight.
    """

    def __init__(self, device: torch.device | str, *, max_staging_blocks: int = 4) -> None:
        self.device = parse_device(device)
        if (not isinstance(max_staging_blocks, int) or isinstance(max_staging_blocks, bool)
                or max_staging_blocks < 1):
            raise ArgumentError(f"must be a positive int, got {max_staging_blocks!r}",
                                argument="max_staging_blocks")
        self._stats = TransferStats()
        self._copies = self.device.type == "cuda"
        self._pool = StagingPool(
            max_staging_blocks,
            pin_memory=self.device.type == "cuda",
            stats=self._stats,
        )

    @property
    def stats(self) -> TransferStats:
        """Counters: batches, copies, bytes copied, staging blocks (allocated, in use: being
        packed or read by an incomplete copy), staging bytes, and waits on a full pool."""
        self._stats.staging_in_use = self._pool.in_use()
        return self._stats

    def to_device(self, batch: Batch) -> DeviceBatch:
        """Place every field of ``batch`` where its spec says.

        Device fields whose item values already live on the target device are reduced there
        (no host round trip, no copy); host values travel in the one staging copy. Values on
        any other device, or a host or both field whose value is not on the host, are a
        :class:`~mmferry.errors.ContractError` naming the field.
        """
        # An encoder input never needs autograd through the packing, and `out=` reductions
        # refuse tensors that require grad.
        with torch.no_grad():
            return self._to_device(batch)

    def _to_device(self, batch: Batch) -> DeviceBatch:
        data: dict[str, Any] = {}
        names: list[str] = []
        plans: list[Reduction] = []
        hosts: dict[str, Any] = {}
        for name, spec in batch.specs.items():
            if spec.placement is Placement.DEVICE:
                values = batch.values(name)
                where = value_devices(values)
                if where == {self.device} and self.device.type != "cpu":
                    data[name] = reduce_field(name, spec, values)
                    continue
                self._check_host(name, where, "its item values")
                names.append(name)
                plans.append(plan_reduction(name, spec, values))
                continue
            value = batch.reduced(name)
            self._check_host(name, value_devices(value), f"a {spec.placement.value} field")
            if spec.placement is Placement.HOST:
                data[name] = value
            else:
                hosts[name] = value
                names.append(name)
                plans.append(plan_copy(value))

        offsets, total = [], 0
        for plan in plans:
            for shape, dtype in zip(plan.shapes, plan.dtypes, strict=True):
                offsets.append(total)
                total += -(-shape.numel() * dtype.itemsize // ALIGNMENT) * ALIGNMENT

        self._stats.batches += 1
        if self.device.type == "cpu":
            # The packed block is the "device" block: nothing to copy, nothing to recycle.
            block = torch.empty(total, dtype=torch.uint8)
            for name, plan, views in zip(names, plans, _views(block, offsets, plans), strict=True):
                value = plan.fill(views)
                data[name] = Mirrored(hosts[name], value) if name in hosts else value
            return DeviceBatch(batch, data, None, total)

        # Everything CUDA, the first pinned allocation included, happens with the destination
        # device current, so no context is created on another GPU.
        with torch.cuda.device(self.device) if self._copies else nullcontext():
            staging = self._pool.acquire(total)
            event: Event | None = None
            try:
                host_views = _views(staging.buffer, offsets, plans)
                packed = [plan.fill(views) for plan, views in zip(plans, host_views, strict=True)]
                # The copy and its event go on the destination device's current stream, which
                # is also where the encoder will read the block.
                device_block = torch.empty(total, dtype=torch.uint8, device=self.device)
                if total:
                    device_block.copy_(staging.buffer[:total], non_blocking=True)
                    self._stats.copies += 1
                    self._stats.bytes += total
                if self._copies:
                    # A blocking-sync event: a full pool waiting on it yields the CPU
                    # instead of spinning.
                    event = torch.cuda.Event(blocking=True)
                    event.record(torch.cuda.current_stream(self.device))
            finally:
                self._pool.release(staging, event)
        device_views = _views(device_block, offsets, plans)
        for name, value, hviews, dviews in zip(names, packed, host_views, device_views, strict=True):
            moved = _swap(value, {id(h): d for h, d in zip(hviews, dviews, strict=True)})
            data[name] = Mirrored(hosts[name], moved) if name in hosts else moved
        return DeviceBatch(batch, data, event, total, device_block)

    def _check_host(self, name: str, where: set[torch.device], what: str) -> None:
        off_host = sorted(str(d) for d in where if d.type != "cpu")
        if off_host:
            raise ContractError(
                f"{what} on {', '.join(off_host)}: the transfer to {self.device} takes host "
                "values (or device values already on its own device, for device fields)",
                field=name)


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (
        b.index if b.index is not None else current)


def upload(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Copy a small tensor (model-derived metadata: ``cu_seqlens``, position ids) to
    ``device`` without blocking the host.

    A host tensor is copied once into pinned, dense memory (from PyTorch's caching host
    allocator, which keeps it until the copy has completed; a non-dense source would make the
    driver stage it through pageable memory and block), then copied with ``non_blocking``. A
    tensor already on ``device`` (``cuda`` and ``cuda:N`` for the current N are the same) is
    returned as it is; one on another device is copied device to device."""
    device = torch.device(device)
    if _same_device(t.device, device):
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        t = pinned.copy_(t)
    return t.to(device, non_blocking=True)
