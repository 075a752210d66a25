"""``mmferry serve``: the encoder server.

``POST /v1/encode`` takes rendered items (a frames body: the render server's response as
it is) and answers, per item, its hash, status (``hit``, ``miss`` or ``error`` with a code),
token count and embedding rows. Items of requests that arrive together are batched across
requests by tokens (``max_batch_tokens``, waiting at most ``batch_wait_ms`` for company)
and encoded by one :class:`~mmferry.encoder.EncoderRunner` with one cache for every request.
The runner and its cache are not thread-safe, so one thread owns them: the
:class:`EncoderOwner` runs every batch, lookup and health encode in turn.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from mmferry import __version__, wire
from mmferry.encoder import EncoderCache, EncoderRunner
from mmferry.encoder.model import EncoderModel
from mmferry.errors import MmferryError
from mmferry.hashing import hash_item
from mmferry.items import Item, split_items
from mmferry.server.errors import ServerError, from_exception
from mmferry.server.frames import MEDIA_TYPE, decode_body, encode_body, pack_meta, unpack_meta
from mmferry.server.http import install, read_body
from mmferry.server.media import MediaLimits, resolve
from mmferry.server.metrics import EncodeMetrics, exposition
from mmferry.server.render import content_type, parse_media_request
from mmferry.server.worker import render_media

__all__ = ["EncodeConfig", "EncoderOwner", "Outcome", "answer", "compat_of", "create_app",
           "encode_items", "probe_encode", "screen", "smallest_dummy_item",
           "wants_frames_answer"]


@dataclass(frozen=True)
class EncodeConfig:
    model: str
    weights_revision: str
    max_batch_tokens: int = 16384
    batch_wait_ms: float = 5.0
    cache_max_tokens: int = 1 << 20
    max_request_bytes: int = 256 << 20
    accept_media: bool = False
    limits: MediaLimits = field(default_factory=MediaLimits)
    api_keys: tuple[str, ...] = ()


def compat_of(model: EncoderModel, model_name: str, weights_revision: str) -> dict[str, Any]:
    """What a consumer of these embeddings must match: model, weights, dtype, width, version."""
    param = next(iter(model.parameters()), None) if isinstance(model, torch.nn.Module) else None
    dtype = str(param.dtype).removeprefix("torch.") if param is not None else "float32"
    value = {"model": model_name, "weights": weights_revision, "dtype": dtype,
             "hidden_size": int(model.hidden_size), "mmferry": __version__}
    from blake3 import blake3

    value["id"] = blake3(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]
    return value


@dataclass
class Outcome:
    """One item's answer: ``status`` hit / miss / error, its rows or its error."""

    hash: str
    status: str
    num_tokens: int = 0
    rows: torch.Tensor | None = None
    error: ServerError | None = None


@dataclass
class _Job:
    items: list[Item]
    tokens: list[int]
    future: Future[list[Outcome]]
    queued: float


