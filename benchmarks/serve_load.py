"""Load on the two servers over loopback: throughput, latency, errors, memory, bytes.

Starts ``mmferry launch render`` (``--workers 1``, then ``--workers 2``) and
``mmferry serve`` as subprocesses on 127.0.0.1 and drives them with N concurrent clients for
a fixed number of requests, each one photo-like 448x448 JPEG. Prints:

1. HTTP + framing overhead: one client, median latency of a render request (multipart in,
   frames out, decoded into items by the client) against the same work in this process
   (processor, split, hashes, wire encode), calls alternated; and the same for an encode
   request (frames in and out) against ``EncoderRunner.encode`` in process. Target: render
   overhead <= 10%.
2. Render throughput with ``--workers 2`` over ``--workers 1`` (N clients): requests/s,
   p50/p99, errors, server RSS (main + workers) before and after. Target: >= 1.6x on 2 cores.
3. Response bytes per image over its tensor payload (frames body). Target: <= 1.05x.

Loops are bounded; nothing leaves loopback. Figures on a shared machine are only as good as
the "foreign CPU" line says (other processes' CPU seconds during the run).

    python benchmarks/serve_load.py [--requests 96] [--clients 4] [--quick]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from _common import CpuWatch, configure_torch, verdict  # noqa: E402
from _servers import ServerProcess  # noqa: E402

import mmferry as mf  # noqa: E402
from mmferry import wire  # noqa: E402
from mmferry.client import Client  # noqa: E402

SIZE = 448


def photo(seed: int) -> bytes:
    """A photo-like JPEG: gradients, a few shapes, mild noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32) / SIZE
    base = np.stack([x * 200 + 30, y * 180 + 40, (1 - x) * 150 + 60], axis=-1)
    img = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(6):
        x0, y0 = rng.integers(0, SIZE - 64, 2)
        w, h = rng.integers(24, 160, 2)
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x0 + w, y0 + h), fill=color)
    arr = np.asarray(img).astype(np.int16) + rng.normal(0, 4, (SIZE, SIZE, 3)).astype(np.int16)
    buf = io.BytesIO()
    Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total / 1024


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds the processes ``pids`` have used (from /proc)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return total / os.sysconf("SC_CLK_TCK")


