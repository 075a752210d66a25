"""A small client of the two servers, so callers never hand-write the framing.

>>> with Client("http://127.0.0.1:8100") as render, Client("http://127.0.0.1:8200") as enc:
...     rendered = render.render(images=[open("cat.jpg", "rb").read()])
...     answers = enc.encode(rendered.items)          # one Answer per item, in order
...     answers[0].rows                               # [tokens, hidden] embedding rows

Media bytes travel as multipart uploads (no base64); items and embeddings as frames
(:mod:`mmferry.server.frames`). A server's error answer raises :class:`ClientError` with its
status, code, item and field; per-item errors of ``encode`` come back in the answers.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

from mmferry import wire
from mmferry.items import Item, Items
from mmferry.server.errors import ServerError
from mmferry.server.frames import MEDIA_TYPE, decode_body, encode_body, pack_meta, unpack_meta

__all__ = ["Answer", "Client", "ClientError", "Rendered"]

ClientError = ServerError
"""What a server answered instead of a result: ``status``, ``code``, ``message``, ``item``,
``field`` (also raised for transport failures, with status 0)."""

MediaSource = bytes | str | os.PathLike


@dataclass(frozen=True)
class Rendered:
    """What ``/v1/render`` answered: per item its metadata (``modality``, ``hash``,
    ``num_tokens``, ``nbytes``) and, when frames were asked for, the items in request order."""

    meta: list[dict[str, Any]]
    items: list[Item] = field(default_factory=list)
    body: bytes = b""  # the frames body as it came: POST it to /v1/encode unchanged


@dataclass(frozen=True)
class Answer:
    """One item's answer from ``/v1/encode``."""

    hash: str
    status: str  # hit, miss or error
    num_tokens: int
    rows: torch.Tensor | None = None
    error: ServerError | None = None


_DTYPES = {str(dt).removeprefix("torch."): dt for dt in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64)}