class EncoderOwner:
    """The one thread that drives the runner and its cache."""

    def __init__(self, runner: EncoderRunner, *, max_batch_tokens: int, batch_wait_ms: float,
                 metrics: EncodeMetrics, model_name: str) -> None:
        self.runner = runner
        self.max_batch_tokens = max_batch_tokens
        self.batch_wait = batch_wait_ms / 1e3
        self.metrics = metrics
        self.model_name = model_name
        self._queue: queue.Queue[Any] = queue.Queue()
        self._carry: _Job | None = None
        self._batches = 0
        self._thread = threading.Thread(target=self._loop, name="mmferry-encoder", daemon=True)
        self._thread.start()

    def submit(self, items: list[Item], tokens: list[int]) -> Future[list[Outcome]]:
        future: Future[list[Outcome]] = Future()
        self._queue.put(_Job(items, tokens, future, time.perf_counter()))
        return future

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn`` on the owner thread (between batches)."""
        future: Future[Any] = Future()
        self._queue.put((fn, future))
        return future

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(10)

    def _run_call(self, entry: tuple[Callable[[], Any], Future[Any]]) -> None:
        fn, future = entry
        try:
            future.set_result(fn())
        except BaseException as e:
            future.set_exception(e)

    def _loop(self) -> None:
        while True:
            first = self._carry if self._carry is not None else self._queue.get()
            self._carry = None
            if first is None:
                return
            if isinstance(first, tuple):
                self._run_call(first)
                continue
            jobs, tokens = [first], sum(first.tokens)
            deadline = time.perf_counter() + self.batch_wait
            stop = False
            while tokens < self.max_batch_tokens:
                remaining = deadline - time.perf_counter()
                try:
                    nxt = self._queue.get(timeout=remaining) if remaining > 0 else \
                        self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                if isinstance(nxt, tuple):
                    self._run_call(nxt)
                    continue
                if tokens + sum(nxt.tokens) > self.max_batch_tokens:
                    self._carry = nxt
                    break
                jobs.append(nxt)
                tokens += sum(nxt.tokens)
            try:
                self._encode(jobs)
            except BaseException as e:  # never leave a request waiting on a dead thread
                for job in jobs:
                    if not job.future.done():
                        job.future.set_exception(e)
            if stop:
                return

    def _encode(self, jobs: list[_Job]) -> None:
        m, name = self.metrics, self.model_name
        now = time.perf_counter()
        for job in jobs:
            m.queue_wait.labels(name).observe(now - job.queued)
        items = [it for job in jobs for it in job.items]
        tokens = [n for job in jobs for n in job.tokens]
        self._batches += 1
        batch_id = ("batch", self._batches)
        cache = self.runner.cache
        evictions = cache.stats.evictions
        try:
            outcomes = self._run(items, tokens, batch_id)
        finally:
            self.runner.release(batch_id)
        m.batch_items.labels(name).observe(len(items))
        m.batch_tokens.labels(name).observe(sum(tokens))
        m.cache_usage.labels(name).set(cache.stats.tokens / cache.max_tokens)
        m.cache_entries.labels(name).set(cache.stats.entries)
        m.cache_evictions.labels(name).inc(cache.stats.evictions - evictions)
        start = 0
        for job in jobs:
            n = len(job.items)
            job.future.set_result(outcomes[start:start + n])
            start += n

    def _run(self, items: list[Item], tokens: list[int], batch_id: Any) -> list[Outcome]:
        m, name = self.metrics, self.model_name
        try:
            rows = self.runner.encode(items, request=batch_id)
            stats = [self.runner.last]
        except Exception:
            # One item broke the batch: encode each alone so it fails by itself.
            outcomes = []
            for item, n in zip(items, tokens, strict=True):
                try:
                    (row,) = self.runner.encode([item], request=batch_id)
                except Exception as e:
                    err = from_exception(e)
                    outcomes.append(Outcome(item.hash, "error", n, error=err))
                    continue
                self._account([self.runner.last])
                outcomes.append(Outcome(item.hash, _status(self.runner.last.status[0]), n, row))
            return outcomes
        self._account(stats)
        m.forward.labels(name).observe(stats[0].seconds.get("encode", 0.0))
        return [Outcome(it.hash, _status(s), n, r)
                for it, s, n, r in zip(items, stats[0].status, tokens, rows, strict=True)]

    def _account(self, stats: list[Any]) -> None:
        m, name = self.metrics, self.model_name
        for s in stats:
            m.encoder_calls.labels(name).inc(s.encoder_calls)
            queried = s.items - s.status.count("repeat")
            m.cache_queries.labels(name).inc(queried)
            m.cache_hits.labels(name).inc(s.hits)


def _status(runner_status: str) -> str:
    # A repeat was encoded once for an earlier item of the same batch: to this item, a hit.
    return "miss" if runner_status == "miss" else "hit"


def _rows_frame(rows: torch.Tensor) -> memoryview:
    host = rows.detach().to("cpu").contiguous()
    flat = host.reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
    return memoryview(raw.numpy())


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def embedding_frames(rows: torch.Tensor, key: str, compat: dict[str, Any],
                     **extra: Any) -> list[bytes | memoryview]:
    """The reply to ``GET /v1/embeddings/{key}``: a metadata frame, then the rows' bytes."""
    meta = {"compat": compat, "hash": key, "dtype": _dtype_name(rows), "shape": list(rows.shape),
            **extra}
    return [pack_meta(meta), _rows_frame(rows)]


async def read_hashes(request: Request) -> list[str]:
    """The ``{"hashes": [...]}`` body of ``POST /v1/embeddings:lookup``; a 400 otherwise."""
    body = await read_body(request, 16 << 20)
    try:
        hashes = json.loads(body).get("hashes")
    except (ValueError, AttributeError):
        hashes = None
    if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
        raise ServerError(400, "bad_request", 'send {"hashes": ["<hex>", ...]}', field="hashes")
    return hashes


