"""Per-item views of processor output: :class:`Item`, :class:`Items` and :func:`split_items`."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch

from mmferry.errors import ContractError
from mmferry.fields import FieldSpec, split_field
from mmferry.hashing import hash_item, payload_nbytes

__all__ = ["Item", "Items", "split_items"]


class Item(Mapping[str, Any]):
    """All fields of one media item (one image, clip or video).

    A read-only mapping from field name to value (a tensor, a list of tensors, an int or a
    float) with the item's ``modality``, its ``specs`` (each field's per-item
    :class:`FieldSpec`), ``nbytes`` (tensor payload bytes) and ``hash``: a hex blake3 digest
    of every field's name, spec, dtype, shape and bytes, computed on first use, so equal
    content gives equal keys across processes.
    """

    __slots__ = ("_data", "_hash", "modality", "specs")

    def __init__(
        self,
        modality: str,
        data: Mapping[str, Any],
        specs: Mapping[str, FieldSpec],
        *,
        hash: str | None = None,
    ) -> None:
        if set(data) != set(specs):
            missing = sorted(set(data) ^ set(specs))
            raise ContractError("item data and specs name different fields", field=missing[0])
        for name, spec in specs.items():
            if spec.modality != modality:
                raise ContractError(
                    f"spec modality {spec.modality!r} differs from the item's {modality!r}",
                    field=name,
                )
            if spec.normalize is not None:
                _check_levels(name, data[name])
        self.modality = modality
        self._data = dict(data)
        # Items split together share one read-only specs mapping, so batching compares
        # them by identity first.
        self.specs: Mapping[str, FieldSpec] = (
            specs if isinstance(specs, MappingProxyType) else MappingProxyType(dict(specs))
        )
        self._hash = hash

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    @property
    def hash(self) -> str:
        if self._hash is None:
            self._hash = hash_item(self.modality, self._data, self.specs)
        return self._hash

    @property
    def known_hash(self) -> str | None:
        """The hash if it is already known (computed, or received over the wire), else
        ``None``; never computes it."""
        return self._hash

    @property
    def nbytes(self) -> int:
        return sum(payload_nbytes(v) for v in self._data.values())

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={_describe(v)}" for k, v in self._data.items())
        return f"Item({self.modality!r}, {fields})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Item):
            return NotImplemented
        return (
            self.modality == other.modality
            and dict(self.specs) == dict(other.specs)
            and self._data.keys() == other._data.keys()
            and all(values_equal(self._data[k], other._data[k]) for k in self._data)
        )

    __hash__ = None  # type: ignore[assignment]


def _check_levels(name: str, value: Any) -> None:
    """A field with a :class:`~mmferry.fields.Normalize` holds uint8 levels, nothing else."""
    values = value if isinstance(value, list | tuple) else [value]
    for v in values:
        if not isinstance(v, torch.Tensor) or v.dtype != torch.uint8:
            raise ContractError(f"a field with normalize holds uint8 tensors, got {_describe(v)}",
                                field=name)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, list | tuple):
        return f"[{', '.join(_describe(v) for v in value)}]"
    return repr(value)


def values_equal(a: Any, b: Any) -> bool:
    """Structural equality of field values: tensors by dtype, shape and content."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, list | tuple) or isinstance(b, list | tuple):
        return (
            isinstance(a, list | tuple)
            and isinstance(b, list | tuple)
            and len(a) == len(b)
            and all(values_equal(x, y) for x, y in zip(a, b, strict=True))
        )
    return type(a) is type(b) and a == b


