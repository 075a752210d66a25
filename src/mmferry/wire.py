"""Items to frames and back: a small typed header plus the tensor bytes, never a pickle.

``encode(items)`` returns a list of frames ready for a multipart transport (ZMQ, a pipe
with length prefixes, shared memory):

* frame 0 is the header: the 4-byte prefix ``b"MFW"`` + version, then msgpack (msgspec
  structs) holding a spec table, a layout table (an item's modality, field names and spec
  indices), one descriptor per tensor (dtype code, shape, frame, offset), the shared values
  and one short row per item (layout index, field values, optional hash);
* each tensor of at least :data:`PACK_BELOW` bytes is a frame of its own: a memoryview of the
  tensor's memory, no copy (non-contiguous tensors are made contiguous first);
* smaller tensors are copied into one packed frame, each at an offset aligned to its element
  size, so many small tensors (grids, lengths, masks) cost one frame instead of one each.
  64 KiB is pyzmq's own copy threshold (it copies smaller zero-copy frames anyway), and
  measured over ZMQ each extra frame costs more (~5 µs) than copying 64 KiB: 64 items with
  four small fields (24 B to 16 KiB) took 4.0 ms as 257 frames, 3.2 ms with a 4 KiB
  threshold (66 frames) and 3.0 ms as 2 frames, encode + send + receive + decode.

Specs and shared data are sent once per message: identical specs share one table entry,
items with the same fields and specs share one layout, and a shared field's value (the
same object in several items) is one entry of the shared table that decodes to one shared
object. The header therefore grows linearly with the item count.

``decode(frames)`` checks the prefix, parses the header with msgspec into typed structs,
then checks every descriptor against the frames (dtype code, shape, frame index, alignment,
bounds, no overlap, every frame accounted for) before it builds any tensor, and raises
:class:`~mmferry.errors.WireError` on anything malformed, truncated or oversized. It never
allocates more than the frames hold.

Decoded tensors alias the frames unless ``copy=True``: they are read-only by contract (a
``bytes`` frame is immutable memory), and a frame must stay unmodified while they live.

A decoded item's ``hash`` is the sender's claim, used as its cache key without being
recomputed. Only accept frames with hashes from a sender you trust with your encoder cache;
otherwise recompute keys with :func:`mmferry.hashing.hash_item`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Annotated, Any

import msgspec
import torch

from mmferry.errors import ContractError, WireError
from mmferry.fields import MAX_CHANNELS, FieldSpec
from mmferry.items import Item, Items

__all__ = ["PACK_BELOW", "decode", "encode"]

VERSION = 1
_PREFIX = b"MFW" + bytes([VERSION])

#: Tensors smaller than this many bytes share the packed frame; larger ones get their own.
PACK_BELOW = 64 << 10

# Limits on what a header may claim; a message beyond them is refused, not attempted. They
# bound the Python objects a header can ask for (an item row of 3 bytes becomes an Item of
# hundreds), far above real messages (vLLM requests carry at most hundreds of items).
MAX_HEADER_BYTES = 16 << 20
MAX_ITEMS = 1 << 16  # items, also layouts, specs and shared values
MAX_TENSORS = 1 << 18
MAX_FRAMES = MAX_TENSORS + 1
MAX_NDIM = 32
MAX_DEPTH = 32
# The header sections whose elements nest without a fixed shape (field values, spec slices,
# layout names) may take at most this many header bytes. msgpack spends one byte on an empty
# list that Python spends ~64 on, so an unbounded nest would turn a 16 MiB header into a
# gigabyte of lists; checked on each section's byte length before it is parsed, this bound
# keeps a hostile header's cost near 64x these bytes, while real messages (a few bytes of
# values per item) stay far below it.
MAX_VALUE_BYTES = 4 << 20
MAX_TABLE_BYTES = 1 << 20  # the spec table, and the layout table, each
MAX_NAME = 256  # characters in a modality or field name
# The largest tensor (in bytes) any shape may describe, empty tensors included.
_MAX_EXTENT = 1 << 62

# Wire dtype codes: the position in this tuple. Append only; never reorder.
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float16, torch.float64, torch.bfloat16,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
    torch.complex64, torch.complex128, torch.uint16, torch.uint32, torch.uint64,
)
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}
_ITEMSIZE = tuple(torch.empty(0, dtype=dt).element_size() for dt in _DTYPES)
# numpy has no bfloat16: its bytes travel through an int16 view.
_NUMPY_VIEW = {torch.bfloat16: torch.int16}

_INT_MIN, _INT_END = -(1 << 63), 1 << 64  # what msgpack integers can hold

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Bound = int | None


class _Spec(msgspec.Struct, array_like=True, omit_defaults=True, forbid_unknown_fields=True):
    """A FieldSpec as :meth:`FieldSpec.to_dict` describes it."""

    kind: str
    modality: str
    placement: str = "device"
    dim: NonNeg = 0
    slices: list[list[tuple[Bound, Bound, Bound]]] | None = None
    sizes: list[int] | None = None
    batch_size: int | None = None
    normalize: dict[str, float | list[float]] | None = None


class _Layout(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """The fields of an item: its modality, field names and their spec-table indices."""

    modality: str
    names: list[str]
    specs: list[NonNeg]


class _Tensor(msgspec.Struct, array_like=True, omit_defaults=True, forbid_unknown_fields=True):
    """Where a tensor's bytes are: ``frame`` 0 means no bytes (an empty tensor)."""

    dtype: Annotated[int, msgspec.Meta(ge=0, lt=len(_DTYPES))]
    shape: Annotated[list[NonNeg], msgspec.Meta(max_length=MAX_NDIM)]
    frame: NonNeg = 0
    offset: NonNeg = 0


