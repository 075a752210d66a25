"""Errors as the servers answer them: ``{"error": {"code", "message", "item", "field"}}``.

A 4xx is anything the client sent (400 a malformed request, 401 a missing key, 404 nothing
there, 413 too large, 415 the wrong content type, 422 media that cannot be fetched, decoded
or is not allowed, 503 overloaded); a 5xx only a fault of the server itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from mmferry.errors import (
    ArgumentError,
    ContractError,
    EncoderCacheError,
    MediaError,
    MmferryError,
    WireError,
)

__all__ = ["ServerError", "from_exception", "item_of_source"]


@dataclass
class ServerError(Exception):
    """An error answer: HTTP ``status``, a stable ``code``, a message, and where it applies
    (``item``: the request index of the media or item; ``field``: a request or tensor field)."""

    status: int
    code: str
    message: str
    item: int | None = None
    field: str | None = None
    headers: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        return f"{self.status} {self.code}: {self.message}"

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message, "item": self.item,
                          "field": self.field}}

    @classmethod
    def from_body(cls, status: int, body: Any) -> ServerError:
        err = body.get("error") if isinstance(body, dict) else None
        if not isinstance(err, dict):
            return cls(status, "bad_response", f"server answered {status} without an error body")
        return cls(status, str(err.get("code")), str(err.get("message")), err.get("item"),
                   err.get("field"))


_ITEM = re.compile(r"item (\d+)")


def item_of_source(source: str | None) -> int | None:
    """The index in ``item N`` (how media errors name in-memory sources)."""
    m = _ITEM.match(source or "")
    return int(m.group(1)) if m else None


def from_exception(e: BaseException, *, item: int | None = None) -> ServerError:
    """The answer for a typed mmferry error raised while handling the client's input."""
    if isinstance(e, ServerError):
        return e
    if isinstance(e, MediaError):
        code = "pixels_exceed_limit" if "pixels, above the limit" in str(e) or "bomb" in str(e) \
            else "media_decode_failed"
        idx = item if item is not None else item_of_source(e.source)
        return ServerError(422, code, str(e), idx)
    if isinstance(e, WireError):
        return ServerError(400, "bad_frames", str(e), item)
    if isinstance(e, ContractError):
        return ServerError(422, "invalid_item", str(e), item, e.field)
    if isinstance(e, EncoderCacheError):
        return ServerError(413, "item_too_large", str(e), item)
    if isinstance(e, ArgumentError):
        return ServerError(400, "bad_request", str(e), item, e.argument)
    if isinstance(e, MmferryError):
        return ServerError(400, "bad_request", str(e), item)
    return ServerError(500, "internal", f"{type(e).__name__}: {e}", item)
