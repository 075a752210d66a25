"""Scale-out on Ray Serve: the routing decision (pure), the application's routes and token
batching in Ray's local testing mode, and one real local Ray cluster on loopback with two
encoder replicas, where a repeated item must land on the replica that cached it.

Ray is an optional extra: without it only the pure routing tests run.
"""

from __future__ import annotations

import asyncio
import io
import socket
import time
from collections import Counter
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import mmferry as mf
from mmferry.scaleout.routing import rank_replicas, weight
from mmferry.server.frames import MEDIA_TYPE, decode_body, encode_body, pack_meta, unpack_meta

REPLICAS = [f"replica-{i}" for i in range(5)]
KEYS = [f"{i:064x}" for i in range(2000)]

# ---- the ranking, without Ray ---------------------------------------------------------------


def test_same_key_same_replica_whatever_the_order_of_the_set() -> None:
    first = {k: rank_replicas(k, REPLICAS)[0] for k in KEYS}
    shuffled = list(reversed(REPLICAS))
    assert {k: rank_replicas(k, shuffled)[0] for k in KEYS} == first
    counts = Counter(first.values())
    # Every replica takes a fair share (2000 keys, 5 replicas: 400 each on average).
    assert set(counts) == set(REPLICAS)
    assert all(300 <= n <= 500 for n in counts.values()), counts


def test_removing_a_replica_moves_only_its_keys_to_their_second_choice() -> None:
    before = {k: rank_replicas(k, REPLICAS) for k in KEYS}
    gone = REPLICAS[2]
    after = {k: rank_replicas(k, [r for r in REPLICAS if r != gone])[0] for k in KEYS}
    moved = [k for k in KEYS if after[k] != before[k][0]]
    assert moved and all(before[k][0] == gone for k in moved)
    assert all(after[k] == before[k][1] for k in moved)
    assert len(moved) == sum(1 for k in KEYS if before[k][0] == gone)


def test_adding_a_replica_takes_keys_only_for_itself() -> None:
    before = {k: rank_replicas(k, REPLICAS)[0] for k in KEYS}
    after = {k: rank_replicas(k, [*REPLICAS, "replica-new"])[0] for k in KEYS}
    moved = [k for k in KEYS if after[k] != before[k]]
    assert moved and all(after[k] == "replica-new" for k in moved)
    assert 200 <= len(moved) <= 470  # about a sixth of 2000


def test_load_fallback_only_past_the_threshold() -> None:
    key = KEYS[7]
    order = rank_replicas(key, REPLICAS, fallbacks=4)
    assert order == sorted(REPLICAS, key=lambda r: weight(key, r), reverse=True)
    primary = order[0]
    # Uneven, but within the threshold: affinity holds.
    loads = {primary: 8, order[1]: 0}
    assert rank_replicas(key, REPLICAS, loads, imbalance_threshold=8)[0] == primary
    # Past it: the least loaded first, ties in rendezvous order, the busy one last.
    loads = {r: 3 for r in REPLICAS} | {primary: 12, order[3]: 1}
    ranked = rank_replicas(key, REPLICAS, loads, imbalance_threshold=8, fallbacks=4)
    assert ranked == [order[3], order[1], order[2], order[4], primary]
    assert len(rank_replicas(key, REPLICAS, fallbacks=1)) == 2
    assert rank_replicas(key, []) == []


# ---- Ray: shared pieces -----------------------------------------------------------------------


def png(seed: int, size: int = 56) -> bytes:
    buf = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def model() -> mf.EncoderModel:
    return mf.models.load("qwen2-vl")


def frames_body(items: list[mf.Item]) -> bytes:
    return b"".join(encode_body([pack_meta({}), *mf.wire.encode(items)]))


def answer_of(content: bytes) -> tuple[dict[str, Any], list[memoryview]]:
    frames = decode_body(content)
    return unpack_meta(frames[0]), frames[1:]


def rows_of(entry: dict[str, Any], frames: list[memoryview]) -> torch.Tensor:
    raw = torch.frombuffer(bytearray(frames[entry["frame"] - 1]), dtype=torch.uint8)
    return raw.view(getattr(torch, entry["dtype"])).reshape(entry["shape"])


