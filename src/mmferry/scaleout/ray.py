"""The render and encode servers as one Ray Serve application (extra ``mmferry[ray]``).

Three deployments::

    Ingress   FastAPI: the routes of ``mmferry launch render`` and ``mmferry serve``
      -> Render    CPU replicas, autoscaled: the model's processor, split, hashes (no weights)
      -> Encoder   one GPU each (CPU when none): EncoderRunner + its cache; ``encode`` is a
                   ``@serve.batch`` sized by tokens; requests reach it through
                   :class:`ItemAffinityRouter` (rendezvous hashing on the largest item's hash)

What crosses between deployments is plain data: media bytes and processor kwargs to Render;
back, and on to Encoder, :mod:`mmferry.wire` frames as ``numpy.uint8`` arrays (Ray stores
them out of band and maps them zero-copy on the same node); back from Encoder, the answer's
msgpack metadata frame and one raw embedding buffer per item. No mmferry object is pickled:
each side decodes and checks the frames itself (``wire.decode``, the encode server's
screening: the hash is recomputed, the item checked against the model).

Start it with ``mmferry launch ray --model NAME`` or
``serve run mmferry.scaleout.ray:build_app model_name=NAME`` (both validate the options
with :func:`mmferry.cli.args.validate`). Metrics: every replica records the servers' metrics
(:mod:`mmferry.server.metrics`, ``mmferry:`` read as ``mmferry_``) through
:mod:`ray.serve.metrics`, exported by Ray per node (``ray start --metrics-export-port``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import click
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from mmferry import __version__, wire
from mmferry.errors import MmferryError
from mmferry.scaleout.routing import rank_replicas
from mmferry.server.errors import ServerError, from_exception
from mmferry.server.frames import MEDIA_TYPE, decode_body, encode_body, pack_meta, unpack_meta
from mmferry.server.http import install, read_body
from mmferry.server.metrics import EncodeMetrics, RenderMetrics

__all__ = ["Encoder", "Ingress", "ItemAffinityRouter", "Render", "build_app",
           "create_ingress_app", "mirror_metrics"]

# ---- metrics: the servers' definitions, recorded through Ray Serve ---------------------


class _RayMetric:
    """A :mod:`ray.serve.metrics` metric made from one of the servers' prometheus-client
    metrics (same name, with ``:`` read as ``_``, help, labels, buckets), with the
    ``.labels(...).inc/dec/set/observe`` calls the server code makes. Ray adds the
    deployment, replica and application tags."""

    def __init__(self, prom: Any) -> None:
        from ray.serve import metrics

        # prometheus-client keeps its definition in these attributes; reading them keeps one
        # list of names and buckets (server/metrics.py) for both backends.
        name = prom._name.replace(":", "_")
        self.labelnames = tuple(prom._labelnames)
        kind = prom._type
        if kind == "counter":
            self.metric = metrics.Counter(name, prom._documentation, self.labelnames)
        elif kind == "gauge":
            self.metric = metrics.Gauge(name, prom._documentation, self.labelnames)
        else:
            bounds = [b for b in prom._upper_bounds if math.isfinite(b)]
            self.metric = metrics.Histogram(name, prom._documentation, bounds, self.labelnames)
        self.kind = kind
        self._gauges: dict[tuple[str, ...], float] = {}

    def labels(self, *values: str) -> _Bound:
        return _Bound(self, tuple(str(v) for v in values))


@dataclasses.dataclass(frozen=True)
class _Bound:
    parent: _RayMetric
    values: tuple[str, ...]

    def _tags(self) -> dict[str, str]:
        return dict(zip(self.parent.labelnames, self.values, strict=True))

    def inc(self, amount: float = 1.0) -> None:
        if self.parent.kind == "gauge":
            self.set(self.parent._gauges.get(self.values, 0.0) + amount)
        elif amount:
            self.parent.metric.inc(amount, tags=self._tags())

    def dec(self, amount: float = 1.0) -> None:
        self.inc(-amount)

    def set(self, value: float) -> None:
        self.parent._gauges[self.values] = value
        self.parent.metric.set(value, tags=self._tags())

    def observe(self, value: float) -> None:
        self.parent.metric.observe(value, tags=self._tags())


def mirror_metrics(server_metrics: Any) -> Any:
    """``RenderMetrics`` / ``EncodeMetrics`` whose every metric records through Ray Serve."""
    changes = {f.name: _RayMetric(getattr(server_metrics, f.name))
               for f in dataclasses.fields(server_metrics) if f.name != "registry"}
    return dataclasses.replace(server_metrics, **changes)


# ---- payloads -----------------------------------------------------------------------------


def _arrays(frames: list[Any]) -> list[np.ndarray]:
    """Frames as uint8 arrays (views, no copy): what Ray moves out of band."""
    return [np.frombuffer(memoryview(f).cast("B"), dtype=np.uint8) for f in frames]


def _call_tokens(calls: list[dict[str, Any]]) -> int:
    """``@serve.batch``'s size of a batch of encode calls: their tokens."""
    return sum(int(c["tokens"]) for c in calls)


