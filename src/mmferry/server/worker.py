"""Rendering media into items, and the process pool that does it off the event loop.

:func:`render_media` is the work itself (the render server's workers, and the encode
server's ``--accept-media``): header checks, the model's processor, the per-item split, in
request order. :class:`WorkerPool` runs it in ``size`` processes, one job each at a time;
a worker that dies is replaced and its job retried once on another, so no request can
leave the pool smaller.
"""

from __future__ import annotations

import asyncio
import io
import multiprocessing as mp
import os
import socket
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from PIL import Image

from mmferry import wire
from mmferry.encoder.model import EncoderModel
from mmferry.errors import ArgumentError, MediaError
from mmferry.items import Item, split_items
from mmferry.server.errors import ServerError, from_exception, item_of_source
from mmferry.server.frames import pack_meta, unpack_meta

__all__ = ["RenderJob", "WorkerDied", "WorkerPool", "render_media"]


def probe_image(data: bytes, max_pixels: int, index: int) -> None:
    """Refuse an image whose header declares more than ``max_pixels``, before any decoding."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as img:
                width, height = img.size
    except Image.DecompressionBombError as e:
        raise ServerError(422, "pixels_exceed_limit", f"decompression bomb: {e}", index) from None
    except Exception:
        return  # not an image Pillow can read a header of: the processor names the problem
    if width * height > max_pixels:
        raise ServerError(422, "pixels_exceed_limit", f"image header declares {width}x{height} = "
                          f"{width * height} pixels, more than --max-image-pixels {max_pixels}",
                          index)


def render_media(model: EncoderModel, media: Sequence[tuple[str, bytes]],
                 processor_kwargs: dict[str, Any], *, max_image_pixels: int) -> list[Item]:
    """The items of ``media`` (``(modality, bytes)`` pairs) in request order; a
    :class:`ServerError` naming the item on anything wrong with the client's input."""
    positions: dict[str, list[int]] = {}
    for i, (modality, data) in enumerate(media):
        if modality not in model.modalities:
            raise ServerError(400, "unsupported_modality", f"modality {modality!r} is not one of "
                              f"{', '.join(model.modalities)}", i, "modality")
        if modality == "image":
            probe_image(data, max_image_pixels, i)
        positions.setdefault(modality, []).append(i)
    inputs = {f"{m}s": [media[i][1] for i in idx] for m, idx in positions.items()}
    try:
        outputs = model.processor(**inputs, **processor_kwargs)
    except MediaError as e:
        local = item_of_source(e.source)
        index = None
        if local is not None and len(positions) == 1:
            index = next(iter(positions.values()))[local]
        raise from_exception(e, item=index) from None
    except ArgumentError as e:
        raise ServerError(400, "bad_request", str(e), None,
                          f"processor_kwargs.{e.argument}" if e.argument else None) from None
    items = split_items(outputs, model.field_specs(outputs))
    ordered: list[Item | None] = [None] * len(media)
    for modality, idx in positions.items():
        got = items.get(modality, [])
        if len(got) != len(idx):
            raise ServerError(500, "internal", f"the processor made {len(got)} {modality} items "
                              f"from {len(idx)}")
        for i, item in zip(idx, got, strict=True):
            ordered[i] = item
    return ordered  # type: ignore[return-value]


def item_meta(model: EncoderModel, item: Item) -> dict[str, Any]:
    return {"modality": item.modality, "hash": item.hash,
            "num_tokens": int(model.tokens_per_item(item)), "nbytes": item.nbytes}


# ---- the worker process ----------------------------------------------------------------


