"""``mmferry launch render``: the GPU-less render server.

``POST /v1/render`` takes media (JSON or multipart), fetches what it may under the fetch
policy, and renders it in a process pool: the model's processor, the per-item split and
the hashes, never the model's weights. It answers per item its modality, hash, token count
and payload bytes (JSON), or, with ``Accept: application/vnd.mmferry.frames``, the items
themselves as :mod:`mmferry.wire` frames in one binary body (which ``POST /v1/encode`` of
the encode server takes as it is). Past ``max_inflight`` admitted requests it answers 503
with ``Retry-After`` at once rather than queueing.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from mmferry import __version__
from mmferry.server.errors import ServerError
from mmferry.server.frames import MEDIA_TYPE
from mmferry.server.http import error_response, install, read_body, replay
from mmferry.server.media import MediaLimits, parse_json, parse_multipart, resolve
from mmferry.server.metrics import RenderMetrics, exposition
from mmferry.server.worker import RenderJob, WorkerPool

__all__ = ["RenderConfig", "create_app", "wants_frames"]


@dataclass(frozen=True)
class RenderConfig:
    model: str
    modalities: tuple[str, ...]
    weights: str | None = None
    workers: int = 1
    max_inflight: int = 8
    max_request_bytes: int = 64 << 20
    limits: MediaLimits = field(default_factory=MediaLimits)
    api_keys: tuple[str, ...] = ()
    # Processor keywords a request's processor_kwargs override (the pixel options).
    processor_defaults: Mapping[str, Any] = field(default_factory=dict)


def wants_frames(request: Request) -> bool:
    return MEDIA_TYPE in request.headers.get("accept", "")


def content_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


async def parse_media_request(request: Request, cfg_limits: MediaLimits, max_request_bytes: int,
                              modalities: tuple[str, ...]) -> tuple[list[Any], dict[str, Any]]:
    """The media entries and processor kwargs of a JSON or multipart render request."""
    kind = content_type(request)
    if kind not in ("application/json", "multipart/form-data"):
        raise ServerError(415, "unsupported_media_type", f"content type {kind or 'none'!r}; send "
                          "application/json or multipart/form-data")
    body = await read_body(request, max_request_bytes)
    if kind == "application/json":
        return parse_json(body, cfg_limits, modalities)
    form = await replay(request, body).form(max_files=cfg_limits.max_items + 1,
                                            max_fields=cfg_limits.max_items + 2,
                                            max_part_size=max_request_bytes)
    try:
        return await parse_multipart(form, cfg_limits, modalities)
    finally:
        await form.close()


def create_app(cfg: RenderConfig) -> FastAPI:
    metrics = RenderMetrics.create(cfg.model)
    pool = WorkerPool(cfg.workers, cfg.model, cfg.weights, cfg.limits.max_image_pixels,
                      on_restart=metrics.worker_restarts.labels(cfg.model).inc)
    state: dict[str, Any] = {"inflight": 0, "http": None}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if cfg.limits.fetch.enabled:
            # No proxies from the environment: the connection must go to the checked address.
            state["http"] = httpx.AsyncClient(trust_env=False, timeout=None)
        await pool.start()
        try:
            yield
        finally:
            pool.close()
            if state["http"] is not None:
                await state["http"].aclose()

    app = FastAPI(title="mmferry render", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)

    def count(path: str, status: int) -> None:
        if path == "/v1/render":
            metrics.requests.labels(cfg.model, str(status)).inc()

    install(app, api_keys=cfg.api_keys, headers=dict, on_status=count)

    @app.post("/v1/render")
    async def render(request: Request) -> Response:
        if state["inflight"] >= cfg.max_inflight:
            metrics.rejected.labels(cfg.model, "overloaded").inc()
            return error_response(ServerError(503, "overloaded", f"{cfg.max_inflight} requests "
                                              "in flight (--max-inflight); retry"),
                                  headers={"Retry-After": "1"})
        state["inflight"] += 1
        metrics.inflight.labels(cfg.model).inc()
        start = time.perf_counter()
        try:
            refs, kwargs = await parse_media_request(request, cfg.limits, cfg.max_request_bytes,
                                                     cfg.modalities)
            metrics.items.labels(cfg.model).observe(len(refs))
            t = time.perf_counter()
            media = await resolve(refs, cfg.limits, state["http"])
            if any(r.data is None for r in refs):
                metrics.fetch_latency.labels(cfg.model).observe(time.perf_counter() - t)
            for modality, data in media:
                metrics.fetch_bytes.labels(cfg.model, modality).inc(len(data))
            t = time.perf_counter()
            result, body = await pool.run(RenderJob(media, {**cfg.processor_defaults, **kwargs},
                                                    frames=wants_frames(request)))
            metrics.preprocess_latency.labels(cfg.model).observe(time.perf_counter() - t)
        except ServerError as e:
            if e.status < 500:
                metrics.rejected.labels(cfg.model, e.code).inc()
            raise
        finally:
            state["inflight"] -= 1
            metrics.inflight.labels(cfg.model).dec()
        if body is not None:
            metrics.wire_bytes.labels(cfg.model, "frames").inc(len(body))
            response: Response = Response(body, media_type=MEDIA_TYPE)
        else:
            response = JSONResponse(result)
            metrics.wire_bytes.labels(cfg.model, "json").inc(len(response.body))
        metrics.latency.labels(cfg.model).observe(time.perf_counter() - start)
        return response

    @app.get("/health")
    async def health() -> Response:
        if not pool.ready:
            return error_response(ServerError(503, "warming_up", "workers are warming up"))
        return JSONResponse({"status": "ok", "workers": pool.pids, "restarts": pool.restarts})

    @app.get("/v1/models")
    async def list_models() -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": cfg.model, "object": "model", "modalities": list(cfg.modalities)}]})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(exposition(metrics.registry), media_type="text/plain; version=0.0.4")

    return app