def _replica_id() -> str:
    """This replica's id (``local`` outside a Ray Serve replica: local testing mode)."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return "local"


def _route_key(pending: PendingRequest | None) -> str | None:
    if pending is None or not pending.args or not isinstance(pending.args[0], Mapping):
        return None
    key = pending.args[0].get("key")
    return key if isinstance(key, str) and key else None


# ---- the router -----------------------------------------------------------------------------


class ItemAffinityRouter(RequestRouter):
    """Ray Serve request router of the Encoder deployment: a request goes to the replica
    that rendezvous hashing ranks first for its route key (the hash of its largest item;
    see :func:`mmferry.scaleout.routing.rank_replicas`), then to ``fallbacks`` next ones;
    when that replica has ``imbalance_threshold`` more requests outstanding (from this
    router) than the least loaded one, load decides. A request without a key (health)
    goes to the least loaded replica."""

    def initialize_state(self, imbalance_threshold: int = 8, fallbacks: int = 2) -> None:
        self.imbalance_threshold = imbalance_threshold
        self.fallbacks = fallbacks
        self._outstanding: dict[ReplicaID, int] = {}
        self._sent: dict[str, ReplicaID] = {}

    def _loads(self, replicas: list[RunningReplica]) -> dict[str, int]:
        return {r.replica_id.unique_id: self._outstanding.get(r.replica_id, 0) for r in replicas}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            # When every rank is full, wait before trying again (else the base class retries
            # at once, in a loop).
            pending_request.routing_context.should_backoff = True
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = self._loads(candidate_replicas)
        key = _route_key(pending_request)
        if key is None:
            ids = list(by_id)
            random.shuffle(ids)
            ids.sort(key=loads.__getitem__)
            return [[by_id[i]] for i in ids[:1 + self.fallbacks]]
        ranked = rank_replicas(key, list(by_id), loads,
                               imbalance_threshold=self.imbalance_threshold,
                               fallbacks=self.fallbacks)
        return [[by_id[i]] for i in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        self._outstanding[replica_id] = self._outstanding.get(replica_id, 0) + 1
        self._sent[pending_request.metadata.internal_request_id] = replica_id

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._sent.pop(internal_request_id, None) is not None:
            self._outstanding[replica_id] = max(0, self._outstanding.get(replica_id, 0) - 1)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        outstanding = getattr(self, "_outstanding", {})  # the base may call this first
        self._outstanding = {k: v for k, v in outstanding.items() if k in live}


# ---- deployments ----------------------------------------------------------------------------


class Render:
    """A render replica: one process, one core (the deployment autoscales; no process pool
    inside). ``render`` answers the render server's worker protocol as frames: frame 0
    ``{"ok": True, "result": {"model", "items"}}`` or ``{"ok": False, status, code, ...}``,
    then, when asked, the items' wire frames."""

    def __init__(self, model_name: str, weights: str | None, max_image_pixels: int) -> None:
        import torch

        from mmferry import models
        from mmferry.items import split_items

        torch.set_num_threads(1)
        self.model_name = model_name
        self.max_image_pixels = max_image_pixels
        self.model = models.load(model_name, weights, materialize=False)
        dummy = self.model.dummy_inputs()
        wire.encode(split_items(dummy, self.model.field_specs(dummy)))  # warm-up
        self.metrics = mirror_metrics(RenderMetrics.create(model_name))

    def render(self, media: list[tuple[str, bytes]], processor_kwargs: dict[str, Any],
               frames: bool) -> list[np.ndarray]:
        from mmferry.server.worker import item_meta, render_media

        start = time.perf_counter()
        try:
            items = render_media(self.model, media, processor_kwargs,
                                 max_image_pixels=self.max_image_pixels)
            result = {"model": self.model_name,
                      "items": [item_meta(self.model, it) for it in items]}
            data = wire.encode(items) if frames else []
            head: dict[str, Any] = {"ok": True, "result": result}
        except Exception as e:  # a request never kills its replica
            err = from_exception(e)
            head, data = {"ok": False, "status": err.status, **err.body()["error"]}, []
        self.metrics.preprocess_latency.labels(self.model_name).observe(
            time.perf_counter() - start)
        return _arrays([pack_meta(head), *data])

    def health(self) -> dict[str, Any]:
        return {"status": "ok"}