def _raw_socket(conn: Connection) -> socket.socket:
    """The pipe's socket, for frames as raw bytes: ``Connection`` copies a message three
    times on the way in (read, BytesIO, readinto); ``recv_into`` copies once."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(conn.fileno()))
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, 4 << 20)  # capped by the kernel's limits
    return sock


def _worker_main(conn: Connection, model_name: str, weights: str | None,
                 max_image_pixels: int) -> None:
    import torch

    from mmferry import models

    torch.set_num_threads(1)  # one process per core; the pool is the parallelism
    raw = _raw_socket(conn)
    model = models.load(model_name, weights, materialize=False)
    # Warm-up: the processor on every branch of its dummy inputs, split, hash and wire.
    dummy = model.dummy_inputs()
    wire.encode(split_items(dummy, model.field_specs(dummy)))
    conn.send_bytes(b"ready")
    while True:
        try:
            job = unpack_meta(conn.recv_bytes())
        except EOFError:
            return
        try:
            items = render_media(model, [(m, d) for m, d in job["media"]],
                                 job.get("processor_kwargs") or {},
                                 max_image_pixels=max_image_pixels)
            result = {"model": model_name, "items": [item_meta(model, it) for it in items]}
            frames = [memoryview(f).cast("B") for f in wire.encode(items)] \
                if job.get("frames") else []
        except Exception as e:  # a job never kills its worker
            err = from_exception(e)
            conn.send_bytes(pack_meta({"ok": False, **err.body()["error"], "status": err.status}))
            continue
        conn.send_bytes(pack_meta({"ok": True, "result": result,
                                   "frames": [f.nbytes for f in frames]}))
        for frame in frames:  # raw, straight from the tensors' memory: no join, no framing
            raw.sendall(frame)


class WorkerDied(RuntimeError):
    """A worker process ended while it held a job."""


@dataclass
class RenderJob:
    """Media to render; ``frames``: also make the frames response body."""

    media: list[tuple[str, bytes]]
    processor_kwargs: dict[str, Any]
    frames: bool = False


class _Worker:
    def __init__(self, ctx: Any, args: tuple[Any, ...]) -> None:
        self.conn, child = ctx.Pipe()
        self.raw = _raw_socket(self.conn)
        self.process = ctx.Process(target=_worker_main, args=(child, *args), daemon=True)
        self.process.start()
        child.close()

    def run(self, job: bytes) -> tuple[dict[str, Any], memoryview | None]:
        """Blocking: send one job, read its answer (called from a thread). With frames, the
        answer is the whole frames response body, its frames read from the pipe straight
        into their place in it (one copy)."""
        try:
            self.conn.send_bytes(job)
            meta = unpack_meta(self.conn.recv_bytes())
            if not meta.get("ok") or not meta["frames"]:
                return meta, None
            head = pack_meta(meta["result"])
            sizes = meta["frames"]
            prefix = struct.pack(f"<I{len(sizes) + 1}Q", len(sizes) + 1, len(head), *sizes)
            body = bytearray(len(prefix) + len(head) + sum(sizes))
            view = memoryview(body)
            view[:len(prefix)] = prefix
            at = len(prefix) + len(head)
            view[len(prefix):at] = head
            end = len(body)
            while at < end:
                n = self.raw.recv_into(view[at:end])
                if n == 0:
                    raise EOFError("the worker closed its pipe mid-frame")
                at += n
        except (EOFError, OSError) as e:
            raise WorkerDied(str(e)) from None
        return meta, view

    def dead(self) -> bool:
        """An idle worker never speaks first: anything readable on its pipe is its EOF."""
        return not self.process.is_alive() or self.conn.poll()

    def wait_ready(self) -> None:
        try:
            if self.conn.recv_bytes() != b"ready":
                raise WorkerDied("worker sent something other than ready")
        except (EOFError, OSError) as e:
            raise WorkerDied(f"worker died while starting ({e})") from None

    def stop(self) -> None:
        self.raw.close()
        self.conn.close()
        self.process.kill()
        self.process.join(5)


class WorkerPool:
    """``size`` render processes for model ``model_name``, started by :meth:`start`."""

    def __init__(self, size: int, model_name: str, weights: str | None, max_image_pixels: int,
                 *, on_restart: Any = None) -> None:
        self.size = size
        self._args = (model_name, weights, max_image_pixels)
        self._ctx = mp.get_context("forkserver")
        # The forkserver imports the worker module (torch, the model code) once; every worker,
        # and every replacement, forks from it ready to go.
        self._ctx.set_forkserver_preload(["mmferry.server.worker", "mmferry.models"])
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._all: list[_Worker] = []
        self._on_restart = on_restart
        self.restarts = 0
        self.ready = False
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self._all if w.process.pid is not None]

    async def _spawn(self) -> _Worker:
        worker = _Worker(self._ctx, self._args)
        await asyncio.to_thread(worker.wait_ready)
        return worker

    async def start(self) -> None:
        workers = await asyncio.gather(*(self._spawn() for _ in range(self.size)))
        for w in workers:
            self._all.append(w)
            self._idle.put_nowait(w)
        self.ready = True

    def _replace_later(self, dead: _Worker) -> None:
        task = asyncio.get_running_loop().create_task(self._replace(dead))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _replace(self, dead: _Worker) -> None:
        dead.stop()
        self._all.remove(dead)
        self.restarts += 1
        if self._on_restart is not None:
            self._on_restart()
        worker = await self._spawn()
        self._all.append(worker)
        self._idle.put_nowait(worker)

    async def run(self, job: RenderJob) -> tuple[dict[str, Any], memoryview | None]:
        """Render ``job`` on an idle worker: the result (``model``, per-item ``items``) and,
        when the job asks for frames, the frames response body. A worker dying under the job
        is replaced and the job retried once."""
        payload = pack_meta({"media": job.media, "processor_kwargs": job.processor_kwargs,
                             "frames": job.frames})
        attempt = 0
        while True:
            worker = await self._idle.get()
            if worker.dead():  # died while idle: replace it, and this job never touched it
                self._replace_later(worker)
                continue
            # Shielded: a client that goes away mid-job must not leak the worker; the job
            # finishes and the worker goes back to the idle queue either way.
            task = asyncio.ensure_future(self._on(worker, payload))
            try:
                meta, body = await asyncio.shield(task)
            except WorkerDied:
                if attempt:
                    raise ServerError(500, "worker_died", "a render worker died twice on this "
                                      "request") from None
                attempt += 1
                continue
            if not meta.get("ok"):
                raise ServerError(meta["status"], meta["code"], meta["message"], meta.get("item"),
                                  meta.get("field"))
            return meta["result"], body

    async def _on(self, worker: _Worker, payload: bytes
                  ) -> tuple[dict[str, Any], memoryview | None]:
        try:
            result = await asyncio.to_thread(worker.run, payload)
        except WorkerDied:
            self._replace_later(worker)
            raise
        self._idle.put_nowait(worker)
        return result

    def close(self) -> None:
        for w in self._all:
            w.stop()
        self._all.clear()