def _tensor(meta: Mapping[str, Any], frame: memoryview) -> torch.Tensor:
    dtype = _DTYPES.get(str(meta.get("dtype")))
    shape = meta.get("shape")
    if dtype is None or not isinstance(shape, list):
        raise ServerError(0, "bad_response", f"bad embedding metadata {dict(meta)}")
    raw = torch.frombuffer(bytearray(frame), dtype=torch.uint8) if frame.nbytes else \
        torch.empty(0, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


class _StdlibTransport(httpx.BaseTransport):
    """HTTP/1.1 for httpx over :mod:`http.client`, kept-alive connections pooled per origin.

    httpx's own transport parses a response body 64 KiB at a time through h11: about 9 ms of
    CPU per 4.8 MB body here (a 448x448 image's pixels), against under 1 ms for one
    ``read`` of a Content-Length body from a buffered socket. Frames bodies are megabytes,
    so this is most of the client's cost."""

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._idle: dict[tuple[str, str, int], list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()

    def _connect(self, key: tuple[str, str, int]) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            idle = self._idle.get(key)
            if idle:
                return idle.pop(), True
        scheme, host, port = key
        cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
        conn = cls(host, port, timeout=self._timeout)
        conn.connect()
        # Headers and body are separate writes: without this they wait on a delayed ACK.
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn, False

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        key = (url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80))
        body = request.read()
        for attempt in (0, 1):
            conn, reused = self._connect(key)
            try:
                conn.putrequest(request.method, url.raw_path.decode("ascii"), skip_host=True,
                                skip_accept_encoding=True)
                for name, value in request.headers.raw:
                    conn.putheader(name.decode("latin-1"), value.decode("latin-1"))
                conn.endheaders(body or None)
                response = conn.getresponse()
                content = response.read()
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                if reused and attempt == 0:  # a kept-alive connection the server had closed
                    continue
                raise httpx.TransportError(f"{type(e).__name__}: {e}") from None
            if response.will_close:
                conn.close()
            else:
                with self._lock:
                    self._idle.setdefault(key, []).append(conn)
            return httpx.Response(response.status, headers=response.getheaders(),
                                  content=content, request=request)
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            for conns in self._idle.values():
                for conn in conns:
                    conn.close()
            self._idle.clear()


class Client:
    """One server at ``url`` (render or encode); ``api_key`` sent as a bearer token."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout: float = 120.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout,
                                  trust_env=False, transport=_StdlibTransport(timeout))
        self.compat: dict[str, Any] | None = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            raise ServerError(0, "transport", f"{self.url}{path}: {type(e).__name__} {e}") from None
        if response.status_code >= 400:
            try:
                body = response.json()
            except ValueError:
                body = None
            raise ServerError.from_body(response.status_code, body)
        return response

    # ---- render server ----

    def render(self, *, images: Sequence[MediaSource] = (), videos: Sequence[MediaSource] = (),
               audios: Sequence[MediaSource] = (), urls: Sequence[tuple[str, str]] = (),
               processor_kwargs: Mapping[str, Any] | None = None, items: bool = True) -> Rendered:
        """Render media: bytes or local files (uploaded), ``urls`` as ``(modality, url)``
        (fetched by the server). Request order: images, videos, audios, urls. ``items=False``
        asks for metadata only (JSON)."""
        files: list[tuple[str, Any]] = []
        for modality, sources in (("image", images), ("video", videos), ("audio", audios)):
            for i, src in enumerate(sources):
                data = src if isinstance(src, bytes) else Path(src).read_bytes()
                files.append((modality, (f"{modality}{i}", data, "application/octet-stream")))
        form: list[tuple[str, Any]] = [
            ("media", (None, json.dumps({"modality": m, "url": u}), "application/json"))
            for m, u in urls]
        if processor_kwargs:
            form.append(("processor_kwargs", (None, json.dumps(dict(processor_kwargs)),
                                              "application/json")))
        accept = MEDIA_TYPE if items else "application/json"
        response = self._send("POST", "/v1/render", files=files + form,
                              headers={"Accept": accept})
        if not items:
            return Rendered(meta=response.json()["items"])
        return self.read_rendered(response.content)

    @staticmethod
    def read_rendered(body: bytes) -> Rendered:
        frames = decode_body(body)
        meta = unpack_meta(frames[0])["items"]
        by_hash = {it.hash: it for it in wire.decode(frames[1:]).in_order()}
        return Rendered(meta=meta, items=[by_hash[m["hash"]] for m in meta], body=body)

    # ---- encode server ----

    def encode(self, items: Sequence[Item] | Items | Rendered) -> list[Answer]:
        """Encode items on the server: one :class:`Answer` per item, in order."""
        if isinstance(items, Rendered):
            body, hashes = items.body, [m["hash"] for m in items.meta]
        else:
            seq = items.in_order() if isinstance(items, Items) else list(items)
            hashes = [it.hash for it in seq]
            body = b"".join(encode_body([pack_meta({}), *wire.encode(seq)]))
        response = self._send("POST", "/v1/encode", content=body,
                              headers={"Content-Type": MEDIA_TYPE, "Accept": MEDIA_TYPE})
        frames = decode_body(response.content)
        meta = unpack_meta(frames[0])
        self.compat = meta.get("compat")
        answers: dict[str, list[Answer]] = {}
        for entry in meta["items"]:
            rows = _tensor(entry, frames[entry["frame"]]) if "frame" in entry else None
            err = entry.get("error")
            answers.setdefault(entry["hash"], []).append(Answer(
                entry["hash"], entry["status"], entry["num_tokens"], rows,
                ServerError.from_body(422, {"error": err}) if err else None))
        # The server answers modality by modality; items of one hash keep their order.
        return [answers[h].pop(0) for h in hashes]

    def lookup(self, hashes: Sequence[str]) -> dict[str, list[str]]:
        """Which hashes the server's encoder cache holds: ``{"present": [...], "missing": [...]}``."""
        body = self._send("POST", "/v1/embeddings:lookup", json={"hashes": list(hashes)}).json()
        return {"present": body["present"], "missing": body["missing"]}

    def embedding(self, key: str) -> torch.Tensor | None:
        """The cached rows of item ``key``; ``None`` when not cached (or evicted)."""
        try:
            response = self._send("GET", f"/v1/embeddings/{key}")
        except ServerError as e:
            if e.status == 404:
                return None
            raise
        frames = decode_body(response.content)
        return _tensor(unpack_meta(frames[0]), frames[1])

    # ---- both ----

    def health(self) -> dict[str, Any]:
        return self._send("GET", "/health").json()

    def models(self) -> list[dict[str, Any]]:
        return self._send("GET", "/v1/models").json()["data"]

    def metrics(self) -> str:
        return self._send("GET", "/metrics").text
