"""What both servers share: bounded body reading, the error answers, the API key, and
starting uvicorn on a socket bound here (so ``--port 0`` works and the bound address is
printed)."""

from __future__ import annotations

import hmac
import socket
import sys
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from mmferry.server.errors import ServerError

__all__ = ["error_response", "install", "read_body", "replay", "serve"]


def error_response(err: ServerError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers={**dict(err.headers),
                                                                     **(headers or {})})


async def read_body(request: Request, limit: int) -> bytes | bytearray:
    """The body, refused with 413 as soon as it passes ``limit`` bytes (declared or streamed).
    With a declared length the chunks land in one buffer of that size (no join)."""
    declared = request.headers.get("content-length")
    too_large = ServerError(413, "payload_too_large", f"request body is more than "
                            f"--max-request-bytes {limit}")
    size = int(declared) if declared is not None and declared.isdigit() else None
    if size is not None and size > limit:
        raise too_large
    buf = bytearray(size or 0)
    total = 0
    async for chunk in request.stream():
        n = len(chunk)
        if total + n > limit:
            raise too_large
        if size is not None and total + n <= size:
            buf[total:total + n] = chunk
        else:
            buf += chunk
        total += n
    if size is not None and total != size:
        raise ServerError(400, "bad_request", f"body of {total} bytes, {size} declared")
    return buf


def replay(request: Request, body: bytes | bytearray) -> Request:
    """A request whose body is ``body`` (already read within the cap), for form parsing."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": bytes(body), "more_body": False}

    return Request(request.scope, receive)


def install(app: FastAPI, *, api_keys: tuple[str, ...], headers: Callable[[], dict[str, str]],
            on_status: Callable[[str, int], None] | None = None) -> None:
    """Error handlers in the ``{"error": ...}`` shape, the API key on ``/v1/`` routes, and
    ``headers()`` on every response."""

    @app.exception_handler(ServerError)
    async def _server_error(request: Request, exc: ServerError) -> Response:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "bad_request")
        return error_response(ServerError(exc.status_code, code, str(exc.detail)))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(ServerError(400, "bad_request", str(exc.errors())[:500]))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        return error_response(ServerError(500, "internal", f"{type(exc).__name__}: {exc}"))

    app.add_middleware(_Guard, api_keys=api_keys, headers=headers, on_status=on_status)


class _Guard:
    """Plain ASGI (no per-request task or body buffering): the API key on ``/v1/`` routes,
    the extra headers on every response, and the status reported to ``on_status``."""

    def __init__(self, app: Any, *, api_keys: tuple[str, ...],
                 headers: Callable[[], dict[str, str]],
                 on_status: Callable[[str, int], None] | None) -> None:
        self.app = app
        self.keys = [k.encode() for k in api_keys]
        self.headers = headers
        self.on_status = on_status

    def _authorized(self, scope: dict[str, Any]) -> bool:
        given = dict(scope["headers"]).get(b"authorization", b"")
        token = given[7:] if given[:7].lower() == b"bearer " else b""
        return any(hmac.compare_digest(token, k) for k in self.keys)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        extra = [(k.lower().encode(), v.encode()) for k, v in self.headers().items()]
        status = 500

        async def send_with_headers(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        try:
            if self.keys and path.startswith("/v1/") and not self._authorized(scope):
                response = error_response(ServerError(
                    401, "unauthorized", "missing or wrong API key (Authorization: Bearer KEY)"))
                await response(scope, receive, send_with_headers)
            else:
                await self.app(scope, receive, send_with_headers)
        finally:
            if self.on_status is not None:
                self.on_status(path, status)


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _keys(app: FastAPI) -> list[bytes]:
    return [k for m in app.user_middleware if m.cls is _Guard for k in m.kwargs["api_keys"]]


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are
    # TCP, and without it a response's header and body writes wait on the client's delayed
    # ACK (~40 ms a request on a kept-alive connection).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(app: FastAPI, host: str, port: int, *, name: str) -> None:
    """Bind ``host:port``, print ``<name>: listening on http://HOST:PORT`` (the real port
    when ``port`` is 0) and run until interrupted."""
    import uvicorn

    sock = bind(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    if not _loopback(host) and not any(True for _ in _keys(app)):
        print(f"{name}: warning: listening on {host} without --api-key; anyone who can reach "
              "it can use it", file=sys.stderr, flush=True)
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    print(f"{name}: listening on http://{shown}:{bound_port}", flush=True)
    # h11 whatever else is installed: it caps a request's header block (64 KiB here); the
    # httptools parser has no such cap.
    config = uvicorn.Config(app, http="h11", log_level="warning", access_log=False,
                            timeout_graceful_shutdown=2, h11_max_incomplete_event_size=64 << 10)
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        sys.stdout.flush()