def test_the_router_ranks_by_the_call_key_and_backs_off() -> None:
    pytest.importorskip("ray.serve")
    from ray.serve._private.common import DeploymentID
    from ray.serve.request_router import ReplicaID

    from mmferry.scaleout.ray import ItemAffinityRouter

    router = ItemAffinityRouter.__new__(ItemAffinityRouter)  # no Serve controller here
    router.initialize_state(imbalance_threshold=2, fallbacks=1)
    deployment = DeploymentID("Encoder", "mmferry")
    replicas = [SimpleNamespace(replica_id=ReplicaID(r, deployment)) for r in REPLICAS]
    pending = SimpleNamespace(args=[{"key": KEYS[3], "tokens": 4}], kwargs={},
                              routing_context=SimpleNamespace(should_backoff=False))
    ranks = asyncio.run(router.choose_replicas(replicas, pending))  # type: ignore[arg-type]
    assert [[r.replica_id.unique_id for r in rank] for rank in ranks] == \
        [[r] for r in rank_replicas(KEYS[3], REPLICAS, fallbacks=1)]
    assert pending.routing_context.should_backoff
    # Outstanding requests from this router are the loads of the fallback.
    busy = ranks[0][0].replica_id
    router._outstanding[busy] = 5
    ranks = asyncio.run(router.choose_replicas(replicas, pending))  # type: ignore[arg-type]
    assert ranks[0][0].replica_id is not busy


# ---- Ray: local testing mode ----------------------------------------------------------------


MAX_BATCH_TOKENS = 9  # a 56x56 image is 4 tokens: two calls of one image fit, three do not


@pytest.fixture(scope="module")
def local_app() -> Iterator[Any]:
    pytest.importorskip("ray.serve")
    import ray.serve.context as serve_context
    from fastapi.testclient import TestClient
    from ray import serve
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve._private.config import DeploymentConfig

    from mmferry.cli.args import validate
    from mmferry.scaleout import ray as mr

    # Ray 2.60's local testing mode sets no replica context, which @serve.batch reads when
    # its queue starts: give it the one a real replica would have.
    serve_context._set_internal_replica_context(
        replica_id=ReplicaID("local-encoder", DeploymentID("Encoder", "mmferry-test")),
        servable_object=None, _deployment_config=DeploymentConfig(max_ongoing_requests=64),
        rank=None, world_size=1)
    ns = validate({**mr._defaults(), "encoder_gpus": 0.0, "batch_wait_ms": 300.0,
                   "max_batch_tokens": MAX_BATCH_TOKENS, "accept_media": True,
                   "max_items": 4})
    encoder = serve.run(serve.deployment(mr.Encoder, name="Encoder").bind(
        "qwen2-vl", None, "float32", MAX_BATCH_TOKENS, 300.0, ns["cache_max_tokens"]),
        name="encoder", route_prefix=None, _local_testing_mode=True)
    render = serve.run(serve.deployment(mr.Render, name="Render").bind(
        "qwen2-vl", None, ns["max_image_pixels"]), name="render", route_prefix=None,
        _local_testing_mode=True)
    with TestClient(mr.create_ingress_app(ns, render, encoder)) as client:
        yield SimpleNamespace(client=client, encoder=encoder)
    serve_context._INTERNAL_REPLICA_CONTEXT = None