class Encoder:
    """An encoder replica: the encode server's runner, cache, owner thread and screening.
    ``encode(call)`` takes ``{"key": route key, "tokens": batch weight, "frames": wire
    frames, "answer_frames": bool}``; calls are batched by ``@serve.batch`` up to
    ``max_batch_tokens`` tokens (its ``batch_size_fn`` sums the calls' tokens) and the
    batch's items run as one job of the owner thread."""

    def __init__(self, model_name: str, weights: str | None, dtype: str, max_batch_tokens: int,
                 batch_wait_ms: float, cache_max_tokens: int) -> None:
        import torch

        from mmferry import models
        from mmferry.cli.serve import weights_revision
        from mmferry.encoder import EncoderCache, EncoderRunner
        from mmferry.server.encode import (
            EncodeConfig,
            EncoderOwner,
            compat_of,
            smallest_dummy_item,
        )

        # Ray sets CUDA_VISIBLE_DEVICES to the replica's GPU; a logical GPU on a machine
        # without one (tests, one-box trials) leaves the replica on the CPU.
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if device.type == "cpu":
            torch.set_num_threads(1)
        folder = None if weights is None else Path(weights)
        model = models.load(model_name, folder, dtype=dtype).to(device).eval()
        self.model = model
        self.cfg = EncodeConfig(model=model_name, weights_revision=weights_revision(folder),
                                max_batch_tokens=max_batch_tokens, batch_wait_ms=batch_wait_ms,
                                cache_max_tokens=cache_max_tokens)
        self.metrics = mirror_metrics(EncodeMetrics.create(model_name))
        self.runner = EncoderRunner(model, EncoderCache(max_tokens=cache_max_tokens),
                                    device=device, max_tokens_per_step=max_batch_tokens)
        # Batches are formed by @serve.batch; the owner runs each as it comes (no wait).
        self.owner = EncoderOwner(self.runner, max_batch_tokens=max_batch_tokens,
                                  batch_wait_ms=0.0, metrics=self.metrics,
                                  model_name=model_name)
        self.compat = compat_of(model, model_name, self.cfg.weights_revision)
        self.health_item = smallest_dummy_item(model)
        self.replica = _replica_id()
        self.batch.set_max_batch_size(max_batch_tokens)
        self.batch.set_batch_wait_timeout_s(batch_wait_ms / 1e3)

    async def encode(self, call: dict[str, Any]) -> list[np.ndarray]:
        return await self.batch(call)

    @serve.batch(max_batch_size=16384, batch_wait_timeout_s=0.005, batch_size_fn=_call_tokens)
    async def batch(self, calls: list[dict[str, Any]]) -> list[list[np.ndarray]]:
        from mmferry.server.encode import answer, screen

        start = time.perf_counter()
        name, m = self.cfg.model, self.metrics
        answers: list[list[np.ndarray] | None] = [None] * len(calls)
        per_call: list[tuple[int, list[Any], list[Any]]] = []
        good, tokens = [], []
        for c, call in enumerate(calls):
            try:
                items = wire.decode(call["frames"]).in_order()
            except MmferryError as e:
                err = from_exception(e)
                answers[c] = _arrays([pack_meta({"ok": False, "status": err.status,
                                                 **err.body()["error"]})])
                continue
            m.embedding_bytes.labels(name, "in").inc(sum(it.nbytes for it in items))
            outcomes, n = screen(self.model, items, self.cfg)
            per_call.append((c, items, outcomes))
            good += [it for it, o in zip(items, outcomes, strict=True) if o is None]
            tokens += n
        # Which cross-request batch answered: for clients tuning --max-batch-tokens.
        batch = {"calls": len(calls), "tokens": _call_tokens(calls)}
        done = await asyncio.wrap_future(self.owner.submit(good, tokens)) if good else []
        at = 0
        for c, _, outcomes in per_call:
            for i, o in enumerate(outcomes):
                if o is None:
                    outcomes[i] = done[at]
                    if done[at].error is not None:
                        done[at].error.item = i
                    at += 1
                m.items.labels(name, outcomes[i].status).inc()
            meta, buffers = answer(outcomes, self.compat, frames=calls[c]["answer_frames"])
            meta.update(ok=True, replica=self.replica, batch=batch)
            m.embedding_bytes.labels(name, "out").inc(sum(b.nbytes for b in buffers))
            answers[c] = _arrays([pack_meta(meta), *buffers])
        elapsed = time.perf_counter() - start
        for _ in calls:
            m.latency.labels(name).observe(elapsed)
        return answers  # type: ignore[return-value]

    async def lookup(self, call: dict[str, Any]) -> bool:
        key, cache = self.runner.cache_key(call["key"]), self.runner.cache
        return await asyncio.wrap_future(self.owner.call(lambda: key in cache))

    async def embedding(self, call: dict[str, Any]) -> list[np.ndarray] | None:
        from mmferry.server.encode import embedding_frames

        key, cache = self.runner.cache_key(call["key"]), self.runner.cache
        rows = await asyncio.wrap_future(self.owner.call(
            lambda: cache.get(key) if key in cache else None))
        if rows is None:
            return None
        return _arrays(embedding_frames(rows, call["key"], self.compat, replica=self.replica))

    async def health(self, call: dict[str, Any]) -> dict[str, Any]:
        from mmferry.server.encode import probe_encode

        rows = await asyncio.wait_for(asyncio.wrap_future(self.owner.call(
            lambda: probe_encode(self.runner, self.health_item))), 30)
        return {"status": "ok", "compat": self.compat, "probe_rows": rows,
                "replica": self.replica}

    def __del__(self) -> None:
        owner = getattr(self, "owner", None)
        if owner is not None:
            owner.stop()


