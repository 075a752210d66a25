"""Prometheus metrics of the two servers, every name under ``mmferry:``; labels are the
model and bounded enumerations (status, modality, reason), never an item hash."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["EncodeMetrics", "RenderMetrics", "exposition"]

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_TOKENS = (64, 256, 1024, 4096, 16384, 65536)


def exposition(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


@dataclass
class RenderMetrics:
    registry: CollectorRegistry
    requests: Counter
    latency: Histogram
    fetch_latency: Histogram
    fetch_bytes: Counter
    preprocess_latency: Histogram
    rejected: Counter
    items: Histogram
    inflight: Gauge
    wire_bytes: Counter
    worker_restarts: Counter

    @classmethod
    def create(cls, model: str) -> RenderMetrics:
        r = CollectorRegistry()
        lab = {"labelnames": ("model_name",)}
        return cls(
            registry=r,
            requests=Counter("mmferry:render_requests", "Render requests by HTTP status.",
                             ("model_name", "status"), registry=r),
            latency=Histogram("mmferry:render_latency_seconds", "Render request latency.",
                              buckets=_LATENCY, registry=r, **lab),
            fetch_latency=Histogram("mmferry:media_fetch_latency_seconds",
                                    "Time to fetch the media of one request.",
                                    buckets=_LATENCY, registry=r, **lab),
            fetch_bytes=Counter("mmferry:media_fetch_bytes", "Media bytes received (uploads, "
                                "fetches, local files).", ("model_name", "modality"), registry=r),
            preprocess_latency=Histogram("mmferry:preprocess_latency_seconds",
                                         "Decode, processor and split of one request in a worker.",
                                         buckets=_LATENCY, registry=r, **lab),
            rejected=Counter("mmferry:media_rejected", "Requests refused, by error code.",
                             ("model_name", "reason"), registry=r),
            items=Histogram("mmferry:items_per_request", "Media items per request.",
                            buckets=_COUNTS, registry=r, **lab),
            inflight=Gauge("mmferry:inflight_requests", "Requests admitted and not finished.",
                           registry=r, **lab),
            wire_bytes=Counter("mmferry:wire_bytes", "Response body bytes.",
                               ("model_name", "format"), registry=r),
            worker_restarts=Counter("mmferry:render_worker_restarts", "Render workers replaced.",
                                    registry=r, **lab),
        )


@dataclass
class EncodeMetrics:
    registry: CollectorRegistry
    requests: Counter
    latency: Histogram
    queue_wait: Histogram
    batch_items: Histogram
    batch_tokens: Histogram
    forward: Histogram
    encoder_calls: Counter
    items: Counter
    cache_queries: Counter
    cache_hits: Counter
    cache_usage: Gauge
    cache_entries: Gauge
    cache_evictions: Counter
    embedding_bytes: Counter

    @classmethod
    def create(cls, model: str) -> EncodeMetrics:
        r = CollectorRegistry()
        lab = {"labelnames": ("model_name",)}
        return cls(
            registry=r,
            requests=Counter("mmferry:encoder_requests", "Encode requests by HTTP status.",
                             ("model_name", "status"), registry=r),
            latency=Histogram("mmferry:encoder_request_latency_seconds", "Encode request latency.",
                              buckets=_LATENCY, registry=r, **lab),
            queue_wait=Histogram("mmferry:encoder_queue_wait_seconds",
                                 "Time from a request's items being queued to their batch starting.",
                                 buckets=_LATENCY, registry=r, **lab),
            batch_items=Histogram("mmferry:encoder_batch_items", "Items per cross-request batch.",
                                  buckets=_COUNTS, registry=r, **lab),
            batch_tokens=Histogram("mmferry:encoder_batch_tokens", "Tokens per cross-request batch.",
                                   buckets=_TOKENS, registry=r, **lab),
            forward=Histogram("mmferry:encoder_forward_seconds", "Encoder model time per batch.",
                              buckets=_LATENCY, registry=r, **lab),
            encoder_calls=Counter("mmferry:encoder_calls", "Calls of the encoder model.",
                                  registry=r, **lab),
            items=Counter("mmferry:encoder_items", "Items answered, by status (hit, miss, error).",
                          ("model_name", "status"), registry=r),
            cache_queries=Counter("mmferry:encoder_cache_queries", "Encoder-cache lookups (items).",
                                  registry=r, **lab),
            cache_hits=Counter("mmferry:encoder_cache_hits", "Encoder-cache hits (items).",
                               registry=r, **lab),
            cache_usage=Gauge("mmferry:encoder_cache_usage_ratio",
                              "Cached tokens over the cache's capacity.", registry=r, **lab),
            cache_entries=Gauge("mmferry:encoder_cache_entries", "Cached items.", registry=r, **lab),
            cache_evictions=Counter("mmferry:encoder_cache_evictions", "Cache entries evicted.",
                                    registry=r, **lab),
            embedding_bytes=Counter("mmferry:embedding_bytes", "Embedding bytes, by direction.",
                                    ("model_name", "direction"), registry=r),
        )
