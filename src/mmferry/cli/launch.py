"""``mmferry launch render``: the GPU-less render server (see :mod:`mmferry.server.render`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from mmferry.cli.args import (
    BATCHING,
    MEDIA,
    MODEL,
    NETWORK,
    PIXELS,
    POOL,
    RAY,
    options,
    pixel_options,
    validated,
)

__all__ = ["launch", "media_limits", "ray_command"]


@click.group("launch")
def launch() -> None:
    """Launch one mmferry component as a server."""


def media_limits(ns: dict[str, Any]) -> Any:
    """The media limits and fetch policy of validated options."""
    from mmferry.server.fetch import FetchPolicy
    from mmferry.server.media import MediaLimits

    all_private, networks = ns["allow_private_addresses"] or (False, ())
    policy = FetchPolicy(allowed_domains=ns["allowed_media_domains"], private_networks=networks,
                         all_private=all_private, max_bytes=ns["max_media_bytes"],
                         timeouts=ns["fetch_timeout"], max_redirects=ns["max_redirects"])
    return MediaLimits(max_items=ns["max_items"], max_media_bytes=ns["max_media_bytes"],
                       max_image_pixels=ns["max_image_pixels"],
                       local_media_path=ns["allowed_local_media_path"], fetch=policy)


@launch.command("render")
@options(MODEL, NETWORK(8100), POOL, MEDIA, PIXELS)
@validated
def render(**ns: Any) -> None:
    """Serve POST /v1/render on the CPU: media in (JSON or multipart), per-item hashes and
    token counts out (JSON), or the items themselves as mmferry frames
    (Accept: application/vnd.mmferry.frames). Loads the model's processor, never its weights.
    --pixel-dtype / --resize-mode set the default of a request's processor_kwargs.
    Also GET /health (200 after the workers' warm-up render), /v1/models, /metrics."""
    from mmferry import models
    from mmferry.server.http import serve
    from mmferry.server.render import RenderConfig, create_app

    workers = ns["workers"] or len(os.sched_getaffinity(0))
    weights: Path | None = ns["weights"]
    # The processor configuration only; this also proves the model and folder load here,
    # before any worker starts.
    model = models.load(ns["model_name"], weights, materialize=False)
    cfg = RenderConfig(model=ns["model_name"], modalities=tuple(model.modalities),
                       weights=None if weights is None else str(weights), workers=workers,
                       max_inflight=ns["max_inflight"] or 4 * workers,
                       max_request_bytes=ns["max_request_bytes"], limits=media_limits(ns),
                       api_keys=ns["api_keys"], processor_defaults=pixel_options(ns))
    serve(create_app(cfg), ns["host"], ns["port"], name="mmferry render")


@launch.command("ray")
@options(MODEL, NETWORK(8000, max_request_bytes="512MiB", any_port=False), BATCHING, MEDIA, PIXELS,
         RAY)
@click.option("--dtype", default="float32", show_default=True, help="Encoder weights dtype.")
@click.option("--accept-media", is_flag=True,
              help="POST /v1/encode also takes the JSON / multipart media of /v1/render "
                   "(rendered by the render replicas).")
@validated
def ray_command(**ns: Any) -> None:
    """Serve both servers' routes on Ray Serve (needs mmferry[ray]): render replicas on CPUs
    (autoscaled), encoder replicas on GPUs (or CPUs), each encode request routed to the
    encoder replica that holds its largest item. Routes: POST /v1/render, /v1/encode,
    /v1/embeddings:lookup; GET /v1/embeddings/{hash}, /health, /v1/models, /metrics (a
    pointer: replicas' metrics go through Ray's metrics export). --pixel-dtype /
    --resize-mode set the default of a request's processor_kwargs. Runs until interrupted."""
    import signal
    import sys
    import time

    import ray
    from ray import serve

    from mmferry.scaleout.ray import application

    ray.init(address=ns["ray_address"], include_dashboard=False, log_to_driver=False)
    # SIGTERM (a service manager, `kill`) stops it as Ctrl-C does: through the shutdown below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        serve.start(http_options={"host": ns["host"], "port": ns["port"]})
        serve.run(application(ns), name="mmferry", route_prefix="/", blocking=False)
        click.echo(f"mmferry ray: listening on http://{ns['host']}:{ns['port']}")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