# ---- the ingress ----------------------------------------------------------------------------


def _body(frames: list[Any]) -> bytes:
    return b"".join(encode_body(frames))


def _raise_if_error(meta: dict[str, Any]) -> dict[str, Any]:
    if not meta.get("ok", True):
        raise ServerError(int(meta["status"]), str(meta["code"]), str(meta["message"]),
                          meta.get("item"), meta.get("field"))
    return meta


def create_ingress_app(options: Mapping[str, Any], render: Any, encoder: Any) -> FastAPI:
    """The FastAPI app of the ingress: the render server's and the encode server's routes
    over ``render`` and ``encoder`` (Ray Serve deployment handles, or anything with the
    same ``.method.remote(...)`` calls). ``options``: validated ``mmferry launch ray``
    options."""
    from mmferry import models
    from mmferry.cli.args import pixel_options
    from mmferry.cli.launch import media_limits
    from mmferry.server.encode import read_hashes, wants_frames_answer
    from mmferry.server.media import resolve
    from mmferry.server.render import content_type, parse_media_request, wants_frames

    model_name = options["model_name"]
    weights = options.get("weights")
    # The processor side only: token counts of client items, for routing and batching.
    model = models.load(model_name, weights, materialize=False)
    modalities = tuple(model.modalities)
    limits = media_limits(dict(options))
    max_request_bytes = options["max_request_bytes"]
    max_batch_tokens = options["max_batch_tokens"]
    accept_media = bool(options.get("accept_media"))
    processor_defaults = pixel_options(options)  # a request's processor_kwargs override them
    render_metrics = mirror_metrics(RenderMetrics.create(model_name))
    encode_metrics = mirror_metrics(EncodeMetrics.create(model_name))
    state: dict[str, Any] = {"http": None}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if limits.fetch.enabled:
            import httpx

            state["http"] = httpx.AsyncClient(trust_env=False, timeout=None)
        try:
            yield
        finally:
            if state["http"] is not None:
                await state["http"].aclose()

    app = FastAPI(title="mmferry on Ray Serve", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)

    def count(path: str, status: int) -> None:
        if path == "/v1/render":
            render_metrics.requests.labels(model_name, str(status)).inc()
        elif path == "/v1/encode":
            encode_metrics.requests.labels(model_name, str(status)).inc()

    install(app, api_keys=tuple(options.get("api_keys") or ()), headers=dict, on_status=count)

    async def rendered(request: Request, frames: bool) -> tuple[dict[str, Any], list[Any]]:
        try:
            refs, kwargs = await parse_media_request(request, limits, max_request_bytes,
                                                     modalities)
            render_metrics.items.labels(model_name).observe(len(refs))
            media = await resolve(refs, limits, state["http"])
        except ServerError as e:
            render_metrics.rejected.labels(model_name, e.code).inc()
            raise
        for modality, data in media:
            render_metrics.fetch_bytes.labels(model_name, modality).inc(len(data))
        out = await render.render.remote(media, {**processor_defaults, **kwargs}, frames)
        return _raise_if_error(unpack_meta(out[0]))["result"], list(out[1:])

    @app.post("/v1/render")
    async def render_route(request: Request) -> Response:
        start = time.perf_counter()
        frames = wants_frames(request)
        result, data = await rendered(request, frames)
        if frames:
            body = _body([pack_meta(result), *data])
            render_metrics.wire_bytes.labels(model_name, "frames").inc(len(body))
            response: Response = Response(body, media_type=MEDIA_TYPE)
        else:
            response = JSONResponse(result)
            render_metrics.wire_bytes.labels(model_name, "json").inc(len(response.body))
        render_metrics.latency.labels(model_name).observe(time.perf_counter() - start)
        return response

    def route(hashes: list[str], counts: list[int]) -> tuple[str, int]:
        """The route key (the hash of the item with most tokens) and the call's batch
        weight: its tokens, at most one batch (a larger call is a batch of its own, split
        into steps by the runner)."""
        key = hashes[max(range(len(hashes)), key=counts.__getitem__)] if hashes else ""
        return key, max(1, min(sum(counts), max_batch_tokens))

    def tokens_of(item: Any) -> int:
        try:
            return int(model.tokens_per_item(item))
        except Exception:  # the encoder's screening names the problem
            return 0

    @app.post("/v1/encode")
    async def encode_route(request: Request) -> Response:
        kind = content_type(request)
        if kind == MEDIA_TYPE:
            body = await read_body(request, max_request_bytes)
            try:
                frames = decode_body(body)
                unpack_meta(frames[0])
                items = wire.decode(frames[1:]).in_order()
            except MmferryError as e:
                raise from_exception(e) from None
            data = frames[1:]
            hashes = [it.hash for it in items]
            counts = [tokens_of(it) for it in items]
        elif kind in ("application/json", "multipart/form-data") and accept_media:
            result, data = await rendered(request, True)
            hashes = [m["hash"] for m in result["items"]]
            counts = [int(m["num_tokens"]) for m in result["items"]]
        else:
            accepted = MEDIA_TYPE + (", application/json, multipart/form-data"
                                     if accept_media else "")
            raise ServerError(415, "unsupported_media_type",
                              f"content type {kind or 'none'!r}; send {accepted}")
        key, tokens = route(hashes, counts)
        frames_answer = wants_frames_answer(request.headers.get("accept", ""))
        out = await encoder.encode.remote({"key": key, "tokens": tokens, "frames": _arrays(data),
                                           "answer_frames": frames_answer})
        meta = _raise_if_error(unpack_meta(out[0]))
        headers = {"X-Mmferry-Compat": meta["compat"]["id"]}
        if not frames_answer:
            return JSONResponse({k: meta[k] for k in ("compat", "items", "replica", "batch")},
                                headers=headers)
        return Response(_body(out), media_type=MEDIA_TYPE, headers=headers)

    @app.post("/v1/embeddings:lookup")
    async def lookup(request: Request) -> Response:
        hashes = await read_hashes(request)
        # Each hash asks the replica its own key routes to: where it would have been cached.
        present = await asyncio.gather(*(encoder.lookup.remote({"key": h}) for h in hashes))
        return JSONResponse({"present": [h for h, p in zip(hashes, present, strict=True) if p],
                             "missing": [h for h, p in zip(hashes, present, strict=True) if not p]})

    @app.get("/v1/embeddings/{key}")
    async def embedding(key: str) -> Response:
        out = await encoder.embedding.remote({"key": key})
        if out is None:
            raise ServerError(404, "not_found", f"no cached embedding {key[:16]}... (never "
                              "encoded, evicted, or held by a replica it no longer routes to)",
                              field="hash")
        return Response(_body(out), media_type=MEDIA_TYPE)

    @app.get("/health")
    async def health() -> Response:
        try:
            enc, ren = await asyncio.wait_for(asyncio.gather(
                encoder.health.remote({}), render.health.remote()), 60)
        except Exception as e:
            return JSONResponse(ServerError(503, "unhealthy", f"{type(e).__name__}: {e}").body(),
                                status_code=503)
        return JSONResponse({"status": "ok", "encoder": enc, "render": ren})

    @app.get("/v1/models")
    async def list_models() -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "modalities": list(modalities)}]})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return PlainTextResponse(
            "# mmferry on Ray Serve: every replica records its metrics (mmferry_*, tagged with "
            "deployment and replica)\n# through Ray's metrics export: scrape each node's "
            "metrics-export port (ray start --metrics-export-port PORT).\n")

    return app