class _Item(msgspec.Struct, array_like=True, omit_defaults=True, forbid_unknown_fields=True):
    """One item: its layout, one value per field, and its hash when the sender had one
    (``digest``: a hex hash's raw bytes, half the size; ``hash``: any other string).

    A value is a tree of lists whose leaves are ints, floats, bools and ``None``, the
    latter standing for the next tensor of the tensor table. A shared field's value is an
    index into the shared table instead.
    """

    layout: NonNeg
    values: list[Any]
    digest: Annotated[bytes, msgspec.Meta(max_length=64)] | None = None
    hash: Annotated[str, msgspec.Meta(max_length=256)] | None = None


def _most(n: int) -> msgspec.Meta:
    return msgspec.Meta(max_length=n)


class _Header(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    # msgspec checks each length before it decodes an element.
    frames: Annotated[list[NonNeg], _most(MAX_FRAMES)]  # byte length of data frame 1, 2, ...
    specs: Annotated[list[_Spec], _most(MAX_ITEMS)]
    layouts: Annotated[list[_Layout], _most(MAX_ITEMS)]
    # Shared values' tensors first, then the items', in the order their values list them.
    tensors: Annotated[list[_Tensor], _most(MAX_TENSORS)]
    shared: Annotated[list[Any], _most(MAX_ITEMS)]
    items: Annotated[list[_Item], _most(MAX_ITEMS)]


class _ItemIn(msgspec.Struct, array_like=True, omit_defaults=True, forbid_unknown_fields=True):
    """:class:`_Item` as decoded: the value tree stays raw bytes until its size is checked."""

    layout: NonNeg
    values: msgspec.Raw
    digest: Annotated[bytes, msgspec.Meta(max_length=64)] | None = None
    hash: Annotated[str, msgspec.Meta(max_length=256)] | None = None


Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]


class _SpecIn(msgspec.Struct, array_like=True, omit_defaults=True, forbid_unknown_fields=True):
    """:class:`_Spec` as decoded, every list and string bounded."""

    kind: Name
    modality: Name
    placement: Annotated[str, msgspec.Meta(max_length=16)] = "device"
    dim: NonNeg = 0
    slices: Annotated[list[Annotated[list[tuple[Bound, Bound, Bound]], _most(MAX_NDIM)]],
                      _most(MAX_ITEMS)] | None = None
    sizes: Annotated[list[int], _most(MAX_ITEMS)] | None = None
    batch_size: int | None = None
    normalize: Annotated[dict[Name, float | Annotated[list[float], _most(MAX_CHANNELS)]],
                         msgspec.Meta(max_length=3)] | None = None


