"""The media of a render request: parsed from JSON or multipart, then resolved to bytes.

JSON: ``{"media": [{"modality": "image", "data": "<base64>" | "url": "..." | "path": "..."},
...], "processor_kwargs": {...}}``. Multipart: each file part is one item, its part name
the modality; a text part named ``media`` holds one JSON entry (a ``url`` or ``path``); a
text part ``processor_kwargs`` holds the kwargs as JSON. Items keep the order they came in.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from mmferry.server.errors import ServerError
from mmferry.server.fetch import FetchPolicy, fetch

__all__ = ["MediaLimits", "MediaRef", "parse_json", "parse_multipart", "resolve"]


@dataclass(frozen=True)
class MediaLimits:
    """What one request may ask for; see ``mmferry launch render --help``."""

    max_items: int = 32
    max_media_bytes: int = 32 << 20
    max_image_pixels: int = 89_478_485
    local_media_path: Path | None = None
    fetch: FetchPolicy = field(default_factory=FetchPolicy)


@dataclass(frozen=True)
class MediaRef:
    """One item of a request: its modality and exactly one of bytes, a URL or a path."""

    modality: str
    index: int
    data: bytes | None = None
    url: str | None = None
    path: str | None = None


def _bad(message: str, item: int | None = None, field: str | None = None) -> ServerError:
    return ServerError(400, "bad_request", message, item, field)


def _check_count(n: int, limits: MediaLimits) -> None:
    if n > limits.max_items:
        raise ServerError(400, "too_many_items", f"{n} media items, more than --max-items "
                          f"{limits.max_items}", None, "media")
    if n == 0:
        raise _bad("no media items", field="media")


def _kwargs(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad("processor_kwargs must be an object", field="processor_kwargs")
    return value


def _entry(raw: Any, index: int, limits: MediaLimits, modalities: tuple[str, ...]) -> MediaRef:
    if not isinstance(raw, dict):
        raise _bad("a media entry must be an object", index)
    unknown = set(raw) - {"modality", "data", "url", "path"}
    if unknown:
        raise _bad(f"unknown key {sorted(unknown)[0]!r} in a media entry", index, sorted(unknown)[0])
    modality = raw.get("modality")
    _check_modality(modality, index, modalities)
    sources = [k for k in ("data", "url", "path") if raw.get(k) is not None]
    if len(sources) != 1:
        raise _bad("a media entry holds exactly one of data, url, path", index, "data")
    key = sources[0]
    value = raw[key]
    if not isinstance(value, str):
        raise _bad(f"{key} must be a string", index, key)
    if key == "data":
        if len(value) > 4 * (limits.max_media_bytes // 3 + 1):
            raise ServerError(422, "media_too_large", f"item of more than --max-media-bytes "
                              f"{limits.max_media_bytes}", index, "data")
        try:
            data = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ServerError(400, "invalid_base64", f"data is not valid base64 ({e})", index,
                              "data") from None
        return MediaRef(modality, index, data=data)
    return MediaRef(modality, index, **{key: value})


def _check_modality(modality: Any, index: int, modalities: tuple[str, ...]) -> None:
    if modality not in modalities:
        raise ServerError(400, "unsupported_modality", f"modality {modality!r} is not one of this "
                          f"model's: {', '.join(modalities)}", index, "modality")


def parse_json(body: bytes, limits: MediaLimits,
               modalities: tuple[str, ...]) -> tuple[list[MediaRef], dict[str, Any]]:
    try:
        request = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _bad(f"body is not JSON ({e})") from None
    if not isinstance(request, dict):
        raise _bad("body must be a JSON object")
    unknown = set(request) - {"media", "processor_kwargs", "model"}
    if unknown:
        raise _bad(f"unknown key {sorted(unknown)[0]!r}", field=sorted(unknown)[0])
    media = request.get("media")
    if not isinstance(media, list):
        raise _bad("media must be a list", field="media")
    _check_count(len(media), limits)
    refs = [_entry(raw, i, limits, modalities) for i, raw in enumerate(media)]
    return refs, _kwargs(request.get("processor_kwargs"))


async def parse_multipart(form: Any, limits: MediaLimits,
                          modalities: tuple[str, ...]) -> tuple[list[MediaRef], dict[str, Any]]:
    """``form``: starlette ``FormData`` (already read within the body cap)."""
    refs: list[MediaRef] = []
    kwargs: dict[str, Any] = {}
    parts = form.multi_items()
    n = sum(1 for name, _ in parts if name != "processor_kwargs")
    if n > limits.max_items:
        _check_count(n, limits)
    for name, value in parts:
        index = len(refs)
        if name == "processor_kwargs":
            try:
                kwargs = _kwargs(json.loads(value if isinstance(value, str) else await value.read()))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise _bad(f"processor_kwargs is not JSON ({e})", field=name) from None
        elif name == "media" and isinstance(value, str):
            try:
                entry = json.loads(value)
            except json.JSONDecodeError as e:
                raise _bad(f"a media part is not JSON ({e})", index, "media") from None
            refs.append(_entry(entry, index, limits, modalities))
        elif isinstance(value, str):
            raise _bad(f"text part {name!r}: media must be uploaded as files", index, name)
        else:
            _check_modality(name, index, modalities)
            data = await value.read()
            if len(data) > limits.max_media_bytes:
                raise ServerError(422, "media_too_large", f"{len(data)} bytes, more than "
                                  f"--max-media-bytes {limits.max_media_bytes}", index, name)
            refs.append(MediaRef(name, index, data=data))
    _check_count(len(refs), limits)
    return refs, kwargs


def _read_local(ref: MediaRef, limits: MediaLimits) -> bytes:
    root = limits.local_media_path
    if root is None:
        raise ServerError(422, "path_not_allowed", "local paths are off on this server (start it "
                          "with --allowed-local-media-path)", ref.index, "path")
    assert ref.path is not None
    # Resolve links and '..' first, so the check is on the file that would be read.
    target = Path(os.path.realpath(root / ref.path))
    if not target.is_relative_to(root):
        raise ServerError(422, "path_not_allowed", f"{ref.path!r} is outside "
                          "--allowed-local-media-path", ref.index, "path")
    try:
        with open(target, "rb") as f:
            data = f.read(limits.max_media_bytes + 1)
    except OSError as e:
        raise ServerError(422, "media_fetch_failed", f"cannot read {ref.path!r} "
                          f"({e.strerror or e})", ref.index, "path") from None
    if len(data) > limits.max_media_bytes:
        raise ServerError(422, "media_too_large", f"{ref.path!r} is more than --max-media-bytes "
                          f"{limits.max_media_bytes}", ref.index, "path")
    return data


async def resolve(refs: list[MediaRef], limits: MediaLimits,
                  client: httpx.AsyncClient | None) -> list[tuple[str, bytes]]:
    """Each item's bytes, in order; URLs are fetched concurrently under the fetch policy."""

    async def one(ref: MediaRef) -> bytes:
        if ref.data is not None:
            return ref.data
        if ref.path is not None:
            return _read_local(ref, limits)
        assert ref.url is not None
        if client is None:
            raise ServerError(422, "url_not_allowed", "fetching URLs is off on this server",
                              ref.index, "url")
        return await fetch(ref.url, ref.modality, limits.fetch, client, item=ref.index)

    data = await asyncio.gather(*(one(r) for r in refs))
    return [(r.modality, d) for r, d in zip(refs, data, strict=True)]


def media_counts(media: list[tuple[str, bytes]]) -> Mapping[str, int]:
    counts: dict[str, int] = {}
    for modality, _ in media:
        counts[modality] = counts.get(modality, 0) + 1
    return counts
