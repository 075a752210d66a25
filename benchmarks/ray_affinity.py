"""Item-affinity routing on Ray Serve against Ray Serve's default router, on a local cluster.

A workload where half of the items repeat across requests: each item of each request is,
with probability ``--repeat-share``, one of ``--pool`` popular photo-like images (of mixed
sizes), else a fresh one. The same request sequence (rendered here once, sent as frames to
``POST /v1/encode`` by ``--clients`` concurrent clients) goes to three deployments of
``mmferry.scaleout.ray`` in turn, each with cold encoder caches:

1. one encoder replica (the reference: one cache sees every item);
2. ``--replicas`` encoder replicas (2) behind :class:`~mmferry.scaleout.ray.ItemAffinityRouter`;
3. as many behind Ray Serve's default power-of-two-choices router.

It prints per deployment the encoder-cache hit rate (items answered ``hit`` over items) and
the items the encoders had to encode (misses). Target: affinity within 5 points of the
single replica's hit rate. Then the overhead of the Ray path (HTTP proxy, ingress, encoder
replica) over ``mmferry serve`` directly: one client, the same requests alternated between
the two (each with its own cold cache), frames in and out, median latency per request and
their ratio.

The encoder replicas ask for a logical GPU each (as on GPU nodes) and run on the CPU here.
Nothing leaves loopback. On a shared machine the latency figures are only as good as the
load average printed with them.

    python benchmarks/ray_affinity.py [--requests 96] [--items 1] [--replicas 2] [--clients 4]
                                      [--quick]
"""

from __future__ import annotations

import argparse
import io
import os
import socket
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from _common import configure_torch, verdict  # noqa: E402
from _servers import ServerProcess  # noqa: E402

import mmferry as mf  # noqa: E402
from mmferry.media.samples import photo_like  # noqa: E402
from mmferry.server.frames import MEDIA_TYPE, decode_body, encode_body, pack_meta, unpack_meta  # noqa: E402

SIZES = (224, 336, 448)