class _LayoutIn(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    modality: Name
    names: Annotated[list[Name], _most(1 << 12)]
    specs: Annotated[list[NonNeg], _most(1 << 12)]


class _Skeleton(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """The header with every section but the frame lengths left raw: each section's element
    count (its msgpack array header) and byte length are checked before it is parsed."""

    frames: Annotated[list[NonNeg], _most(MAX_FRAMES)]
    specs: msgspec.Raw
    layouts: msgspec.Raw
    tensors: msgspec.Raw
    shared: msgspec.Raw
    items: msgspec.Raw


_ENCODER = msgspec.msgpack.Encoder()
_SKELETON = msgspec.msgpack.Decoder(_Skeleton)
_SECTIONS = {
    "specs": msgspec.msgpack.Decoder(list[_SpecIn]),
    "layouts": msgspec.msgpack.Decoder(list[_LayoutIn]),
    "tensors": msgspec.msgpack.Decoder(list[_Tensor]),
    "shared": msgspec.msgpack.Decoder(list[Any]),
    "items": msgspec.msgpack.Decoder(list[_ItemIn]),
}
_VALUES = msgspec.msgpack.Decoder(list[Any])


# -- encode ---------------------------------------------------------------------------


def encode(items: Items | Sequence[Item]) -> list[bytes | memoryview]:
    """Frames for ``items`` (an :class:`Items` or a sequence of :class:`Item`).

    Frame 0 is the header; the others hold tensor bytes, each large tensor's frame a
    zero-copy view of its memory, so the tensors must not be modified until the frames are
    sent. Values that cannot travel (an unsupported dtype or type, ``None``) raise
    :class:`ContractError` naming the field.
    """
    seq = items.in_order() if isinstance(items, Items) else items
    spec_index: dict[FieldSpec, int] = {}
    layout_index: dict[tuple[Any, ...], int] = {}
    layouts: list[_Layout] = []
    shared_index: dict[int, int] = {}
    shared: list[Any] = []
    shared_tensors: list[torch.Tensor] = []
    tensors: list[torch.Tensor] = []
    rows: list[_Item] = []
    for item in seq:
        if not isinstance(item, Item):
            raise ContractError(f"expected Item, got {type(item).__name__}")
        specs = item.specs
        names = tuple(item)
        field_specs = tuple(specs[n] for n in names)
        key = (item.modality, names, field_specs)
        layout = layout_index.get(key)
        if layout is None:
            layout = layout_index[key] = len(layouts)
            layouts.append(_Layout(item.modality, list(names),
                                   [spec_index.setdefault(s, len(spec_index)) for s in field_specs]))
        values: list[Any] = []
        for name, spec in zip(names, field_specs, strict=True):
            value = item[name]
            if spec.kind == "shared":
                # The same object in several items is sent once; keyed by identity, since
                # equal-but-distinct values are rare and comparing tensors is not free.
                ref = shared_index.get(id(value))
                if ref is None:
                    ref = shared_index[id(value)] = len(shared)
                    shared.append(_put(name, value, shared_tensors, 0))
                values.append(ref)
            else:
                values.append(_put(name, value, tensors, 0))
        rows.append(_Item(layout, values, *_hash_out(item.known_hash)))
    if len(rows) > MAX_ITEMS or len(shared_tensors) + len(tensors) > MAX_TENSORS:
        raise ContractError(f"{len(rows)} items with {len(shared_tensors) + len(tensors)} "
                            f"tensors exceed one message ({MAX_ITEMS} items, {MAX_TENSORS} tensors)")
    descriptors, frames = _lay_out(shared_tensors + tensors)
    data_bytes = sum(f.nbytes for f in frames)
    if len(descriptors) > data_bytes + MAX_NDIM * (len(rows) + 1):
        raise ContractError(f"{len(descriptors)} tensors, most of them empty, exceed what "
                            f"{len(rows)} items may carry in one message")
    header = _Header(
        [f.nbytes for f in frames],
        [_Spec(**s.to_dict()) for s in spec_index],
        layouts, descriptors, shared, rows,
    )
    return [_PREFIX + _ENCODER.encode(header), *frames]


def _put(name: str, value: Any, tensors: list[torch.Tensor], depth: int) -> Any:
    """The header form of a field value; its tensors are appended to ``tensors``."""
    if isinstance(value, torch.Tensor):
        tensors.append(_sendable(name, value))
        return None
    if isinstance(value, float | bool):
        return value
    if isinstance(value, int):
        if not _INT_MIN <= value < _INT_END:
            raise ContractError(f"int {value} does not fit in 64 bits", field=name)
        return value
    if isinstance(value, list | tuple):
        if depth >= MAX_DEPTH:
            raise ContractError(f"lists nested deeper than {MAX_DEPTH}", field=name)
        return [_put(name, v, tensors, depth + 1) for v in value]
    raise ContractError(f"cannot send a value of type {type(value).__name__}", field=name)


def _sendable(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous, plain CPU tensor whose memory can be handed out as is."""
    if t.dtype not in _CODE:
        raise ContractError(f"dtype {t.dtype} cannot be sent", field=name)
    if t.layout is not torch.strided:
        raise ContractError(f"{t.layout} tensors cannot be sent", field=name)
    if t.requires_grad:
        t = t.detach()
    if not t.is_cpu:
        if t.is_meta:
            raise ContractError("meta tensors have no data to send", field=name)
        t = t.cpu()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return t if t.is_contiguous() else t.contiguous()


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous, non-empty CPU tensor's memory (no copy).

    The view keeps the tensor alive through the numpy array it is taken from.
    """
    view = _NUMPY_VIEW.get(t.dtype)
    return memoryview((t if view is None else t.view(view)).numpy()).cast("B")


def _lay_out(tensors: list[torch.Tensor]) -> tuple[list[_Tensor], list[memoryview]]:
    """Descriptors for ``tensors`` and the data frames holding their bytes."""
    descriptors: list[_Tensor] = []
    frames: list[memoryview] = []
    packed: list[tuple[int, memoryview]] = []
    packed_end = 0
    small = any(0 < t.nbytes < PACK_BELOW for t in tensors)
    for t in tensors:
        code = _CODE[t.dtype]
        shape = list(t.shape)
        nbytes = t.nbytes
        if nbytes == 0:
            descriptors.append(_Tensor(code, shape))
        elif nbytes < PACK_BELOW:
            # Aligned to the element size: torch.frombuffer and the kernels reading the
            # decoded tensor then see naturally aligned memory (the decoder copies a tensor
            # whose frame arrives at an unaligned address).
            size = _ITEMSIZE[code]
            offset = -(-packed_end // size) * size
            packed.append((offset, _bytes_of(t)))
            packed_end = offset + nbytes
            descriptors.append(_Tensor(code, shape, 1, offset))
        else:
            frames.append(_bytes_of(t))
            descriptors.append(_Tensor(code, shape, len(frames) + small))
    if small:
        buf = bytearray(packed_end)
        for offset, data in packed:
            buf[offset:offset + data.nbytes] = data
        frames.insert(0, memoryview(buf))
    return descriptors, frames


def _hash_out(h: str | None) -> tuple[bytes | None, str | None]:
    """``(digest, hash)`` of :class:`_Item` for an item's computed hash (``None``: not yet)."""
    if h is None or len(h) > 256:
        return None, None  # none, or too long to send: the receiver computes its own
    try:
        raw = bytes.fromhex(h)
    except ValueError:
        return None, h
    return (raw, None) if raw.hex() == h and len(raw) <= 64 else (None, h)


# -- decode ---------------------------------------------------------------------------


def decode(frames: Sequence[Any], *, copy: bool = False) -> Items:
    """The :class:`Items` that :func:`encode` turned into ``frames``, in the order they were
    given to :func:`encode`: ``decode(encode(seq)).in_order()`` is ``seq``'s order,
    interleaved modalities included (``Items[modality]`` keeps each modality's order).

    ``frames`` is a list or tuple of bytes-like objects (``bytes``, ``bytearray``,
    ``memoryview``, ``zmq.Frame``). Tensors alias the frames and are read-only by contract
    unless ``copy=True``, which copies each data frame once so no tensor refers to them.
    Any malformed, truncated or oversized input raises :class:`WireError`.
    """
    views = _views(frames)
    skeleton = _header(views[0])
    _check_frames(skeleton.frames, views)
    data_bytes = sum(v.nbytes for v in views[1:])
    n_items = _count(skeleton.items, "items", MAX_ITEMS)
    _count(skeleton.shared, "shared values", MAX_ITEMS)
    _count(skeleton.specs, "specs", MAX_ITEMS, MAX_TABLE_BYTES)
    _count(skeleton.layouts, "layouts", MAX_ITEMS, MAX_TABLE_BYTES)
    # A tensor with bytes needs at least one byte of a data frame; empty tensors (no bytes)
    # are bounded by the items that can carry them.
    n_tensors = _count(skeleton.tensors, "tensors", MAX_TENSORS)
    if n_tensors > data_bytes + MAX_NDIM * (n_items + 1):
        raise WireError(f"{n_tensors} tensors cannot fit {data_bytes} data bytes and "
                        f"{n_items} items", frame=0)
    values_budget = [MAX_VALUE_BYTES - len(skeleton.shared)]
    if values_budget[0] < 0:
        raise WireError(f"shared values take {len(skeleton.shared)} header bytes, more than "
                        f"{MAX_VALUE_BYTES}", frame=0)
    specs = [_spec(i, row) for i, row in enumerate(_section(skeleton, "specs"))]
    layouts = [_layout(i, row, specs) for i, row in enumerate(_section(skeleton, "layouts"))]
    located = _locate(_section(skeleton, "tensors"), views)
    rows = _section(skeleton, "items")
    tensors = _build(located, views, copy)

    # Value trees take the tensors in table order: shared values first, then the items.
    unused = iter(tensors)
    shared = []
    for i, v in enumerate(_section(skeleton, "shared")):
        try:
            shared.append(_value(v, unused, 0))
        except _Malformed as e:
            raise WireError(f"shared value {i}: {e}", frame=0) from None
    used_shared = bytearray(len(shared))
    order: list[Item] = []
    for i, row in enumerate(rows):
        if row.layout >= len(layouts):
            raise WireError(f"item {i}: layout {row.layout} of {len(layouts)}", frame=0)
        modality, names, item_specs, shared_fields = layouts[row.layout]
        values = _item_values(i, row.values, len(names), values_budget)
        if row.digest is not None and row.hash is not None:
            raise WireError(f"item {i}: both a digest and a hash", frame=0)
        data = {}
        for name, value in zip(names, values, strict=True):
            try:
                if name in shared_fields:
                    if type(value) is not int or not 0 <= value < len(shared):
                        raise _Malformed(f"bad shared-value index {value!r}")
                    used_shared[value] = 1
                    data[name] = shared[value]
                else:
                    data[name] = _value(value, unused, 0)
            except _Malformed as e:
                raise WireError(f"item {i} field {name!r}: {e}", frame=0) from None
        order.append(Item(modality, data, item_specs,
                          hash=row.digest.hex() if row.digest is not None else row.hash))
    if next(unused, None) is not None:
        raise WireError("the tensor table has tensors no value uses", frame=0)
    if not all(used_shared):
        raise WireError(f"shared value {used_shared.index(0)} is not used by any item", frame=0)
    return Items.from_sequence(order)


def _count(raw: msgspec.Raw, what: str, most: int, max_bytes: int | None = None) -> int:
    """The element count a section's msgpack array header declares, checked against
    ``most`` (and the section's bytes against ``max_bytes``) before anything is parsed."""
    view = memoryview(raw)
    if max_bytes is not None and view.nbytes > max_bytes:
        raise WireError(f"the {what} take {view.nbytes} header bytes, more than {max_bytes}",
                        frame=0)
    head = view[0] if view.nbytes else None
    if head is not None and 0x90 <= head <= 0x9F:
        n = head & 0x0F
    elif head == 0xDC and view.nbytes >= 3:
        n = int.from_bytes(view[1:3], "big")
    elif head == 0xDD and view.nbytes >= 5:
        n = int.from_bytes(view[1:5], "big")
    else:
        raise WireError(f"the {what} are not a list", frame=0)
    if n > most:
        raise WireError(f"{n} {what} is more than {most}", frame=0)
    return n


def _section(skeleton: _Skeleton, name: str) -> list[Any]:
    try:
        return _SECTIONS[name].decode(getattr(skeleton, name))
    except (msgspec.DecodeError, RecursionError) as e:
        raise WireError(f"bad header ({name}): {e}", frame=0) from None


def _item_values(i: int, raw: msgspec.Raw, fields: int, budget: list[int]) -> list[Any]:
    """Item ``i``'s value list: its field count and its share of :data:`MAX_VALUE_BYTES`
    checked on the raw bytes, then parsed."""
    n = _count(raw, f"values of item {i}", fields)
    if n != fields:
        raise WireError(f"item {i}: {n} values for {fields} fields", frame=0)
    budget[0] -= len(raw)
    if budget[0] < 0:
        raise WireError(f"field values take more than {MAX_VALUE_BYTES} header bytes "
                        f"(at item {i})", frame=0)
    try:
        return _VALUES.decode(raw)
    except (msgspec.DecodeError, RecursionError) as e:
        raise WireError(f"item {i}: bad values: {e}", frame=0) from None


def _views(frames: Any) -> list[memoryview]:
    if not isinstance(frames, list | tuple):
        raise WireError(f"frames must be a list or tuple, got {type(frames).__name__}")
    if not frames:
        raise WireError("no frames: a message has at least its header")
    if len(frames) > MAX_FRAMES:
        raise WireError(f"{len(frames)} frames is more than {MAX_FRAMES}")
    views = []
    for i, f in enumerate(frames):
        try:
            v = memoryview(f)
            if not v.c_contiguous:
                # A strided view's buffer holds bytes that are not the frame's.
                raise WireError("a strided (non-contiguous) view; give contiguous bytes",
                                frame=i)
            if v.ndim != 1 or v.format != "B":
                v = v.cast("B")
        except (TypeError, ValueError, BufferError) as e:
            if isinstance(e, WireError):
                raise
            raise WireError(f"not a contiguous bytes-like object ({e})", frame=i) from None
        views.append(v)
    return views


def _header(view: memoryview) -> _Skeleton:
    if view.nbytes > MAX_HEADER_BYTES:
        raise WireError(f"header of {view.nbytes} bytes is more than {MAX_HEADER_BYTES}", frame=0)
    if view[:3] != _PREFIX[:3]:
        raise WireError("not an mmferry wire message (bad magic)", frame=0, offset=0)
    if view.nbytes < 4 or view[3] != VERSION:
        got = view[3] if view.nbytes >= 4 else "missing"
        raise WireError(f"wire version {got} is not {VERSION}", frame=0, offset=3)
    try:
        header = _SKELETON.decode(view[4:])
    except (msgspec.DecodeError, RecursionError) as e:
        raise WireError(f"bad header: {e}", frame=0) from None
    return header


def _check_frames(lengths: list[int], views: list[memoryview]) -> None:
    if len(lengths) != len(views) - 1:
        raise WireError(f"header lists {len(lengths)} data frames, got {len(views) - 1}", frame=0)
    for i, (n, v) in enumerate(zip(lengths, views[1:], strict=True), 1):
        if n != v.nbytes:
            raise WireError(f"frame is {v.nbytes} bytes, header says {n}", frame=i)


def _spec(i: int, row: _SpecIn) -> FieldSpec:
    try:
        return FieldSpec.from_dict(msgspec.structs.asdict(row))
    except ValueError as e:  # ContractError included
        raise WireError(f"spec {i}: {e}", frame=0) from None


def _layout(
    i: int, row: _LayoutIn, specs: list[FieldSpec]
) -> tuple[str, list[str], Mapping[str, FieldSpec], frozenset[str]]:
    if not row.modality:
        raise WireError(f"layout {i}: empty modality", frame=0)
    if len(row.names) != len(row.specs):
        raise WireError(f"layout {i}: {len(row.names)} names for {len(row.specs)} specs", frame=0)
    item_specs = {}
    for name, s in zip(row.names, row.specs, strict=True):
        if s >= len(specs):
            raise WireError(f"layout {i}: spec {s} of {len(specs)}", frame=0)
        if specs[s].modality != row.modality:
            raise WireError(f"layout {i}: field {name!r} has a {specs[s].modality!r} spec "
                            f"in a {row.modality!r} item", frame=0)
        item_specs[name] = specs[s]
    if len(item_specs) != len(row.names):
        raise WireError(f"layout {i}: repeated field names", frame=0)
    shared = frozenset(n for n, s in item_specs.items() if s.kind == "shared")
    # One read-only mapping per layout: its items share it, and batching compares by identity.
    return row.modality, row.names, MappingProxyType(item_specs), shared


def _locate(
    rows: list[_Tensor], views: list[memoryview]
) -> list[tuple[int, torch.dtype, list[int], int, int, int]]:
    """Check every descriptor against the frames; ``(code, dtype, shape, numel, frame, offset)``.

    Within a frame, tensors follow each other in table order without overlap, each aligned
    to its element size, and the last one ends where the frame ends, so the bytes the
    tensors claim never exceed the bytes received.
    """
    cursor = [0] * len(views)
    located = []
    for i, row in enumerate(rows):
        code, shape, f, offset = row.dtype, row.shape, row.frame, row.offset
        size = _ITEMSIZE[code]
        numel = math.prod(shape)
        if numel == 0:
            # No bytes back an empty tensor, so only this bound keeps its strides sane.
            if math.prod(d or 1 for d in shape) * size > _MAX_EXTENT:
                raise WireError(f"tensor {i}: shape {shape} is too large", frame=0)
            if f or offset:
                raise WireError(f"tensor {i}: an empty tensor claims frame {f} byte {offset}",
                                frame=0)
        else:
            if not 1 <= f < len(views):
                raise WireError(f"tensor {i}: frame {f} of {len(views)}", frame=0)
            end = offset + numel * size
            if offset % size:
                raise WireError(f"tensor {i}: offset not aligned to {size} bytes",
                                frame=f, offset=offset)
            if offset < cursor[f]:
                raise WireError(f"tensor {i}: overlaps the previous tensor ending at "
                                f"byte {cursor[f]}", frame=f, offset=offset)
            if end > views[f].nbytes:
                raise WireError(f"tensor {i}: {_DTYPES[code]}{shape} needs bytes up to {end} "
                                f"of a {views[f].nbytes}-byte frame", frame=f, offset=offset)
            cursor[f] = end
        located.append((code, _DTYPES[code], shape, numel, f, offset))
    for f in range(1, len(views)):
        if cursor[f] != views[f].nbytes:
            raise WireError(f"{views[f].nbytes - cursor[f]} bytes after the last tensor",
                            frame=f, offset=cursor[f])
    return located


def _build(
    located: list[tuple[int, torch.dtype, list[int], int, int, int]],
    views: list[memoryview],
    copy: bool,
) -> list[torch.Tensor]:
    """Tensors over already checked regions: views of the frames, or of one copy of each."""
    if copy:
        views = [views[0], *(memoryview(bytearray(v)) for v in views[1:])]
    elif any(v.readonly for v in views[1:]):
        with warnings.catch_warnings():
            # torch warns once per process that it cannot mark a tensor read-only; the
            # tensors are read-only by contract (see the module docstring).
            warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
            return [_tensor(*loc, views) for loc in located]
    return [_tensor(*loc, views) for loc in located]


def _tensor(
    code: int, dtype: torch.dtype, shape: list[int], numel: int, f: int, offset: int,
    views: list[memoryview],
) -> torch.Tensor:
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    if dtype is torch.bool:
        raw = torch.frombuffer(views[f], dtype=torch.uint8, count=numel, offset=offset)
        # Any byte but 0 and 1 in a bool tensor is undefined behaviour in torch kernels.
        if bool((raw > 1).any()):
            raise WireError("bool tensor holds bytes other than 0 and 1", frame=f, offset=offset)
        t = raw.view(torch.bool)
    else:
        t = torch.frombuffer(views[f], dtype=dtype, count=numel, offset=offset)
    if t.data_ptr() % _ITEMSIZE[code]:
        t = t.clone()  # a frame at an unaligned address; kernels expect aligned elements
    return t if len(shape) == 1 else t.view(shape)


class _Malformed(Exception):
    """A bad field value; the caller adds which item and field and raises WireError."""


def _value(v: Any, tensors: Iterator[torch.Tensor], depth: int) -> Any:
    if v is None:
        t = next(tensors, None)
        if t is None:
            raise _Malformed("refers to more tensors than the tensor table has")
        return t
    kind = type(v)
    if kind is int or kind is float or kind is bool:
        return v
    if kind is list:
        if depth >= MAX_DEPTH:
            raise _Malformed(f"lists nested deeper than {MAX_DEPTH}")
        return [_value(x, tensors, depth + 1) for x in v]
    raise _Malformed(f"unexpected {kind.__name__} in a field value")
