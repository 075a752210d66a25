"""``mmferry serve``: the encoder server (see :mod:`mmferry.server.encode`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from mmferry.cli.args import BATCHING, DEVICE, MEDIA, MODEL, NETWORK, options, validated
from mmferry.cli.launch import media_limits

__all__ = ["serve_command", "weights_revision"]


def weights_revision(folder: Path | None) -> str:
    """A content id of a checkpoint: its config.json and each safetensors file's header
    (names, dtypes, shapes, offsets) and size; ``random-seed-0`` for the seeded weights."""
    if folder is None:
        from mmferry.models import SEED

        return f"random-seed-{SEED}"
    import struct

    from blake3 import blake3

    h = blake3()
    h.update((folder / "config.json").read_bytes())
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            head = f.read(8)
            (n,) = struct.unpack("<Q", head) if len(head) == 8 else (0,)
            h.update(path.name.encode() + head + f.read(min(n, 100 << 20)))
        h.update(str(path.stat().st_size).encode())
    return h.hexdigest()[:16]


@click.command("serve")
@options(MODEL, DEVICE, NETWORK(8200, max_request_bytes="512MiB"), BATCHING, MEDIA)
@click.option("--dtype", default="float32", show_default=True, help="Encoder weights dtype.")
@click.option("--accept-media", is_flag=True,
              help="POST /v1/encode also takes the JSON / multipart media of /v1/render, "
                   "rendered in-process under the media options.")
@validated
def serve_command(**ns: Any) -> None:
    """Serve POST /v1/encode: rendered items (mmferry frames) in, per item its hash, status
    (hit / miss / error), token count and embedding rows out (frames, or JSON without rows
    with Accept: application/json). Requests that arrive together are batched by tokens;
    one encoder cache serves them all. Also POST /v1/embeddings:lookup,
    GET /v1/embeddings/{hash}, /health (a tiny encode), /v1/models, /metrics."""
    from mmferry import models
    from mmferry.server.encode import EncodeConfig, create_app
    from mmferry.server.http import serve

    device = ns["device"]
    model = models.load(ns["model_name"], ns["weights"], dtype=ns["dtype"]).to(device).eval()
    cfg = EncodeConfig(model=ns["model_name"], weights_revision=weights_revision(ns["weights"]),
                       max_batch_tokens=ns["max_batch_tokens"], batch_wait_ms=ns["batch_wait_ms"],
                       cache_max_tokens=ns["cache_max_tokens"],
                       max_request_bytes=ns["max_request_bytes"], accept_media=ns["accept_media"],
                       limits=media_limits(ns), api_keys=ns["api_keys"])
    serve(create_app(cfg, model, device), ns["host"], ns["port"], name="mmferry serve")