@serve.ingress()
class Ingress:
    """The HTTP entry: :func:`create_ingress_app` over the Render and Encoder handles."""

    def __init__(self, render: Any, encoder: Any, options: dict[str, Any]) -> None:
        self._app = create_ingress_app(options, render, encoder)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self._app


# ---- the application --------------------------------------------------------------------------

#: Options of ``mmferry launch ray`` that shape the deployments (not the ingress's).
RAY_OPTIONS = frozenset({"min_render_replicas", "max_render_replicas", "render_cpus",
                         "encoder_replicas", "encoder_gpus", "encoder_cpus", "ingress_cpus",
                         "router", "imbalance_threshold", "ray_address"})


def _defaults() -> dict[str, Any]:
    """Every option of ``mmferry launch ray`` at its default (the click definitions)."""
    from mmferry.cli.launch import ray_command

    with ray_command.make_context("ray", [], resilient_parsing=True) as ctx:
        return dict(ctx.params)


def build_app(args: Mapping[str, Any] | None = None) -> Any:
    """The Ray Serve application for ``args`` (``mmferry launch ray`` options by their
    option names, e.g. ``model_name``; the rest at their defaults), validated by
    :func:`mmferry.cli.args.validate`. Also the ``serve run`` builder:
    ``serve run mmferry.scaleout.ray:build_app model_name=qwen2-vl encoder_gpus=0``."""
    from mmferry.cli.args import validate
    from mmferry.cli.launch import ray_command
    from mmferry.errors import ArgumentError

    defaults = _defaults()
    raw = {**defaults, **dict(args or {})}
    unknown = set(raw) - set(defaults)
    if unknown:
        raise ArgumentError(f"unknown option {sorted(unknown)[0]!r}", argument=sorted(unknown)[0])
    for param in ray_command.params:  # `serve run` passes every value as a string
        value = raw.get(param.name)  # type: ignore[arg-type]
        if isinstance(value, str) and param.name in (args or {}):
            try:
                value = param.type.convert(value, param, None)
            except click.BadParameter as e:
                raise ArgumentError(str(e.message), argument=param.name) from None
            raw[param.name] = (value,) if param.multiple else value  # type: ignore[index]
    ns = validate(raw)
    return application(ns)