def server_pids(server: ServerProcess, client: Client) -> list[int]:
    return [server.process.pid, *client.health().get("workers", [])]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def overhead(images: list[bytes], runs: int, tmp: Path) -> dict[str, float]:
    model = mf.models.load("qwen2-vl")

    def render_here(data: bytes) -> list[mf.Item]:
        outputs = model.processor(images=[data])
        items = mf.split_items(outputs, model.field_specs(outputs)).in_order()
        for it in items:
            _ = it.hash, model.tokens_per_item(it)
        wire.encode(items)
        return items

    rendered = [render_here(images[i % len(images)])[0] for i in range(runs + 2)]
    # Distinct encoder inputs per call (no cache hits): the call's number in two pixel levels.
    distinct = []
    for i in range(2 * runs + 4):
        base = rendered[i % len(rendered)]
        pv = base["pixel_values"].clone()
        pv[0, :2] = torch.tensor([i % 256, i // 256], dtype=pv.dtype)
        distinct.append(mf.Item("image", {**base, "pixel_values": pv}, base.specs))

    render = ServerProcess("launch", "render", "--workers", "1", log=tmp / "render1.log")
    encode = ServerProcess("serve", "--batch-wait-ms", "0", log=tmp / "serve.log")
    try:
        r_url, e_url = render.wait_ready(), encode.wait_ready()
        here_r, http_r, here_e, http_e = [], [], [], []
        cpu = {"render_here": 0.0, "render_client": 0.0, "encode_here": 0.0, "encode_client": 0.0}
        with Client(r_url) as rc, Client(e_url) as ec:
            for i in range(2):  # warm-up
                render_here(images[i])
                rc.render(images=[images[i]])
                mf.EncoderRunner(model).encode([distinct[-1 - i]])
                ec.encode([distinct[-3 - i]])
            r_pids, e_pids = server_pids(render, rc), [encode.process.pid]
            r_cpu0, e_cpu0 = cpu_s(r_pids), cpu_s(e_pids)
            for i in range(runs):
                data = images[i % len(images)]
                order = (0, 1) if i % 2 == 0 else (1, 0)
                for side in order:
                    t0, c0 = time.perf_counter(), time.process_time()
                    if side == 0:
                        render_here(data)
                        here_r.append(time.perf_counter() - t0)
                        cpu["render_here"] += time.process_time() - c0
                    else:
                        rc.render(images=[data])
                        http_r.append(time.perf_counter() - t0)
                        cpu["render_client"] += time.process_time() - c0
                for side in order:
                    t0, c0 = time.perf_counter(), time.process_time()
                    if side == 0:
                        mf.EncoderRunner(model).encode([distinct[2 * i]])
                        here_e.append(time.perf_counter() - t0)
                        cpu["encode_here"] += time.process_time() - c0
                    else:
                        ec.encode([distinct[2 * i + 1]])
                        http_e.append(time.perf_counter() - t0)
                        cpu["encode_client"] += time.process_time() - c0
            cpu["render_server"] = cpu_s(r_pids) - r_cpu0
            cpu["encode_server"] = cpu_s(e_pids) - e_cpu0
    finally:
        render.stop()
        encode.stop()
    med = statistics.median
    return {"render_here": med(here_r), "render_http": med(http_r), "encode_here": med(here_e),
            "encode_http": med(http_e), **{f"cpu_{k}": v / runs for k, v in cpu.items()}}


def _client_share(url: str, images: list[bytes], k: int, requests: int, clients: int,
                  frames: bool) -> tuple[list[float], int]:
    """One client process's share of the requests: its latencies and error count."""
    latencies, errors = [], 0
    with Client(url) as c:
        for i in range(k, requests, clients):
            t0 = time.perf_counter()
            try:
                c.render(images=[images[i % len(images)]], items=frames)
            except Exception:
                errors += 1
                continue
            latencies.append(time.perf_counter() - t0)
    return latencies, errors


def throughput(workers: int, images: list[bytes], requests: int, clients: int,
               tmp: Path) -> dict[str, dict[str, float]]:
    """Per response kind (frames, json): requests/s, p50, p99, errors, RSS, foreign CPU.
    Clients are processes, so the client side has no shared GIL to be the bottleneck."""
    import multiprocessing as mp

    server = ServerProcess("launch", "render", "--workers", str(workers),
                           "--max-inflight", str(4 * clients), log=tmp / f"render{workers}.log")
    out: dict[str, dict[str, float]] = {}
    try:
        url = server.wait_ready()
        with Client(url) as probe:
            for i in range(2 * workers):  # warm every worker
                probe.render(images=[images[i % len(images)]], items=False)
        with mp.get_context("fork").Pool(clients) as pool:
            for kind in ("frames", "json"):
                with Client(url) as probe:
                    rss_before = rss_mib(server_pids(server, probe))
                watch = CpuWatch().start()
                t0 = time.perf_counter()
                shares = pool.starmap(_client_share, [(url, images, k, requests, clients,
                                                       kind == "frames") for k in range(clients)])
                wall = time.perf_counter() - t0
                watch.stop()
                with Client(url) as probe:
                    rss_after = rss_mib(server_pids(server, probe))
                latencies = [x for lat, _ in shares for x in lat]
                out[kind] = {"rps": len(latencies) / wall, "p50": pct(latencies, 0.5),
                             "p99": pct(latencies, 0.99), "errors": sum(e for _, e in shares),
                             "rss_before": rss_before, "rss_after": rss_after,
                             "foreign": watch.foreign_s}
    finally:
        server.stop()
    return out


def bytes_ratio(image: bytes, tmp: Path) -> tuple[int, int, int]:
    server = ServerProcess("launch", "render", "--workers", "1", log=tmp / "bytes.log")
    try:
        with Client(server.wait_ready()) as c:
            r = c.render(images=[image])
    finally:
        server.stop()
    return len(r.body), r.items[0].nbytes, len(image)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--runs", type=int, default=30, help="sequential calls for the overhead part")
    ap.add_argument("--quick", action="store_true", help="a few requests: checks it runs")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.runs = 8, 4
    configure_torch(1)
    images = [photo(i) for i in range(8)]
    with tempfile.TemporaryDirectory(prefix="mmferry-serve-load-") as d:
        tmp = Path(d)
        body, payload, jpeg = bytes_ratio(images[0], tmp)
        o = overhead(images, args.runs, tmp)
        t1 = throughput(1, images, args.requests, args.clients, tmp)
        t2 = throughput(2, images, args.requests, args.clients, tmp)

    render_over = o["render_http"] / o["render_here"] - 1
    print(f"images: {SIZE}x{SIZE} photo-like JPEG ({jpeg:,} B); model qwen2-vl (tiny tower)")
    print("\n1. HTTP + framing overhead, one client, median of", args.runs)
    print(f"   render: in process {o['render_here'] * 1e3:.1f} ms, over HTTP {o['render_http'] * 1e3:.1f}"
          f" ms -> overhead {render_over:+.1%}  target <= +10%: {verdict(render_over <= 0.10)}")
    print(f"   encode: in process {o['encode_here'] * 1e3:.1f} ms, over HTTP {o['encode_http'] * 1e3:.1f}"
          f" ms -> overhead {o['encode_http'] / o['encode_here'] - 1:+.1%} "
          f"({(o['encode_http'] - o['encode_here']) * 1e3:.1f} ms per request)")
    cr = o["cpu_render_client"] + o["cpu_render_server"]
    ce = o["cpu_encode_client"] + o["cpu_encode_server"]
    print(f"   CPU per request (robust to a busy machine): render in process "
          f"{o['cpu_render_here'] * 1e3:.1f} ms, over HTTP {cr * 1e3:.1f} ms (client "
          f"{o['cpu_render_client'] * 1e3:.1f} + server and worker {o['cpu_render_server'] * 1e3:.1f})"
          f" -> {cr / o['cpu_render_here'] - 1:+.1%}")
    print(f"   CPU per request: encode in process {o['cpu_encode_here'] * 1e3:.1f} ms, over HTTP "
          f"{ce * 1e3:.1f} ms -> {ce / o['cpu_encode_here'] - 1:+.1%}")
    print(f"\n2. render throughput, {args.clients} client processes, {args.requests} requests each row")
    print(f"   {'response':9s} {'workers':8s} {'req/s':>7s} {'p50 ms':>7s} {'p99 ms':>7s} "
          f"{'errors':>6s} {'RSS MiB before':>14s} {'after':>6s} {'foreign CPU s':>13s}")
    for kind in ("frames", "json"):
        for w, t in ((1, t1[kind]), (2, t2[kind])):
            print(f"   {kind:9s} {w:<8d} {t['rps']:7.1f} {t['p50'] * 1e3:7.1f} {t['p99'] * 1e3:7.1f} "
                  f"{t['errors']:6d} {t['rss_before']:14.0f} {t['rss_after']:6.0f} "
                  f"{t['foreign']:13.1f}")
        scale = t2[kind]["rps"] / t1[kind]["rps"]
        print(f"   {kind}: workers 2 / workers 1 = {scale:.2f}x  target >= 1.6x: "
              f"{verdict(scale >= 1.6)}")
    ratio = body / payload
    print(f"\n3. bytes: frames body {body:,} B for a tensor payload of {payload:,} B -> {ratio:.4f}x"
          f"  target <= 1.05x: {verdict(ratio <= 1.05)}  (the JPEG in: {jpeg:,} B)")


if __name__ == "__main__":
    main()
