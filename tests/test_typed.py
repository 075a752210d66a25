"""Issue 9, classes 2 and 3: the wire decoder's bounds, lossless order, and typed errors for
bad arguments at every public entry point."""

from __future__ import annotations

import struct
import time
import tracemalloc
from typing import ClassVar

import msgspec
import numpy as np
import pytest
import torch

import mmferry as mf
from mmferry import wire
from mmferry.errors import ArgumentError, ContractError, EncoderCacheError, WireError

F = mf.FieldSpec
PREFIX = b"MFW" + bytes([wire.VERSION])


def _array(n: int) -> bytes:
    return b"\xdd" + struct.pack(">I", n)


def _hostile_headers() -> dict[str, bytes]:
    """Headers of about 16 MB whose nests cost ~64 B of Python per byte if parsed."""
    n = 16_000_000
    item_nest = _array(1) + b"\x92\x00" + _array(n) + b"\x90" * n  # one item, n lists
    spec_nest = _array(1) + b"\x95\xa4flat\xa5image\xa6device\x00" + _array(n) + b"\x90" * n
    layout_names = _array(1) + b"\x93\xa5image" + _array(n // 2) + b"\xa1a" * (n // 2) + b"\x90"
    return {
        "shared": PREFIX + b"\x96\x90\x90\x90\x90" + _array(60_000)
                  + (_array(260) + b"\x90" * 260) * 60_000 + b"\x90",
        "item values": PREFIX + b"\x96\x90\x90" + _array(1) + b"\x92\xa5image\x90\x90\x90"
                       + item_nest,
        "spec slices": PREFIX + b"\x96\x90" + spec_nest + b"\x90\x90\x90\x90",
        "layout names": PREFIX + b"\x96\x90\x90" + layout_names + b"\x90\x90\x90",
        "items": PREFIX + b"\x96\x90\x90\x90\x90\x90" + _array(n // 3) + b"\x92\x00\x90" * (n // 3),
        "tensors": PREFIX + b"\x96\x90\x90\x90" + _array(n // 3) + b"\x92\x00\x90" * (n // 3)
                   + b"\x90\x90",
    }


@pytest.mark.parametrize("name", sorted(_hostile_headers()))
def test_a_16_mb_header_is_refused_cheaply(name: str) -> None:
    header = _hostile_headers()[name]
    assert 8 << 20 < len(header) <= wire.MAX_HEADER_BYTES
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(WireError):
            wire.decode([header])
        seconds = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, f"{name}: {peak >> 20} MB to refuse a {len(header) >> 20} MB header"
    assert seconds < 1.0, f"{name}: {seconds:.2f} s"


def test_sections_are_bounded_by_what_the_frames_hold() -> None:
    # 1000 tensors of 4 bytes claimed, no data frame: refused from the count alone.
    header = PREFIX + msgspec.msgpack.encode([[], [], [], [[0, [1]]] * 1000, [], []])
    with pytest.raises(WireError, match="1000 tensors cannot fit 0 data bytes"):
        wire.decode([header])


def _items() -> list[mf.Item]:
    img = mf.split_items({"x": torch.arange(6.0).reshape(3, 2)},
                         {"x": F.batched("image")})["image"]
    aud = mf.split_items({"a": torch.arange(4).reshape(2, 2)}, {"a": F.batched("audio")})["audio"]
    return [img[0], aud[0], img[1], aud[1], img[2]]


def test_decode_gives_back_the_given_order_with_interleaved_modalities() -> None:
    given = _items()
    got = wire.decode(wire.encode(given))
    assert [it.modality for it in got.in_order()] == ["image", "audio", "image", "audio", "image"]
    assert all(a == b for a, b in zip(got.in_order(), given, strict=True))
    # Per modality, each keeps its own order too.
    assert got["image"] == [given[0], given[2], given[4]]
    # An Items built by modality still goes modality by modality, and round-trips so.
    by_modality = mf.Items({"image": [given[0], given[2]], "audio": [given[1]]})
    again = wire.decode(wire.encode(by_modality)).in_order()
    assert [it.modality for it in again] == ["image", "image", "audio"]
    # The runner answers in the given order as well.
    assert mf.Items.from_sequence(given).in_order() == given


def test_strided_and_odd_frames_are_wire_errors() -> None:
    frames = wire.encode(_items())
    header = bytes(frames[0])
    strided = memoryview(header + header)[::2]
    with pytest.raises(WireError, match="strided"):
        wire.decode([strided, *frames[1:]])
    data = bytes(frames[1])
    as_matrix = memoryview(np.frombuffer(data * 2, np.uint8).reshape(2, -1)[:, :len(data) // 2])
    with pytest.raises(WireError, match="strided"):
        wire.decode([header, as_matrix])
    with pytest.raises(WireError):
        wire.decode([header, 42])


@pytest.mark.parametrize(("d", "match"), [
    ({}, "needs kind and modality"),
    ({"kind": "flat"}, "needs modality"),
    ({"kind": "flat", "modality": "image", "color": 1}, "unknown field spec key"),
    ({"kind": "flat", "modality": "image", "dim": True}, "dim"),
    ({"kind": "shared", "modality": "image", "batch_size": True}, "batch_size"),
    ({"kind": "flat", "modality": "image", "sizes": 3}, "sizes"),
    ({"kind": "flat", "modality": "image", "placement": ["host"]}, "placement"),
    ("flat", "mapping"),
])
def test_field_spec_from_dict_raises_contract_errors(d, match) -> None:
    with pytest.raises(ContractError, match=match):
        F.from_dict(d)


def test_booleans_are_not_dims() -> None:
    with pytest.raises(ContractError, match="dim"):
        F.flat("image", [slice(0, 1)], dim=True)
    with pytest.raises(ContractError, match="dim"):
        F.flat_from_sizes("image", [1], dim=True)
    with pytest.raises(ContractError, match="dim"):
        F("flat", "image", dim=False)
    with pytest.raises(ContractError, match="batch_size"):
        F.shared("image", True)


@pytest.mark.parametrize("device", ["bogus", "cuda:x", "", 3, None, ["cpu"], "xpu"])
def test_bad_devices_are_argument_errors_everywhere(device) -> None:
    from mmferry.cli.args import check_device

    with pytest.raises(ArgumentError):
        mf.Transfer(device)
    with pytest.raises(ArgumentError):
        mf.EncoderRunner(_Model(), device=device)
    if isinstance(device, str):
        with pytest.raises(ArgumentError):
            check_device(device)
    if device != "xpu":  # xpu is a fine simulated accelerator for the audit
        with pytest.raises(ArgumentError):
            mf.audit.audit(lambda x: x, {"x": torch.ones(1)}, {"x": F.batched("image")},
                           device=device)


def test_transfer_and_runner_arguments_are_typed() -> None:
    with pytest.raises(ArgumentError, match="max_staging_blocks"):
        mf.Transfer("cpu", max_staging_blocks=0)
    with pytest.raises(ArgumentError, match="max_tokens_per_step"):
        mf.EncoderRunner(_Model(), max_tokens_per_step=True)
    with pytest.raises(ArgumentError, match="model_id"):
        mf.EncoderRunner(_Model(), model_id="")
    with pytest.raises(ArgumentError, match="not an Item"):
        mf.EncoderRunner(_Model()).encode([{"x": 1}])


def test_cache_arguments_and_unknown_keys_are_cache_errors() -> None:
    cache = mf.EncoderCache(max_tokens=10)
    with pytest.raises(EncoderCacheError, match="no cache entry"):
        cache.reference("nope", "r")
    for bad in (0, -1, True, "10", 2.5):
        with pytest.raises(EncoderCacheError):
            mf.EncoderCache(max_tokens=bad)
    with pytest.raises(EncoderCacheError):
        cache.put(3, torch.zeros(1, 2))  # type: ignore[arg-type]
    with pytest.raises(EncoderCacheError):
        cache.put("k", [1, 2])  # type: ignore[arg-type]
    assert cache.get("nope") is None
    cache.release("never-seen")  # releasing what a request never held is a no-op
    assert len(cache) == 0


def test_unhashable_values_are_contract_errors() -> None:
    item = mf.Item("image", {"x": object()}, {"x": F.batched("image")})
    with pytest.raises(ContractError, match="cannot hash"):
        item.hash  # noqa: B018
    runner = mf.EncoderRunner(_Model())
    assert runner.encode([item]) == [None] and runner.last.status == ["error"]


class _Model(torch.nn.Module):
    name = "m"
    modalities = ("image",)
    hidden_size = 1
    precomputed_fields: ClassVar[frozenset[str]] = frozenset()
    checkpoint_prefixes: ClassVar[dict[str, str]] = {}

    def check_item(self, item) -> None:
        pass

    def tokens_per_item(self, item) -> int:
        return 1

    def encode(self, **batch) -> torch.Tensor:
        return torch.zeros(len(next(iter(batch.values()))), 1)