def screen(model: EncoderModel, items: list[Item], cfg: EncodeConfig
           ) -> tuple[list[Outcome | None], list[int]]:
    """Check each item before it may reach the encoder: its hash is its content's (the cache
    is shared by every client: a key is ours, never the sender's claim), the model accepts
    it, it fits a batch and the cache. Per item an error :class:`Outcome` (refused) or
    ``None`` (to encode), and the token counts of the items to encode, in order."""
    outcomes: list[Outcome | None] = [None] * len(items)
    tokens = []
    for i, item in enumerate(items):
        claimed = item.hash
        try:
            actual = hash_item(item.modality, item, item.specs)
            if actual != claimed:
                raise ServerError(422, "hash_mismatch", f"item hash {claimed[:16]}... is not "
                                  f"its content's ({actual[:16]}...)", i)
            model.check_item(item)
            n = int(model.tokens_per_item(item))
            if n > cfg.max_batch_tokens or n > cfg.cache_max_tokens:
                raise ServerError(413, "item_too_large", f"{n} tokens, more than "
                                  f"--max-batch-tokens / the cache", i)
        except (MmferryError, ServerError) as e:
            outcomes[i] = Outcome(claimed, "error", error=from_exception(e, item=i))
            continue
        tokens.append(n)
    return outcomes, tokens


async def encode_items(owner: EncoderOwner, model: EncoderModel, items: list[Item],
                       cfg: EncodeConfig, metrics: EncodeMetrics) -> list[Outcome]:
    """Screen ``items``, encode the good ones on ``owner`` (one job), one outcome per item."""
    metrics.embedding_bytes.labels(cfg.model, "in").inc(sum(it.nbytes for it in items))
    outcomes, tokens = screen(model, items, cfg)
    where = [i for i, o in enumerate(outcomes) if o is None]
    if where:
        done = await asyncio.wrap_future(owner.submit([items[i] for i in where], tokens))
        for i, outcome in zip(where, done, strict=True):
            if outcome.error is not None:
                outcome.error.item = i
            outcomes[i] = outcome
    for o in outcomes:
        assert o is not None
        metrics.items.labels(cfg.model, o.status).inc()
    return outcomes  # type: ignore[return-value]


def wants_frames_answer(accept: str) -> bool:
    """Frames unless the client asks for JSON only."""
    return MEDIA_TYPE in accept or "application/json" not in accept


def answer(outcomes: list[Outcome], compat: dict[str, Any], *, frames: bool
           ) -> tuple[dict[str, Any], list[memoryview]]:
    """The answer's metadata (``compat``, per-item ``items``) and, with ``frames``, one
    embedding buffer per encoded item (the frames after the metadata frame)."""
    results, buffers = [], []
    for o in outcomes:
        entry: dict[str, Any] = {"hash": o.hash, "status": o.status, "num_tokens": o.num_tokens}
        if o.error is not None:
            entry["error"] = o.error.body()["error"]
        elif frames and o.rows is not None:
            entry.update(dtype=_dtype_name(o.rows), shape=list(o.rows.shape),
                         frame=len(buffers) + 1)
            buffers.append(_rows_frame(o.rows))
        results.append(entry)
    return {"compat": compat, "items": results}, buffers


def smallest_dummy_item(model: EncoderModel) -> Item:
    """The health probe's item: the cheapest of the model's dummy inputs."""
    dummy = model.dummy_inputs()
    return min(split_items(dummy, model.field_specs(dummy)).in_order(), key=model.tokens_per_item)


def probe_encode(runner: EncoderRunner, item: Item) -> int:
    """Encode ``item`` with ``runner``'s model and transfer but a throwaway cache (a health
    probe must not evict or pin real entries); its row count. Call on the owner thread."""
    probe = EncoderRunner(runner.model, EncoderCache(max_tokens=1 << 16), device=runner.device,
                          transfer=runner.transfer)
    (rows,) = probe.encode([item])
    return int(rows.shape[0])