def test_routes_answer_as_the_servers_do(local_app: Any, model: mf.EncoderModel) -> None:
    c = local_app.client
    images = [png(1, 84), png(2)]  # 9 and 4 tokens
    outputs = model.processor(images=images)
    items = mf.split_items(outputs, model.field_specs(outputs)).in_order()
    expected = mf.EncoderRunner(model).encode(items)

    meta = c.post("/v1/render", files=[("image", ("a", im)) for im in images]).json()
    assert [m["hash"] for m in meta["items"]] == [it.hash for it in items]
    assert [m["num_tokens"] for m in meta["items"]] == [model.tokens_per_item(it) for it in items]
    rendered = c.post("/v1/render", files=[("image", ("a", im)) for im in images],
                      headers={"Accept": MEDIA_TYPE})
    frames = decode_body(rendered.content)
    assert unpack_meta(frames[0]) == meta
    assert mf.wire.decode(frames[1:]).in_order() == items

    # The render body forwarded as it came: misses, rows equal to the in-process encoder.
    r = c.post("/v1/encode", content=rendered.content, headers={"Content-Type": MEDIA_TYPE})
    head, data = answer_of(r.content)
    assert r.headers["x-mmferry-compat"] == head["compat"]["id"]
    assert [e["status"] for e in head["items"]] == ["miss", "miss"]
    for entry, want in zip(head["items"], expected, strict=True):
        torch.testing.assert_close(rows_of(entry, data), want, atol=1e-5, rtol=1e-5)
    # The same media as JSON through render + encode (--accept-media): now hits.
    r = c.post("/v1/encode", files=[("image", ("a", im)) for im in images],
               headers={"Accept": "application/json"})
    assert [e["status"] for e in r.json()["items"]] == ["hit", "hit"]

    hashes = [it.hash for it in items]
    assert c.post("/v1/embeddings:lookup", json={"hashes": [*hashes, "0" * 64]}).json() == \
        {"present": hashes, "missing": ["0" * 64]}
    got = c.get(f"/v1/embeddings/{hashes[1]}")
    meta1, (buf,) = answer_of(got.content)
    torch.testing.assert_close(rows_of({**meta1, "frame": 1}, [buf]), expected[1], atol=0, rtol=0)
    assert c.get(f"/v1/embeddings/{'0' * 64}").status_code == 404
    health = c.get("/health").json()
    assert health["status"] == "ok" and health["encoder"]["probe_rows"] > 0
    assert c.get("/v1/models").json()["data"][0]["id"] == "qwen2-vl"
    assert "metrics-export-port" in c.get("/metrics").text


@pytest.mark.parametrize(("send", "status", "code"), [
    (lambda c: c.post("/v1/encode", content=b"\x01\x00", headers={"Content-Type": MEDIA_TYPE}),
     400, "bad_frames"),
    (lambda c: c.post("/v1/encode", content=b"x", headers={"Content-Type": "text/plain"}),
     415, "unsupported_media_type"),
    (lambda c: c.post("/v1/render", files=[("image", ("a", b"GIF89a.."))]),
     422, "media_decode_failed"),
    (lambda c: c.post("/v1/render", files=[("image", ("a", png(0)))] * 5), 400, "too_many_items"),
    (lambda c: c.post("/v1/render", json={"media": [{"modality": "image",
                                                     "url": "http://169.254.169.254/"}]}),
     422, "url_not_allowed"),  # fetching is off until --allowed-media-domains
])
def test_bad_requests_get_the_servers_errors(local_app: Any, send: Any, status: int,
                                             code: str) -> None:
    r = send(local_app.client)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code


def test_a_tampered_item_is_refused_by_its_replica(local_app: Any, model: mf.EncoderModel) -> None:
    outputs = model.processor(images=[png(5), png(6)])
    good, bad = mf.split_items(outputs, model.field_specs(outputs)).in_order()
    pixels = bad["pixel_values"].clone()
    pixels[0, 0] += 1
    tampered = mf.Item(bad.modality, {**bad, "pixel_values": pixels}, bad.specs, hash=bad.hash)
    r = local_app.client.post("/v1/encode", content=frames_body([good, tampered]),
                              headers={"Content-Type": MEDIA_TYPE, "Accept": "application/json"})
    statuses = [(e["status"], e.get("error", {}).get("code")) for e in r.json()["items"]]
    assert statuses == [("miss", None), ("error", "hash_mismatch")]


