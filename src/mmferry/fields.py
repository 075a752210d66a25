"""The field contract: how each processor output splits into items, reduces into a batch,
and where it lives (host, device or both).

A :class:`FieldSpec` is plain, immutable data: comparable, hashable, and serialisable with
:meth:`FieldSpec.to_dict`. Split and reduce follow vLLM's ``MultiModalFieldConfig`` semantics
(batched / flat / flat_from_sizes / shared) so field configs port by search-and-replace, with
``keep_on_cpu=True`` meaning ``placement="host"``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

import torch

from mmferry.errors import ContractError

__all__ = [
    "FieldSpec",
    "Normalize",
    "Placement",
    "Reduction",
    "check_batch_values",
    "concatenable",
    "plan_copy",
    "plan_reduction",
    "reduce_field",
    "split_field",
    "value_devices",
]


class Placement(str, Enum):
    """Where a field must be when the encoder runs."""

    DEVICE = "device"
    HOST = "host"
    BOTH = "both"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: Placement | str) -> Placement:
        try:
            return cls(value)
        except (ValueError, TypeError):
            raise ContractError(
                f"unknown placement {value!r}; expected one of 'device', 'host', 'both'"
            ) from None


KINDS = ("batched", "flat", "shared")
_SPEC_KEYS = frozenset({"kind", "modality", "placement", "dim", "slices", "sizes", "batch_size",
                        "normalize"})
MAX_CHANNELS = 16

# One dimension of an item's slice: (start, stop, step), None meaning "open" as in `slice`.
Bounds = tuple[int | None, int | None, int | None]


def _placement(placement: Placement | str, keep_on_cpu: bool | None) -> Placement:
    p = Placement.parse(placement)
    if keep_on_cpu is None:
        return p
    if keep_on_cpu and p is Placement.DEVICE:
        return Placement.HOST
    if not keep_on_cpu and p is Placement.HOST:
        raise ContractError("keep_on_cpu=False contradicts placement='host'")
    if keep_on_cpu and p is Placement.BOTH:
        raise ContractError("keep_on_cpu=True contradicts placement='both'")
    return p


def _bounds(s: slice) -> Bounds:
    for part in (s.start, s.stop, s.step):
        if part is not None and not isinstance(part, int):
            # 0-d tensors from a sizes cumsum are accepted; anything else is not a bound.
            if isinstance(part, torch.Tensor) and part.numel() == 1:
                continue
            raise ContractError(f"slice bounds must be ints, got {s!r}")
    return tuple(None if p is None else int(p) for p in (s.start, s.stop, s.step))  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class Normalize:
    """What the uint8 levels of a pixel field stand for: level ``x`` of channel ``c`` is the
    model input ``(x * scale - mean[c]) / std[c]``.

    A field's spec carries it (``FieldSpec.normalize``) so the normalisation is part of the
    contract: it is hashed with the item, travels on the wire, keeps items of different
    normalisations out of one batch, and lets an encoder refuse pixels meant for another
    normalisation. Encoders fold it into their first layer instead of running it as a pass.
    Which input column is which channel is the model's layout, not the spec's.
    """

    mean: tuple[float, ...]
    std: tuple[float, ...]
    scale: float = 1 / 255

    def __post_init__(self) -> None:
        for name in ("mean", "std"):
            values = getattr(self, name)
            if isinstance(values, str | bytes) or not isinstance(values, Sequence):
                raise ContractError(f"normalize {name} must be a sequence of floats, got {values!r}")
            object.__setattr__(self, name, tuple(_finite(f"normalize {name}", v) for v in values))
        if not 1 <= len(self.mean) <= MAX_CHANNELS or len(self.std) != len(self.mean):
            raise ContractError(f"normalize mean and std need the same 1 to {MAX_CHANNELS} channels, "
                                f"got {len(self.mean)} and {len(self.std)}")
        if any(s == 0 for s in self.std):
            raise ContractError(f"normalize std must not hold 0, got {list(self.std)}")
        object.__setattr__(self, "scale", _finite("normalize scale", self.scale))
        if self.scale <= 0:
            raise ContractError(f"normalize scale must be positive, got {self.scale!r}")

    @property
    def channels(self) -> int:
        return len(self.mean)

    def affine(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel ``(a, b)`` in float64 with ``input = a * level + b``."""
        std = torch.tensor(self.std, dtype=torch.float64)
        return self.scale / std, -torch.tensor(self.mean, dtype=torch.float64) / std

    def to_dict(self) -> dict[str, Any]:
        return {"mean": list(self.mean), "std": list(self.std), "scale": self.scale}

    @classmethod
    def from_dict(cls, d: Any) -> Normalize:
        if not isinstance(d, Mapping) or set(map(str, d)) - {"mean", "std", "scale"} or not (
                "mean" in d and "std" in d):
            raise ContractError(f"normalize is a mapping of mean, std and scale, got {d!r}")
        return cls(d["mean"], d["std"], d.get("scale", 1 / 255))


