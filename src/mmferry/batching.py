"""Batching: consecutive compatible items become one :class:`Batch` per encoder call."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mmferry.errors import ContractError
from mmferry.fields import FieldSpec, check_batch_values, reduce_field
from mmferry.items import Item, Items, values_equal

__all__ = ["Batch", "batch_items"]


class Batch:
    """Consecutive items of one modality that share their field set, specs and shared values.

    ``data`` maps each field to its reduced value (stacked, concatenated, padded or a list,
    per the field's kind); each field is reduced on first access and kept. ``values(field)``
    gives the per-item values unreduced, which is what :class:`mmferry.Transfer` packs straight into its
    staging block, so device fields are copied once.
    """

    __slots__ = ("_data", "items", "modality", "specs")

    def __init__(self, items: Sequence[Item]) -> None:
        if not items:
            raise ContractError("a batch needs at least one item")
        self.items: tuple[Item, ...] = tuple(items)
        self.modality = self.items[0].modality
        self.specs: Mapping[str, FieldSpec] = self.items[0].specs
        self._data: dict[str, Any] = {}

    @property
    def num_items(self) -> int:
        return len(self.items)

    def values(self, field: str) -> list[Any]:
        """The items' values of ``field``, in item order."""
        return [it[field] for it in self.items]

    def reduced(self, field: str) -> Any:
        """The reduced value of one field (computed once)."""
        cache = self._data
        if field not in cache:
            cache[field] = reduce_field(field, self.specs[field], self.values(field))
        return cache[field]

    @property
    def data(self) -> Mapping[str, Any]:
        return {name: self.reduced(name) for name in self.specs}

    def __repr__(self) -> str:
        return f"Batch({self.modality!r}, num_items={self.num_items}, fields={list(self.specs)})"


def _same_batch(first: Item, item: Item) -> bool:
    if item.modality != first.modality or (
        item.specs is not first.specs and item.specs != first.specs
    ):
        return False
    return all(
        item[name] is first[name] or values_equal(item[name], first[name])
        for name, spec in first.specs.items()
        if spec.kind == "shared"
    )


def _check(batch_items: Sequence[Item]) -> None:
    first = batch_items[0]
    for name in first.specs:
        check_batch_values(name, [it[name] for it in batch_items])


def batch_items(items: Items | Sequence[Item]) -> list[Batch]:
    """Group items into batches, preserving order.

    ``items`` is an :class:`Items` (taken modality by modality) or any sequence of
    :class:`Item` in scheduling order, from one request or many. A new batch starts whenever
    the modality, the field set or specs, or the value of a shared field changes, so outputs
    map back to items purely by order. No items give no batches.
    """
    seq = items.in_order() if isinstance(items, Items) else list(items)
    batches: list[Batch] = []
    start = 0
    for i in range(1, len(seq) + 1):
        if i == len(seq) or not _same_batch(seq[start], seq[i]):
            group = seq[start:i]
            _check(group)
            batches.append(Batch(group))
            start = i
    return batches if seq else []