def test_encode_batches_across_calls_by_tokens(local_app: Any, model: mf.EncoderModel) -> None:
    """Four calls of one 4-token image each, sent together: @serve.batch puts calls into one
    batch up to MAX_BATCH_TOKENS tokens (two calls), never by count."""
    from mmferry.scaleout.ray import _arrays

    calls = []
    for seed in range(20, 24):
        outputs = model.processor(images=[png(seed)])
        items = mf.split_items(outputs, model.field_specs(outputs)).in_order()
        assert model.tokens_per_item(items[0]) == 4
        calls.append({"key": items[0].hash, "tokens": 4, "frames": _arrays(mf.wire.encode(items)),
                      "answer_frames": False})

    async def send_all() -> list[Any]:
        return await asyncio.gather(*(local_app.encoder.encode.remote(c) for c in calls))

    metas = [unpack_meta(out[0]) for out in asyncio.run(send_all())]
    assert all(m["items"][0]["status"] == "miss" for m in metas)
    batches = [m["batch"] for m in metas]
    assert all(b["tokens"] <= MAX_BATCH_TOKENS for b in batches)
    assert max(b["calls"] for b in batches) == 2, batches  # across calls, and capped by tokens


def test_build_app_validates_like_the_cli() -> None:
    pytest.importorskip("ray.serve")
    from mmferry.errors import ArgumentError
    from mmferry.scaleout.ray import build_app

    with pytest.raises(ArgumentError, match="--encoder-replicas"):
        build_app({"encoder_replicas": "0"})  # as `serve run ... encoder_replicas=0` passes it
    with pytest.raises(ArgumentError, match="--max-batch-tokens"):
        build_app({"max_batch_tokens": 10, "cache_max_tokens": 5})
    with pytest.raises(ArgumentError, match="no_such_option"):
        build_app({"no_such_option": 1})
    app = build_app({"encoder_replicas": "2", "encoder_gpus": "0"})
    assert type(app).__name__ == "Application"


# ---- Ray: one real local cluster on loopback ------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    ray = pytest.importorskip("ray")
    from ray import serve

    from mmferry.scaleout.ray import build_app

    port = _free_port()
    # Logical GPUs: the encoder replicas are scheduled as on GPU nodes and run on the CPU.
    # No idle workers started ahead, no render replica until a render request (none comes):
    # every process started here costs seconds of interpreter and torch start-up.
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False, _system_config={"enable_worker_prestart": False})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"encoder_replicas": 2, "encoder_gpus": 1, "encoder_cpus": 0,
                             "render_cpus": 0, "ingress_cpus": 0, "min_render_replicas": 0,
                             "max_render_replicas": 1, "batch_wait_ms": 1, "port": port}),
                  name="mmferry", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.mark.ray_cluster
def test_a_repeated_item_lands_on_the_replica_that_cached_it(cluster: str) -> None:
    import httpx
    import ray

    start = time.monotonic()
    replicas = sorted(name.rsplit("#", 1)[1] for name in
                      (a["name"] for a in ray.util.list_named_actors(all_namespaces=True))
                      if "#Encoder#" in name)
    assert len(replicas) == 2
    model = mf.models.load("qwen2-vl", materialize=False)
    bodies = []
    for seed in range(12):  # rendered here, as a render replica would
        outputs = model.processor(images=[png(100 + seed)])
        bodies.append(frames_body(mf.split_items(outputs, model.field_specs(outputs)).in_order()))
    with httpx.Client(base_url=cluster, trust_env=False, timeout=60) as http:
        first = []
        for body in bodies:
            r = http.post("/v1/encode", content=body,
                          headers={"Content-Type": MEDIA_TYPE, "Accept": "application/json"})
            assert r.status_code == 200, r.text
            first.append(r.json())
        again = [http.post("/v1/encode", content=body, headers={
            "Content-Type": MEDIA_TYPE, "Accept": "application/json"}).json() for body in bodies]
    for a, b in zip(first, again, strict=True):
        key = a["items"][0]["hash"]
        assert a["items"][0]["status"] == "miss" and b["items"][0]["status"] == "hit"
        assert a["replica"] == b["replica"] == rank_replicas(key, replicas)[0]
    # The keys spread over both replicas (which one each gets is the ranking's, above).
    assert {a["replica"] for a in first} == set(replicas)
    assert time.monotonic() - start < 30