def application(ns: Mapping[str, Any]) -> Any:
    """The application for validated options ``ns``."""
    weights = None if ns["weights"] is None else str(ns["weights"])
    render = serve.deployment(Render, name="Render", max_ongoing_requests=4,
                              ray_actor_options={"num_cpus": ns["render_cpus"]},
                              autoscaling_config=AutoscalingConfig(
                                  min_replicas=ns["min_render_replicas"],
                                  max_replicas=ns["max_render_replicas"],
                                  target_ongoing_requests=2))
    router = None
    if ns["router"] == "affinity":
        router = RequestRouterConfig(
            request_router_class=ItemAffinityRouter,
            request_router_kwargs={"imbalance_threshold": ns["imbalance_threshold"]})
    encoder_gpus = ns["encoder_gpus"]
    if encoder_gpus is None:  # one GPU per replica where the cluster has GPUs, else the CPU
        import ray

        has_gpu = ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1
        encoder_gpus = 1.0 if has_gpu else 0.0
    encoder = serve.deployment(Encoder, name="Encoder", num_replicas=ns["encoder_replicas"],
                               max_ongoing_requests=64,
                               ray_actor_options={"num_cpus": ns["encoder_cpus"],
                                                  "num_gpus": encoder_gpus},
                               **({"request_router_config": router} if router else {}))
    ingress = serve.deployment(Ingress, name="Ingress", max_ongoing_requests=256,
                               ray_actor_options={"num_cpus": ns["ingress_cpus"]})
    options = {k: v for k, v in ns.items() if k not in RAY_OPTIONS}
    return ingress.bind(
        render.bind(ns["model_name"], weights, ns["max_image_pixels"]),
        encoder.bind(ns["model_name"], weights, ns["dtype"], ns["max_batch_tokens"],
                     ns["batch_wait_ms"], ns["cache_max_tokens"]),
        options)


def __getattr__(name: str) -> Any:
    # `serve run mmferry.scaleout.ray:app`: the defaults, built when asked for.
    if name == "app":
        return build_app()
    raise AttributeError(name)