def create_app(cfg: EncodeConfig, model: EncoderModel, device: torch.device) -> FastAPI:
    metrics = EncodeMetrics.create(cfg.model)
    runner = EncoderRunner(model, EncoderCache(max_tokens=cfg.cache_max_tokens), device=device,
                           max_tokens_per_step=cfg.max_batch_tokens)
    compat = compat_of(model, cfg.model, cfg.weights_revision)
    health_item = smallest_dummy_item(model)
    state: dict[str, Any] = {"owner": None}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state["owner"] = EncoderOwner(runner, max_batch_tokens=cfg.max_batch_tokens,
                                      batch_wait_ms=cfg.batch_wait_ms, metrics=metrics,
                                      model_name=cfg.model)
        if cfg.accept_media and cfg.limits.fetch.enabled:
            import httpx

            state["http"] = httpx.AsyncClient(trust_env=False, timeout=None)
        try:
            yield
        finally:
            state["owner"].stop()
            if state.get("http") is not None:
                await state["http"].aclose()

    app = FastAPI(title="mmferry serve", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)

    def count(path: str, status: int) -> None:
        if path == "/v1/encode":
            metrics.requests.labels(cfg.model, str(status)).inc()

    install(app, api_keys=cfg.api_keys, headers=lambda: {"X-Mmferry-Compat": compat["id"]},
            on_status=count)

    def owner() -> EncoderOwner:
        return state["owner"]

    async def items_of(request: Request) -> list[Item]:
        kind = content_type(request)
        if kind == MEDIA_TYPE:
            body = await read_body(request, cfg.max_request_bytes)
            frames = decode_body(body)
            unpack_meta(frames[0])
            return wire.decode(frames[1:]).in_order()
        if kind in ("application/json", "multipart/form-data") and cfg.accept_media:
            refs, kwargs = await parse_media_request(request, cfg.limits, cfg.max_request_bytes,
                                                     model.modalities)
            media = await resolve(refs, cfg.limits, state.get("http"))
            return await asyncio.to_thread(render_media, model, media, kwargs,
                                           max_image_pixels=cfg.limits.max_image_pixels)
        accepted = MEDIA_TYPE + (", application/json, multipart/form-data"
                                 if cfg.accept_media else "")
        raise ServerError(415, "unsupported_media_type",
                          f"content type {kind or 'none'!r}; send {accepted}")

    @app.post("/v1/encode")
    async def encode(request: Request) -> Response:
        start = time.perf_counter()
        try:
            items = await items_of(request)
        except MmferryError as e:
            raise from_exception(e) from None
        outcomes = await encode_items(owner(), model, items, cfg, metrics)
        # Frames unless the client asks for JSON only.
        frames = wants_frames_answer(request.headers.get("accept", ""))
        body, buffers = answer(outcomes, compat, frames=frames)
        if frames:
            metrics.embedding_bytes.labels(cfg.model, "out").inc(sum(b.nbytes for b in buffers))
            response: Response = Response(b"".join(encode_body([pack_meta(body), *buffers])),
                                          media_type=MEDIA_TYPE)
        else:
            response = JSONResponse(body)
        metrics.latency.labels(cfg.model).observe(time.perf_counter() - start)
        return response

    @app.post("/v1/embeddings:lookup")
    async def lookup(request: Request) -> Response:
        hashes = await read_hashes(request)
        cache = runner.cache
        present = await asyncio.wrap_future(owner().call(
            lambda: [runner.cache_key(h) in cache for h in hashes]))
        return JSONResponse({"compat": compat,
                             "present": [h for h, p in zip(hashes, present, strict=True) if p],
                             "missing": [h for h, p in zip(hashes, present, strict=True) if not p]})

    @app.get("/v1/embeddings/{key}")
    async def embedding(key: str) -> Response:
        cache = runner.cache
        entry = runner.cache_key(key)
        rows = await asyncio.wrap_future(owner().call(
            lambda: cache.get(entry) if entry in cache else None))
        if rows is None:
            raise ServerError(404, "not_found", f"no cached embedding {key[:16]}... (never "
                              "encoded, or evicted)", field="hash")
        return Response(b"".join(encode_body(embedding_frames(rows, key, compat))),
                        media_type=MEDIA_TYPE)

    @app.get("/health")
    async def health() -> Response:
        try:
            rows = await asyncio.wait_for(asyncio.wrap_future(owner().call(
                lambda: probe_encode(runner, health_item))), 30)
        except Exception as e:
            return JSONResponse(ServerError(503, "unhealthy", f"{type(e).__name__}: {e}").body(),
                                status_code=503)
        return JSONResponse({"status": "ok", "compat": compat, "probe_rows": rows})

    @app.get("/v1/models")
    async def list_models() -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": cfg.model, "object": "model", "modalities": list(model.modalities),
             "compat": compat}]})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(exposition(metrics.registry), media_type="text/plain; version=0.0.4")

    return app