def jpeg(size: int, seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(photo_like(size, size, seed)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def workload(requests: int, items: int, pool: int, share: float, seed: int = 0) -> list[bytes]:
    """Frames bodies of ``requests`` requests of ``items`` items each, rendered here."""
    rng = np.random.default_rng(seed)
    model = mf.models.load("qwen2-vl", materialize=False)
    popular = [(int(rng.choice(SIZES)), 1000 + i) for i in range(pool)]
    cache: dict[tuple[int, int], mf.Item] = {}
    bodies = []
    fresh = 0
    for _ in range(requests):
        chosen = []
        for _ in range(items):
            if rng.random() < share:
                chosen.append(popular[int(rng.integers(pool))])
            else:
                fresh += 1
                chosen.append((int(rng.choice(SIZES)), 100_000 + fresh))
        for key in chosen:
            if key not in cache:
                outputs = model.processor(images=[jpeg(*key)])
                cache[key] = mf.split_items(outputs, model.field_specs(outputs)).in_order()[0]
        seq = [cache[k] for k in chosen]
        bodies.append(b"".join(encode_body([pack_meta({}), *mf.wire.encode(seq)])))
    return bodies


def post(client: Any, body: bytes, accept: str) -> Any:
    r = client.post("/v1/encode", content=body,
                    headers={"Content-Type": MEDIA_TYPE, "Accept": accept})
    if r.status_code != 200:
        raise RuntimeError(f"{r.status_code}: {r.text[:300]}")
    return r


def statuses(url: str, bodies: list[bytes], clients: int) -> tuple[list[str], list[str]]:
    """Every item's status and every request's replica, ``clients`` requests at a time."""
    import httpx

    with httpx.Client(base_url=url, trust_env=False, timeout=120) as http, \
            ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(lambda b: post(http, b, "application/json").json(), bodies))
    return [e["status"] for a in answers for e in a["items"]], [a["replica"] for a in answers]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deploy(port: int, replicas: int, router: str, batch_wait_ms: float) -> None:
    from ray import serve

    from mmferry.scaleout.ray import build_app

    serve.run(build_app({"encoder_replicas": replicas, "encoder_gpus": 1, "encoder_cpus": 0,
                         "render_cpus": 0, "ingress_cpus": 0, "min_render_replicas": 0,
                         "max_render_replicas": 1, "router": router,
                         "batch_wait_ms": batch_wait_ms, "port": port}),
              name="mmferry", route_prefix="/")


def overhead(url: str, direct: str, bodies: list[bytes]) -> tuple[float, float]:
    """Median seconds per request through Ray and through ``mmferry serve``, alternated."""
    import httpx

    ray_s, direct_s = [], []
    with httpx.Client(base_url=url, trust_env=False, timeout=120) as a, \
            httpx.Client(base_url=direct, trust_env=False, timeout=120) as b:
        for i, body in enumerate(bodies):
            order = ((a, ray_s), (b, direct_s)) if i % 2 == 0 else ((b, direct_s), (a, ray_s))
            for client, out in order:
                t0 = time.perf_counter()
                r = post(client, body, MEDIA_TYPE)
                decode_body(r.content)
                out.append(time.perf_counter() - t0)
            assert unpack_meta(decode_body(r.content)[0])["items"]
    return statistics.median(ray_s), statistics.median(direct_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--items", type=int, default=1, help="items per request")
    p.add_argument("--pool", type=int, default=12, help="popular images")
    p.add_argument("--repeat-share", type=float, default=0.5)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--replicas", type=int, default=2, help="encoder replicas to compare with one")
    p.add_argument("--quick", action="store_true", help="24 requests: a smoke run")
    args = p.parse_args()
    if args.quick:
        args.requests, args.pool = 24, 4
    configure_torch(1)
    import ray
    from ray import serve

    t0 = time.perf_counter()
    bodies = workload(args.requests, args.items, args.pool, args.repeat_share)
    n_items = args.requests * args.items
    print(f"workload: {args.requests} requests x {args.items} item(s), {args.repeat_share:.0%} "
          f"of items from {args.pool} popular images (sizes {SIZES}), rendered in "
          f"{time.perf_counter() - t0:.1f} s")
    port = free_port()
    ray.init(num_cpus=2, num_gpus=max(2, args.replicas), include_dashboard=False, log_to_driver=False,
             configure_logging=False, _system_config={"enable_worker_prestart": False})
    tmp = Path(tempfile.mkdtemp(prefix="mmferry-ray-bench-"))
    results: dict[str, tuple[float, int, int]] = {}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        n = args.replicas
        configs = (("1 replica", 1, "affinity"), (f"{n} replicas, affinity", n, "affinity"),
                   (f"{n} replicas, Ray default (pow2)", n, "pow2"))
        for name, replicas, router in configs:
            deploy(port, replicas, router, batch_wait_ms=5.0)
            st, used = statuses(url, bodies, args.clients)
            hits = st.count("hit")
            results[name] = (hits / len(st), len(st) - hits, len(set(used)))
            serve.delete("mmferry")
        print(f"\nencoder cache over {n_items} items (cold caches, {args.clients} clients):")
        print(f"{'deployment':<32} {'hit rate':>9} {'items encoded':>14} {'replicas used':>14}")
        for name, (rate, misses, used) in results.items():
            print(f"{name:<32} {rate:>8.1%} {misses:>14} {used:>14}")
        single, affinity, default = (results[name][0] for name, _, _ in configs)
        print(f"affinity - single: {100 * (affinity - single):+.1f} points; default - single: "
              f"{100 * (default - single):+.1f} points; target: affinity within 5 points: "
              f"{verdict(abs(affinity - single) <= 0.05)}")

        # Overhead: the same sequence through Ray (one replica) and `mmferry serve`.
        deploy(port, 1, "affinity", batch_wait_ms=0.0)
        direct = ServerProcess("serve", "--batch-wait-ms", "0", log=tmp / "serve.log")
        try:
            direct_url = direct.wait_ready()
            warm = workload(4, args.items, 2, 0.0, seed=99)
            overhead(url, direct_url, warm)
            ray_med, direct_med = overhead(url, direct_url, bodies)
        finally:
            direct.stop()
        print(f"\nlatency per request, one client, frames in and out (median of {len(bodies)}):")
        print(f"  mmferry serve directly: {direct_med * 1e3:.1f} ms")
        print(f"  Ray Serve path:         {ray_med * 1e3:.1f} ms  ({ray_med / direct_med:.2f}x, "
              f"+{(ray_med - direct_med) * 1e3:.1f} ms)")
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"\nload average (1, 5 min): {os.getloadavg()[0]:.1f}, {os.getloadavg()[1]:.1f} "
          f"on {os.cpu_count()} CPUs; total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