class Items(Mapping[str, list[Item]]):
    """Items by modality, each list in the order the processor produced them.

    A modality without items has no entry. Iterating :meth:`in_order` gives every item,
    modality by modality.
    """

    __slots__ = ("_by_modality", "_order")

    def __init__(self, by_modality: Mapping[str, list[Item]] | None = None) -> None:
        self._by_modality = {m: list(v) for m, v in (by_modality or {}).items() if v}
        self._order: list[Item] | None = None

    @classmethod
    def from_sequence(cls, items: Sequence[Item]) -> Items:
        """Items of any modalities in one given order (a request's interleaved images and
        audio, say): grouped by modality for ``items[modality]``, while :meth:`in_order`
        gives them back in exactly this order."""
        by_modality: dict[str, list[Item]] = {}
        for item in items:
            if not isinstance(item, Item):
                raise ContractError(f"expected Item, got {type(item).__name__}")
            by_modality.setdefault(item.modality, []).append(item)
        out = cls(by_modality)
        out._order = list(items)
        return out

    def __getitem__(self, modality: str) -> list[Item]:
        try:
            return self._by_modality[modality]
        except KeyError:
            raise KeyError(
                f"no items of modality {modality!r}; available: {sorted(self._by_modality)}"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_modality)

    def __len__(self) -> int:
        return len(self._by_modality)

    def in_order(self) -> list[Item]:
        """All items: in the given order for :meth:`from_sequence` (what
        :func:`mmferry.wire.decode` returns), else modality by modality, in processor order
        within each modality."""
        if self._order is not None:
            return list(self._order)
        return [it for items in self._by_modality.values() for it in items]

    @property
    def num_items(self) -> int:
        return sum(len(v) for v in self._by_modality.values())

    def __repr__(self) -> str:
        return f"Items({ {m: len(v) for m, v in self._by_modality.items()} })"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Items):
            return NotImplemented
        return self._by_modality == other._by_modality

    __hash__ = None  # type: ignore[assignment]


def split_items(
    outputs: Mapping[str, Any],
    specs: Mapping[str, FieldSpec],
    *,
    ignore_extra: bool = False,
) -> Items:
    """Split processor output into per-item :class:`Items` according to ``specs``.

    ``outputs`` is any mapping (a dict, a transformers ``BatchFeature``). Strict by default:
    a key without a spec is a :class:`ContractError` unless ``ignore_extra=True``. A spec whose
    key is absent (or ``None``) is skipped only when its whole modality is absent, so specs
    must name exactly the fields the processor produced (a model's ``field_specs(outputs)``
    leaves out ``image_embeds`` when pixels were given); item counts must agree within a
    modality.
    """
    for key in outputs:
        if key not in specs and not ignore_extra:
            raise ContractError(
                "processor output has no field spec (pass ignore_extra=True to drop it)", field=key
            )
    by_modality: dict[str, dict[str, FieldSpec]] = {}
    for name, spec in specs.items():
        if not isinstance(spec, FieldSpec):
            raise ContractError(f"spec must be a FieldSpec, got {type(spec).__name__}", field=name)
        by_modality.setdefault(spec.modality, {})[name] = spec

    result: dict[str, list[Item]] = {}
    for modality, mspecs in by_modality.items():
        present = {k: outputs[k] for k in mspecs if k in outputs and outputs[k] is not None}
        if not present:
            continue
        missing = [k for k in mspecs if k not in present]
        if missing:
            raise ContractError(
                f"missing from processor output while other {modality!r} fields "
                f"({', '.join(sorted(present))}) are present",
                field=missing[0],
            )
        per_field = {k: split_field(k, mspecs[k], v) for k, v in present.items()}
        counts = {k: len(v) for k, v in per_field.items()}
        n = next(iter(counts.values()))
        if any(c != n for c in counts.values()):
            detail = ", ".join(f"{k}={c}" for k, c in counts.items())
            bad = next(k for k, c in counts.items() if c != n)
            raise ContractError(f"item counts disagree within {modality!r}: {detail}", field=bad)
        if n == 0:
            continue
        item_specs = MappingProxyType({k: mspecs[k].for_item() for k in per_field})
        result[modality] = [
            Item(modality, {k: per_field[k][i] for k in per_field}, item_specs) for i in range(n)
        ]
    return Items(result)

