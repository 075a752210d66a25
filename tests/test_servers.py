"""The render and encode servers, as real processes on 127.0.0.1 (ephemeral ports).

Nothing here contacts a non-loopback address: URLs naming 169.254.169.254 or outside hosts
are refused by the server before it connects anywhere (the refusal code proves it: a
connection attempt would end in a fetch failure or timeout, not an address refusal).
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import re
import signal
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from _servers import ServerProcess
from click.testing import CliRunner
from PIL import Image

import mmferry as mf
from mmferry import wire
from mmferry.client import Client, ClientError
from mmferry.server.frames import MEDIA_TYPE, encode_body, pack_meta

API_KEY = "test-key-0123"
FETCH_HOST = "127.0.0.2"  # the one loopback address the render server may fetch from


def png(w: int, h: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def png_header_only(w: int, h: int) -> bytes:
    """A PNG whose header declares ``w``x``h`` (and holds no pixels)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


IMAGE = png(64, 48, 0)


def ramp_png() -> bytes:
    """Smooth, so it compresses far below the body cap; large, so rendering takes a while."""
    ramp = np.linspace(0, 255, 1600 * 1200 * 3).astype(np.uint8).reshape(1200, 1600, 3)
    buf = io.BytesIO()
    Image.fromarray(ramp).save(buf, "PNG")
    return buf.getvalue()