def _finite(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ContractError(f"{name} must hold finite numbers, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """How one processor output field splits per item, reduces per batch, and where it lives.

    Build with :meth:`batched`, :meth:`flat`, :meth:`flat_from_sizes` or :meth:`shared`.
    ``slices`` / ``sizes`` / ``batch_size`` describe the split of one processor call; after the
    split each item carries :meth:`for_item`, which drops them, so an item's spec depends only
    on the field's kind and never on the item's position in its request. ``dim`` counts from
    the front (vLLM also accepts a negative ``dim``, but only its merge honours it: its split
    would cut along dim 0). ``normalize`` marks a uint8 pixel field and says what its levels
    stand for (:class:`Normalize`); every constructor takes it as a keyword.
    """

    kind: str
    modality: str
    placement: Placement = Placement.DEVICE
    dim: int = 0
    slices: tuple[tuple[Bounds, ...], ...] | None = None
    sizes: tuple[int, ...] | None = None
    batch_size: int | None = None
    normalize: Normalize | None = None
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ContractError(f"unknown field kind {self.kind!r}; expected one of {KINDS}")
        if not isinstance(self.modality, str) or not self.modality:
            raise ContractError(f"modality must be a non-empty string, got {self.modality!r}")
        object.__setattr__(self, "placement", Placement.parse(self.placement))
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 0:
            raise ContractError(f"dim must be a non-negative int, got {self.dim!r}")
        if self.kind != "flat" and (self.slices is not None or self.sizes is not None or self.dim):
            raise ContractError(f"{self.kind} fields take no slices, sizes or dim")
        if self.kind != "shared" and self.batch_size is not None:
            raise ContractError(f"{self.kind} fields take no batch_size")
        if self.slices is not None and self.sizes is not None:
            raise ContractError("a flat field takes slices or sizes, not both")
        if self.sizes is not None and not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in self.sizes
        ):
            raise ContractError(f"sizes must be non-negative ints, got {list(self.sizes)}")
        if self.slices is not None and not all(
            isinstance(s, tuple) and len(s) > self.dim and all(
                isinstance(b, tuple) and len(b) == 3
                and all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in b)
                for b in s)
            for s in self.slices
        ):
            raise ContractError(
                f"slices must be per-item tuples of (start, stop, step) covering dim {self.dim}"
            )
        if self.batch_size is not None and (
            not isinstance(self.batch_size, int) or isinstance(self.batch_size, bool)
            or self.batch_size < 0
        ):
            raise ContractError(f"batch_size must be a non-negative int, got {self.batch_size!r}")
        if self.normalize is not None and not isinstance(self.normalize, Normalize):
            raise ContractError(f"normalize must be a Normalize, got {type(self.normalize).__name__}")
        object.__setattr__(
            self,
            "_hash",
            hash((self.kind, self.modality, self.placement.value, self.dim, self.slices,
                  self.sizes, self.batch_size, self.normalize)),
        )

    def __hash__(self) -> int:
        return self._hash

    # -- constructors -------------------------------------------------------------------

    @classmethod
    def batched(
        cls, modality: str, *, placement: Placement | str = "device", keep_on_cpu: bool | None = None,
        normalize: Normalize | None = None,
    ) -> FieldSpec:
        """Item i is ``data[i]``; a batch stacks items (a list when their shapes differ)."""
        return cls("batched", modality, _placement(placement, keep_on_cpu), normalize=normalize)

    @classmethod
    def flat(
        cls,
        modality: str,
        slices: Sequence[slice | tuple[slice, ...]],
        *,
        dim: int = 0,
        placement: Placement | str = "device",
        keep_on_cpu: bool | None = None,
        normalize: Normalize | None = None,
    ) -> FieldSpec:
        """Item i is ``data[slices[i]]``; a batch concatenates items along ``dim``.

        Each entry is a ``slice`` along ``dim`` or a tuple of slices, one per dimension.
        """
        if isinstance(slices, slice | tuple) and not (
            isinstance(slices, tuple) and all(isinstance(s, slice | tuple) for s in slices)
        ):
            raise ContractError("slices must be a sequence with one slice per item")
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
            raise ContractError(f"dim must be a non-negative int, got {dim!r}")
        prefix: tuple[Bounds, ...] = ((None, None, None),) * dim
        items: list[tuple[Bounds, ...]] = []
        for s in slices:
            if isinstance(s, slice):
                items.append((*prefix, _bounds(s)))
            elif isinstance(s, tuple) and all(isinstance(p, slice) for p in s):
                if len(s) <= dim:
                    raise ContractError(
                        f"a slice tuple of {len(s)} dimensions cannot cut along dim {dim}"
                    )
                items.append(tuple(_bounds(p) for p in s))
            else:
                raise ContractError(f"each item's slice must be a slice or a tuple of slices, got {s!r}")
        return cls("flat", modality, _placement(placement, keep_on_cpu), dim, slices=tuple(items),
                   normalize=normalize)

    @classmethod
    def flat_from_sizes(
        cls,
        modality: str,
        sizes: torch.Tensor | Sequence[int],
        *,
        dim: int = 0,
        placement: Placement | str = "device",
        keep_on_cpu: bool | None = None,
        normalize: Normalize | None = None,
    ) -> FieldSpec:
        """Item i is the i-th run of ``sizes[i]`` entries along ``dim``; the sizes must sum to it."""
        if isinstance(sizes, torch.Tensor):
            if sizes.ndim != 1:
                raise ContractError(f"sizes must be a 1-D tensor, got shape {tuple(sizes.shape)}")
            if sizes.is_floating_point() or sizes.is_complex():
                raise ContractError(f"sizes must be integers, got {sizes.dtype}")
            values = tuple(int(v) for v in sizes.tolist())
        else:
            try:
                values = tuple(sizes)
            except TypeError:
                raise ContractError(f"sizes must be a 1-D sequence of ints, got {sizes!r}") from None
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                raise ContractError(f"sizes must be a 1-D sequence of ints, got {sizes!r}")
        if any(v < 0 for v in values):
            raise ContractError(f"sizes must be non-negative, got {list(values)}")
        return cls("flat", modality, _placement(placement, keep_on_cpu), dim, sizes=values,
                   normalize=normalize)

    @classmethod
    def shared(
        cls,
        modality: str,
        batch_size: int,
        *,
        placement: Placement | str = "device",
        keep_on_cpu: bool | None = None,
        normalize: Normalize | None = None,
    ) -> FieldSpec:
        """Every one of ``batch_size`` items gets the same data; batches never mix values."""
        return cls("shared", modality, _placement(placement, keep_on_cpu), batch_size=batch_size,
                   normalize=normalize)

    # -- derived ---------------------------------------------------------------------

    @property
    def num_items(self) -> int | None:
        """Items this spec splits its field into, when the spec itself says (flat, shared)."""
        if self.slices is not None:
            return len(self.slices)
        if self.sizes is not None:
            return len(self.sizes)
        return self.batch_size

    def item_slices(self) -> tuple[tuple[slice, ...], ...]:
        """Per-item index tuples for a flat field (sizes turned into running offsets)."""
        if self.slices is not None:
            return tuple(tuple(slice(*b) for b in s) for s in self.slices)
        if self.sizes is None:
            raise ContractError(f"a {self.kind} field has no slices")
        prefix = (slice(None),) * self.dim
        out, start = [], 0
        for n in self.sizes:
            out.append((*prefix, slice(start, start + n)))
            start += n
        return tuple(out)

    def for_item(self) -> FieldSpec:
        """The spec as one split item carries it: kind, modality, placement, dim and
        normalisation only."""
        if self.slices is None and self.sizes is None and self.batch_size is None:
            return self
        return replace(self, slices=None, sizes=None, batch_size=None)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (str, int, lists) that :meth:`from_dict` turns back into an equal spec."""
        d: dict[str, Any] = {"kind": self.kind, "modality": self.modality,
                             "placement": self.placement.value}
        if self.dim:
            d["dim"] = self.dim
        if self.slices is not None:
            d["slices"] = [[list(b) for b in s] for s in self.slices]
        if self.sizes is not None:
            d["sizes"] = list(self.sizes)
        if self.batch_size is not None:
            d["batch_size"] = self.batch_size
        if self.normalize is not None:
            d["normalize"] = self.normalize.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FieldSpec:
        """The spec :meth:`to_dict` described.

        Raises:
            ContractError: not a mapping, a missing ``kind`` / ``modality``, an unknown key,
                or a value the constructor refuses.
        """
        if not isinstance(d, Mapping):
            raise ContractError(f"a field spec is a mapping, got {type(d).__name__}")
        missing = [k for k in ("kind", "modality") if k not in d]
        if missing:
            raise ContractError(f"a field spec needs {' and '.join(missing)}; got keys "
                                f"{sorted(map(str, d))}")
        unknown = sorted(set(map(str, d)) - _SPEC_KEYS)
        if unknown:
            raise ContractError(f"unknown field spec key(s) {unknown}; expected "
                                f"{sorted(_SPEC_KEYS)}")
        slices = d.get("slices")
        sizes = d.get("sizes")
        try:
            slices = None if slices is None else tuple(tuple(tuple(b) for b in s) for s in slices)
            sizes = None if sizes is None else tuple(sizes)
        except TypeError:
            raise ContractError(f"slices / sizes must be lists, got {d.get('slices')!r} / "
                                f"{d.get('sizes')!r}") from None
        return cls(
            d["kind"],
            d["modality"],
            d.get("placement", "device"),
            d.get("dim", 0),
            slices=slices,
            sizes=sizes,
            batch_size=d.get("batch_size"),
            normalize=None if d.get("normalize") is None else Normalize.from_dict(d["normalize"]),
        )


# -- split ---------------------------------------------------------------------------


def split_field(name: str, spec: FieldSpec, data: Any) -> list[Any]:
    """Split one processor output field into per-item values (views where possible)."""
    if spec.kind == "batched":
        if isinstance(data, torch.Tensor):
            if data.ndim == 0:
                raise ContractError("a batched field needs at least one dimension", field=name)
            return list(data.unbind(0))
        if isinstance(data, list | tuple):
            return list(data)
        raise ContractError(f"expected a tensor or a list, got {type(data).__name__}", field=name)
    if spec.kind == "shared":
        if spec.batch_size is None:
            raise ContractError("a shared field needs batch_size", field=name)
        return [data] * spec.batch_size
    return _split_flat(name, spec, data)


def _split_flat(name: str, spec: FieldSpec, data: Any) -> list[Any]:
    if isinstance(data, list | tuple):
        if spec.dim != 0:
            raise ContractError("a flat field over a list must have dim=0", field=name)
        length = len(data)
        out = []
        for i, idx in enumerate(spec.item_slices()):
            if len(idx) != 1:
                raise ContractError(f"item {i}: a list can only be sliced along one dimension",
                                    field=name)
            _check_bounds(name, i, 0, idx[0], length)
            out.append(list(data[idx[0]]))
        _check_cover(name, spec, length)
        return out
    if not isinstance(data, torch.Tensor):
        raise ContractError(f"expected a tensor or a list, got {type(data).__name__}", field=name)
    if spec.dim >= max(data.ndim, 1) or data.ndim == 0:
        raise ContractError(
            f"dim {spec.dim} is out of range for a tensor of shape {tuple(data.shape)}", field=name
        )
    if spec.sizes is not None:
        # Runs of sizes tile the dimension: one C call makes every item's view.
        _check_cover(name, spec, data.shape[spec.dim])
        return list(data.split(spec.sizes, dim=spec.dim))
    out = []
    for i, idx in enumerate(spec.item_slices()):
        if len(idx) > data.ndim:
            raise ContractError(
                f"item {i}: slice over {len(idx)} dimensions of a {data.ndim}-D tensor", field=name
            )
        for d, s in enumerate(idx):
            _check_bounds(name, i, d, s, data.shape[d])
        out.append(data[idx])
    _check_cover(name, spec, data.shape[spec.dim])
    return out


def _check_bounds(name: str, item: int, dim: int, s: slice, length: int) -> None:
    if s.step is not None and s.step <= 0:
        raise ContractError(f"item {item}: slice step must be positive, got {s.step}", field=name)
    for bound in (s.start, s.stop):
        if bound is not None and not 0 <= bound <= length:
            raise ContractError(
                f"item {item}: slice {s.start}:{s.stop} is outside dimension {dim} of size {length}",
                field=name,
            )


def _check_cover(name: str, spec: FieldSpec, length: int) -> None:
    if spec.sizes is not None and sum(spec.sizes) != length:
        raise ContractError(
            f"sizes sum to {sum(spec.sizes)} but dimension {spec.dim} has {length} entries",
            field=name,
        )


# -- reduce --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Reduction:
    """A field's reduced batch value, described before any byte moves.

    ``shapes[i]`` / ``dtypes[i]`` describe the i-th output tensor the reduction writes;
    ``fill(outs)`` writes the items' values into ``outs`` (tensors of those shapes and
    dtypes, anywhere: fresh host memory or views into a staging block) and returns the
    reduced value built on them. A reduction without tensors has no shapes and ``fill([])``
    returns the plain value.
    """

    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]
    fill: Callable[[Sequence[torch.Tensor]], Any]


def _tensor_leaves(value: Any, out: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, list | tuple):
        for v in value:
            _tensor_leaves(v, out)


def _rebuild(value: Any, outs: Sequence[torch.Tensor], pos: list[int]) -> Any:
    if isinstance(value, torch.Tensor):
        t = outs[pos[0]]
        pos[0] += 1
        return t.copy_(value)
    if isinstance(value, list | tuple):
        return [_rebuild(v, outs, pos) for v in value]
    return value


def plan_copy(value: Any) -> Reduction:
    """Reduction that keeps ``value``'s structure (a tensor, a nested list, a plain value):
    one output per tensor leaf, the structure rebuilt around them."""
    leaves: list[torch.Tensor] = []
    _tensor_leaves(value, leaves)
    return Reduction(
        tuple(t.shape for t in leaves),
        tuple(t.dtype for t in leaves),
        lambda outs: _rebuild(value, outs, [0]),
    )


def check_batch_values(name: str, values: Sequence[Any]) -> torch.dtype | None:
    """The one check of a field's per-item values before they share a batch: no item without
    data (``None``), and one dtype across the tensor values. Returns that dtype (``None``
    without tensors). Batching calls it when it forms a batch, reductions when they run."""
    dtype = None
    first = 0
    for i, v in enumerate(values):
        if v is None:
            raise ContractError(f"item {i} of the batch has no data (None) and cannot be "
                                "batched; fill cached items first", field=name)
        if isinstance(v, torch.Tensor):
            if dtype is None:
                dtype, first = v.dtype, i
            elif v.dtype != dtype:
                raise ContractError(f"mixed dtypes in one batch: item {first} is {dtype}, "
                                    f"item {i} is {v.dtype}", field=name)
    return dtype


def _common_dtype(name: str, values: Sequence[torch.Tensor]) -> torch.dtype:
    return check_batch_values(name, values) or values[0].dtype


def concatenable(values: Sequence[torch.Tensor], dim: int) -> bool:
    """Same rank, ``dim`` in range, and every dimension but ``dim`` equal: a plain concat."""
    shape = values[0].shape
    return dim < len(shape) and all(
        v.ndim == len(shape) and v.shape[:dim] == shape[:dim] and v.shape[dim + 1:] == shape[dim + 1:]
        for v in values
    )


def plan_reduction(name: str, spec: FieldSpec, values: Sequence[Any]) -> Reduction:
    """Describe how ``values`` (one per item, in order) reduce into the batch value."""
    check_batch_values(name, values)
    if spec.kind == "shared":
        return plan_copy(values[0]) if values else plan_copy([])
    tensors = all(isinstance(v, torch.Tensor) for v in values)
    if not values or not tensors:
        if spec.kind == "flat" and values:
            if spec.dim != 0:
                raise ContractError("a flat field over lists must have dim=0", field=name)
            flat: list[Any] = []
            for v in values:
                flat.extend(v) if isinstance(v, list | tuple) else flat.append(v)
            return plan_copy(flat)
        return plan_copy(list(values))
    dtype = _common_dtype(name, values)
    shape0 = values[0].shape
    if spec.kind == "batched":
        if all(v.shape == shape0 for v in values):
            out_shape = torch.Size((len(values), *shape0))
            return Reduction((out_shape,), (dtype,),
                             lambda outs: torch.stack(list(values), out=outs[0]))
        return plan_copy(list(values))
    # flat
    dim = spec.dim
    ndim = values[0].ndim
    if any(v.ndim != ndim for v in values):
        raise ContractError(
            f"items have different ranks: {sorted({v.ndim for v in values})}", field=name
        )
    if dim >= ndim:
        raise ContractError(f"dim {dim} is out of range for {ndim}-D items", field=name)
    total = sum(v.shape[dim] for v in values)
    if concatenable(values, dim):
        out_shape = torch.Size((*shape0[:dim], total, *shape0[dim + 1:]))
        return Reduction((out_shape,), (dtype,),
                         lambda outs: torch.cat(list(values), dim, out=outs[0]))
    # Non-concat dims differ: zero-pad every item into the per-dimension maximum (vLLM #31658).
    maxes = [max(v.shape[d] for v in values) for d in range(ndim)]
    maxes[dim] = total
    out_shape = torch.Size(maxes)

    def pad(outs: Sequence[torch.Tensor]) -> torch.Tensor:
        out = outs[0].zero_()
        start = 0
        for v in values:
            region = [slice(0, n) for n in v.shape]
            region[dim] = slice(start, start + v.shape[dim])
            out[tuple(region)].copy_(v)
            start += v.shape[dim]
        return out

    return Reduction((out_shape,), (dtype,), pad)


def reduce_field(name: str, spec: FieldSpec, values: Sequence[Any]) -> Any:
    """Reduce per-item values into the batch value, in fresh memory on the values' device.

    A single tensor item is not copied: batched gives a leading-1 view, flat the item itself
    (made contiguous), as vLLM does.
    """
    if spec.kind != "shared" and values and all(isinstance(v, torch.Tensor) for v in values):
        if len(values) == 1:
            v = values[0].contiguous()
            return v.unsqueeze(0) if spec.kind == "batched" else v
        # The common cases straight to torch (this is the batching hot path); padding,
        # ragged lists and errors go through the plan.
        _common_dtype(name, values)
        shape = values[0].shape
        if spec.kind == "batched":
            if all(v.shape == shape for v in values):
                return torch.stack(values)
        elif concatenable(values, spec.dim):
            return torch.cat(values, spec.dim)
    plan = plan_reduction(name, spec, values)
    leaves: list[torch.Tensor] = []
    _tensor_leaves(list(values), leaves)
    # Values already on a device are reduced there (no host round trip).
    device = leaves[0].device if leaves else None
    return plan.fill([torch.empty(s, dtype=d, device=device)
                      for s, d in zip(plan.shapes, plan.dtypes, strict=True)])


def value_devices(value: Any) -> set[torch.device]:
    """The devices of every tensor in ``value`` (a tensor, a nested list, a plain value)."""
    leaves: list[torch.Tensor] = []
    _tensor_leaves(value, leaves)
    return {t.device for t in leaves}