class _Media(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/img.png":
            self._send(200, IMAGE)
        elif self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "http://169.254.169.254/latest/meta-data/")
            self.end_headers()
        elif self.path == "/big":
            self.send_response(200)
            self.end_headers()  # no Content-Length: only the streaming cap can stop it
            for _ in range(64):
                self.wfile.write(b"\0" * (64 << 10))
        elif self.path == "/slow":
            time.sleep(3)
            self._send(200, IMAGE)
        else:
            self._send(404, b"")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError):  # the server gave up on it (timeout case)
            self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class _Listener:
    """A loopback socket that counts the connections it gets (it must get none)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop = True
        self._thread.join(1)
        self.sock.close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    tmp = tmp_path_factory.mktemp("servers")
    media = ThreadingHTTPServer((FETCH_HOST, 0), _Media)
    threading.Thread(target=media.serve_forever, daemon=True).start()
    listener = _Listener()
    (tmp / "local").mkdir()
    (tmp / "local" / "img.png").write_bytes(IMAGE)
    render = ServerProcess(
        "launch", "render", "--workers", "2", "--max-items", "4", "--max-request-bytes", "2MiB",
        "--max-media-bytes", "1MiB", "--api-key", API_KEY, "--fetch-timeout", "image=1",
        "--max-inflight", "2", "--resize-mode", "exact",
        "--allowed-media-domains", f"127.0.0.1,{FETCH_HOST},169.254.169.254,localhost",
        "--allow-private-addresses", f"{FETCH_HOST}/32",
        "--allowed-local-media-path", str(tmp / "local"), log=tmp / "render.log")
    encode = ServerProcess("serve", "--batch-wait-ms", "150", "--max-batch-tokens", "4096",
                           "--accept-media", log=tmp / "serve.log")
    try:
        yield {"render": render.wait_ready(), "serve": encode.wait_ready(),
               "media": f"http://{FETCH_HOST}:{media.server_address[1]}",
               "listener": str(listener.port)}
        assert listener.accepted == 0
    finally:
        render.stop()
        encode.stop()
        media.shutdown()
        listener.close()


@pytest.fixture(scope="module")
def model() -> mf.EncoderModel:
    return mf.models.load("qwen2-vl")


def in_process(model: mf.EncoderModel, images: list[bytes]) -> tuple[list[mf.Item], list[torch.Tensor]]:
    # The render server runs with --resize-mode exact: equal hashes show it applied the flag.
    outputs = model.processor(images=images, resize_mode="exact")
    items = mf.split_items(outputs, model.field_specs(outputs)).in_order()
    return items, mf.EncoderRunner(model).encode(items)


def test_render_then_serve_equals_in_process(servers: dict[str, str], model: mf.EncoderModel) -> None:
    images = [png(448, 448, 1), png(320, 240, 2), png(224, 336, 3)]
    items, expected = in_process(model, images)
    with Client(servers["render"], api_key=API_KEY) as render, Client(servers["serve"]) as enc:
        rendered = render.render(images=images)
        assert [m["hash"] for m in rendered.meta] == [it.hash for it in items]
        assert [m["num_tokens"] for m in rendered.meta] == [model.tokens_per_item(it) for it in items]
        assert all(a == b for a, b in zip(rendered.items, items, strict=True))
        meta_only = render.render(images=images, items=False)
        assert meta_only.meta == rendered.meta

        answers = enc.encode(rendered)  # the render body, forwarded as it came
        assert [a.status for a in answers] == ["miss"] * 3
        for a, want in zip(answers, expected, strict=True):
            assert a.error is None and a.rows is not None
            torch.testing.assert_close(a.rows, want, atol=1e-5, rtol=1e-5)
        again = enc.encode(rendered.items)  # items re-framed by the client: all hits
        assert [a.status for a in again] == ["hit"] * 3
        assert enc.compat is not None and enc.compat["model"] == "qwen2-vl"
        assert enc.compat["hidden_size"] == model.hidden_size

        hashes = [it.hash for it in items]
        assert enc.lookup([*hashes, "0" * 64]) == {"present": hashes, "missing": ["0" * 64]}
        torch.testing.assert_close(enc.embedding(hashes[0]), answers[0].rows, atol=0, rtol=0)
        assert enc.embedding("0" * 64) is None
    r = httpx.get(f"{servers['serve']}/health", trust_env=False)
    assert r.status_code == 200 and r.json()["probe_rows"] > 0
    assert r.headers["x-mmferry-compat"] == r.json()["compat"]["id"]


def test_render_ships_uint8_levels_and_float32_on_request(servers: dict[str, str],
                                                         model: mf.EncoderModel) -> None:
    images = [png(320, 240, 4), png(224, 336, 5)]
    with Client(servers["render"], api_key=API_KEY) as render, Client(servers["serve"]) as enc:
        levels = render.render(images=images)
        floats = render.render(images=images, processor_kwargs={"pixel_dtype": "float32"})
        assert all(it["pixel_values"].dtype == torch.uint8 for it in levels.items)
        assert all(it.specs["pixel_values"].normalize == model.normalize for it in levels.items)
        assert all(it["pixel_values"].dtype == torch.float32 for it in floats.items)
        assert sum(it.nbytes for it in levels.items) * 7 < sum(it.nbytes for it in floats.items)
        for a, b in zip(enc.encode(levels), enc.encode(floats), strict=True):
            assert a.error is None and b.error is None
            assert (a.rows - b.rows).abs().max() < 1e-5


def _json(url: str, entry: dict[str, str], **kw: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/render", json={"media": [entry]}, trust_env=False, timeout=30,
                      headers={"Authorization": f"Bearer {API_KEY}"}, **kw)


def _post(url: str, **kw: object) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}", **kw.pop("headers", {})}  # type: ignore[dict-item]
    return httpx.post(f"{url}/v1/render", headers=headers, trust_env=False, timeout=30, **kw)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _url(url: str) -> object:
    return lambda s: _json(s["render"], {"modality": "image", "url": url.format(**s)})


def _data(data: bytes, modality: str = "image") -> object:
    return lambda s: _json(s["render"], {"modality": modality, "data": _b64(data)})


def _upload(*parts: tuple[str, tuple[str, bytes]]) -> object:
    return lambda s: _post(s["render"], files=list(parts))


def _raw(content: bytes, ctype: str) -> object:
    return lambda s: _post(s["render"], content=content, headers={"Content-Type": ctype})


# case -> (send it, status, code)
BAD_REQUESTS = {
    "truncated base64": (lambda s: _json(s["render"], {"modality": "image",
                                                       "data": _b64(IMAGE)[:-3]}),
                         400, "invalid_base64"),
    "wrong content type": (_raw(b"hello", "text/plain"), 415, "unsupported_media_type"),
    "body over the limit": (_raw(b"x" * (3 << 20), "application/json"), 413, "payload_too_large"),
    "100k x 100k header": (_upload(("image", ("a", png_header_only(100_000, 100_000)))),
                           422, "pixels_exceed_limit"),
    "too many items": (_upload(*[("image", ("a", IMAGE))] * 5), 400, "too_many_items"),
    "undecodable image": (_data(b"GIF89a.."), 422, "media_decode_failed"),
    "modality the model lacks": (_data(b"x", "audio"), 400, "unsupported_modality"),
    "url to 127.0.0.1": (_url("http://127.0.0.1:{listener}/a.png"), 422, "address_not_allowed"),
    "localhost resolves to loopback": (_url("http://localhost:{listener}/a.png"),
                                       422, "address_not_allowed"),
    "url to 169.254.169.254": (_url("http://169.254.169.254/latest/meta-data/"),
                               422, "address_not_allowed"),
    "domain not allowed": (_url("http://example.com/a.png"), 422, "domain_not_allowed"),
    "redirect to a private address": (_url("{media}/redirect"), 422, "address_not_allowed"),
    "stream over the byte cap": (_url("{media}/big"), 422, "media_too_large"),
    "fetch past its timeout": (_url("{media}/slow"), 422, "media_fetch_timeout"),
    "path outside the allowed folder": (lambda s: _json(s["render"], {
        "modality": "image", "path": "../../etc/passwd"}), 422, "path_not_allowed"),
    "no api key": (lambda s: httpx.post(f"{s['render']}/v1/render", json={}, trust_env=False),
                   401, "unauthorized"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_render_requests_get_their_4xx_and_the_server_stays_up(
        servers: dict[str, str], case: str) -> None:
    send, status, code = BAD_REQUESTS[case]
    r = send(servers)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    assert set(r.json()["error"]) == {"code", "message", "item", "field"}
    ok = _json(servers["render"], {"modality": "image", "data": _b64(IMAGE)})
    assert ok.status_code == 200, ok.text


def test_fetch_local_path_and_upload_give_one_hash(servers: dict[str, str]) -> None:
    fetched = _json(servers["render"], {"modality": "image", "url": f"{servers['media']}/img.png"})
    local = _json(servers["render"], {"modality": "image", "path": "img.png"})
    uploaded = _post(servers["render"], files=[("image", ("a", IMAGE))])
    hashes = {r.json()["items"][0]["hash"] for r in (fetched, local, uploaded)}
    assert len(hashes) == 1
    metrics = httpx.get(f"{servers['render']}/metrics", trust_env=False).text
    rejected = r'mmferry:media_rejected_total\{model_name="qwen2-vl",reason="address_not_allowed"\} '
    assert re.search(rejected + "[1-9]", metrics)
    assert "mmferry:render_latency_seconds_bucket" in metrics


def test_a_killed_worker_is_replaced(servers: dict[str, str]) -> None:
    url = servers["render"]
    before = httpx.get(f"{url}/health", trust_env=False).json()
    big = ramp_png()
    # float32 and exact: the slowest render, so the kill lands while it is in flight.
    slow = json.dumps({"pixel_dtype": "float32", "resize_mode": "exact"})
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_post, url, files=[("image", ("a", big)),
                                                 ("processor_kwargs", (None, slow))])
        time.sleep(0.1)
        for pid in before["workers"]:  # every worker, so the in-flight request loses its own
            os.kill(pid, signal.SIGKILL)
        r = pending.result()
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 30
    while True:
        # A worker that died idle is found, and replaced, when a job would go to it.
        assert _json(url, {"modality": "image", "data": _b64(IMAGE)}).status_code == 200
        after = httpx.get(f"{url}/health", trust_env=False).json()
        if not set(after["workers"]) & set(before["workers"]) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert after["restarts"] >= before["restarts"] + 2
    assert len(after["workers"]) == 2 and not set(after["workers"]) & set(before["workers"])


def _encoder_calls(url: str) -> float:
    text = httpx.get(f"{url}/metrics", trust_env=False).text
    return float(re.search(r'^mmferry:encoder_calls_total\{[^}]*\} (\S+)$', text, re.M).group(1))


def test_concurrent_requests_are_batched(servers: dict[str, str], model: mf.EncoderModel) -> None:
    n = 6
    images = [png(56 + 28 * i, 84, 100 + i) for i in range(n)]
    items, expected = in_process(model, images)
    before = _encoder_calls(servers["serve"])
    with Client(servers["serve"]) as enc, ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(lambda it: enc.encode([it])[0], items))
    calls = _encoder_calls(servers["serve"]) - before
    assert [a.status for a in answers] == ["miss"] * n
    assert 1 <= calls < n
    for a, want in zip(answers, expected, strict=True):
        torch.testing.assert_close(a.rows, want, atol=1e-5, rtol=1e-5)


def test_a_malformed_item_fails_alone(servers: dict[str, str], model: mf.EncoderModel) -> None:
    (good, other), _ = in_process(model, [png(56, 56, 11), png(84, 56, 12)])
    short = mf.Item("image", {**other, "pixel_values": other["pixel_values"][:-4]}, other.specs)
    with Client(servers["serve"]) as enc:
        answers = enc.encode([good, short])
    assert answers[0].status in ("miss", "hit") and answers[0].rows is not None
    assert answers[1].status == "error" and answers[1].error is not None
    assert (answers[1].error.code, answers[1].error.field, answers[1].error.item) == \
        ("invalid_item", "pixel_values", 1)


def test_a_lying_hash_is_refused(servers: dict[str, str], model: mf.EncoderModel) -> None:
    (good,), _ = in_process(model, [png(56, 84, 13)])
    liar = mf.Item("image", dict(good), good.specs, hash="ab" * 32)
    body = b"".join(encode_body([pack_meta({}), *wire.encode([liar])]))
    r = httpx.post(f"{servers['serve']}/v1/encode", content=body, trust_env=False,
                   headers={"Content-Type": MEDIA_TYPE, "Accept": "application/json"})
    assert r.status_code == 200
    (entry,) = r.json()["items"]
    assert entry["status"] == "error" and entry["error"]["code"] == "hash_mismatch"


@pytest.mark.parametrize(("content", "ctype", "status", "code"), [
    (b"\x02\x00\x00\x00garbage", MEDIA_TYPE, 400, "bad_frames"),
    (b"hello", "text/plain", 415, "unsupported_media_type"),
    (b'{"media": [{"modality": "image", "data": "abc"}]}', "application/json", 400,
     "invalid_base64"),
])
def test_bad_encode_requests(servers: dict[str, str], content: bytes, ctype: str, status: int,
                             code: str) -> None:
    r = httpx.post(f"{servers['serve']}/v1/encode", content=content, trust_env=False,
                   headers={"Content-Type": ctype})
    assert r.status_code == status and r.json()["error"]["code"] == code
    assert httpx.get(f"{servers['serve']}/health", trust_env=False).status_code == 200


def test_encode_cli_with_server(servers: dict[str, str], tmp_path: Path) -> None:
    from mmferry.cli import main

    out = tmp_path / "emb.safetensors"
    result = CliRunner().invoke(main, ["encode", "--samples", "3", "--server", servers["serve"],
                                       "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.output.splitlines()[1:4]]
    assert [r[3] for r in rows] == ["miss", "miss", "hit"]  # the third repeats the first
    assert rows[2][1] == rows[0][1] and rows[2][2] == rows[0][2]
    assert out.is_file()


def test_client_raises_server_errors(servers: dict[str, str]) -> None:
    with Client(servers["render"]) as render, pytest.raises(ClientError) as e:
        render.render(images=[IMAGE])
    assert (e.value.status, e.value.code) == (401, "unauthorized")


def test_past_max_inflight_is_503_with_retry_after(servers: dict[str, str]) -> None:
    big = ramp_png()
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: _post(servers["render"], files=[("image", ("a", big))]),
                                range(6)))
    statuses = sorted(r.status_code for r in answers)
    assert set(statuses) == {200, 503} and statuses.count(200) >= 2
    refused = next(r for r in answers if r.status_code == 503)
    assert refused.json()["error"]["code"] == "overloaded" and refused.headers["retry-after"] == "1"
    assert _json(servers["render"], {"modality": "image", "data": _b64(IMAGE)}).status_code == 200


def test_serve_accepts_media_in_process(servers: dict[str, str], model: mf.EncoderModel) -> None:
    image = png(112, 84, 21)
    (item,), (want,) = in_process(model, [image])
    r = httpx.post(f"{servers['serve']}/v1/encode", trust_env=False, timeout=30,
                   json={"media": [{"modality": "image", "data": _b64(image)}]},
                   headers={"Accept": "application/json"})
    assert r.status_code == 200, r.text
    (entry,) = r.json()["items"]
    assert entry["hash"] == item.hash and entry["num_tokens"] == want.shape[0]
    with Client(servers["serve"]) as enc:
        torch.testing.assert_close(enc.embedding(item.hash), want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_serve_on_cuda_matches_the_cpu(tmp_path: Path, model: mf.EncoderModel) -> None:
    items, expected = in_process(model, [png(448, 448, 31), png(224, 336, 32)])
    server = ServerProcess("serve", "--device", "cuda", log=tmp_path / "cuda.log")
    try:
        with Client(server.wait_ready()) as enc:
            answers = enc.encode(items)
            assert enc.compat is not None
    finally:
        server.stop()
    for a, want in zip(answers, expected, strict=True):
        assert a.status == "miss"
        torch.testing.assert_close(a.rows, want, atol=1e-4, rtol=1e-4)
