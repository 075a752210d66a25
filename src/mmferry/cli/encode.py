"""``mmferry encode``: media files to per-item embeddings through the whole data path."""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
import numpy as np
import torch
from PIL import Image

from mmferry.cli.args import DEVICE, MODEL, options, validated
from mmferry.cli.table import print_table
from mmferry.encoder import EncoderCache, EncoderRunner
from mmferry.errors import MmferryError
from mmferry.items import Item, split_items

__all__ = ["encode"]

# Sizes of the generated sample images; the last sample repeats the first (a cache hit).
_SAMPLE_SIZES = [(448, 448), (320, 240), (224, 336), (640, 480), (256, 256)]


@dataclass
class _FileResult:
    path: Path
    item: Item | None = None
    error: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)


def write_samples(n: int, folder: Path) -> list[Path]:
    """``n`` deterministic PNG images of varied sizes; the last repeats the first when n > 1."""
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n):
        if n > 1 and i == n - 1:
            paths.append(paths[0])
            break
        w, h = _SAMPLE_SIZES[i % len(_SAMPLE_SIZES)]
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        path = folder / f"sample-{i}-{w}x{h}.png"
        Image.fromarray(pixels).save(path)
        paths.append(path)
    return paths


def _prepare(model, path: Path) -> _FileResult:
    from mmferry.media import load_image

    result = _FileResult(path)
    try:
        t0 = time.perf_counter()
        image = load_image(path)
        t1 = time.perf_counter()
        outputs = model.processor(images=[image])
        t2 = time.perf_counter()
        (result.item,) = split_items(outputs, model.field_specs(outputs))["image"]
        t3 = time.perf_counter()
        result.seconds = {"decode": t1 - t0, "process": t2 - t1, "split": t3 - t2}
    except (MmferryError, OSError) as e:
        result.error = str(e)
    return result


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


@click.command()
@click.argument("files", nargs=-1, type=click.Path(dir_okay=False))
@options(MODEL, DEVICE)
@click.option("--out", type=click.Path(dir_okay=False),
              help="Save embeddings to this .safetensors file, keyed by item hash.")
@click.option("--samples", type=int, default=None,
              help="Encode N generated sample images instead of FILES (the last repeats the first).")
@click.option("--max-tokens-per-step", type=int, default=None,
              help="Bound the output tokens of one encoder call.")
@click.option("--server", default=None, metavar="URL",
              help="Encode on a running `mmferry serve` at URL (render here, encode there).")
@validated
def encode(files: tuple[str, ...], model_name: str, weights: Path | None, device: torch.device,
           out: Path | None, samples: int | None, max_tokens_per_step: int | None,
           server: str | None) -> None:
    """Encode image FILES into embeddings and print, per item, its tokens, embedding shape,
    cache hit or miss and stage times. Exit code 1 when any file failed."""
    from mmferry import models

    weights_dir, dev, out_path = weights, device, out

    with tempfile.TemporaryDirectory(prefix="mmferry-samples-") as tmp:
        paths = write_samples(samples, Path(tmp)) if samples else [Path(f) for f in files]
        if server is not None:
            _encode_remote(server, model_name, paths, out_path)
            return
        model = models.load(model_name, weights=weights_dir).to(dev).eval()
        runner = EncoderRunner(model, EncoderCache(max_tokens=1 << 20), device=dev,
                               max_tokens_per_step=max_tokens_per_step)
        show_progress = len(paths) >= 8 and sys.stderr.isatty()
        results = []
        from tqdm import tqdm

        for path in tqdm(paths, desc="preprocess", disable=not show_progress, unit="file"):
            results.append(_prepare(model, path))
        budget = min(runner.max_tokens_per_step, runner.cache.max_tokens)
        for r in results:
            # An item no step can hold fails alone, before it can fail the whole run.
            if r.item is not None and (n := model.tokens_per_item(r.item)) > budget:
                r.item, r.error = None, (f"{r.path}: {n} tokens, more than the step budget of "
                                         f"{budget} (--max-tokens-per-step)")
        good = [r for r in results if r.item is not None]
        embeddings = runner.encode([r.item for r in good], request="cli") if good else []
        status = dict(zip(map(id, good), runner.last.status, strict=True))

    rows = [("file", "tokens", "embedding", "cache", "decode ms", "process ms", "split ms")]
    by_id = dict(zip(map(id, good), embeddings, strict=True))
    for r in results:
        if r.item is None:
            rows.append((r.path.name, "-", "-", "error", "-", "-", "-"))
            continue
        emb = by_id[id(r)]
        rows.append((r.path.name, str(emb.shape[0]), "x".join(map(str, emb.shape)), status[id(r)],
                     _ms(r.seconds["decode"]), _ms(r.seconds["process"]), _ms(r.seconds["split"])))
    print_table(rows)
    stages = runner.last.seconds
    if good:
        click.echo(
            f"model {model_name} on {dev}: {runner.last.encoded} item(s) encoded in "
            f"{runner.last.encoder_calls} encoder call(s), {runner.last.status.count('repeat')} "
            f"repeat(s), {runner.last.hits} cache hit(s); "
            + ", ".join(f"{k} {_ms(v)} ms" for k, v in stages.items())
        )
    for r in results:
        if r.error is not None:
            click.echo(f"error: {r.error}", err=True)

    if out_path is not None and good:
        from safetensors.torch import save_file

        tensors = {r.item.hash: by_id[id(r)].detach().cpu().contiguous() for r in good}
        save_file(tensors, str(out_path))
        click.echo(f"saved {len(tensors)} embedding(s) to {out_path}")
    if len(good) != len(results):
        sys.exit(1)


def _encode_remote(server: str, model_name: str, paths: list[Path], out_path: Path | None) -> None:
    """Render here (the processor only), encode on the server through :mod:`mmferry.client`."""
    from mmferry import models
    from mmferry.client import Client, ClientError

    model = models.load(model_name, materialize=False)
    results = [_prepare(model, path) for path in paths]
    good = [r for r in results if r.item is not None]
    try:
        with Client(server) as client:
            answers = client.encode([r.item for r in good]) if good else []
    except ClientError as e:
        raise click.ClickException(f"{server}: {e}") from None
    rows = [("file", "tokens", "embedding", "cache", "decode ms", "process ms", "split ms")]
    by_id = dict(zip(map(id, good), answers, strict=True))
    for r in results:
        a = by_id.get(id(r))
        if a is None or a.error is not None:
            if a is not None:
                r.error = f"{r.path}: {a.error}"
            rows.append((r.path.name, "-", "-", "error", "-", "-", "-"))
            continue
        emb = a.rows
        rows.append((r.path.name, str(emb.shape[0]), "x".join(map(str, emb.shape)), a.status,
                     _ms(r.seconds["decode"]), _ms(r.seconds["process"]), _ms(r.seconds["split"])))
    print_table(rows)
    ok = [a for a in answers if a.error is None]
    click.echo(f"model {model_name} on {server}: {len(ok)} item(s) answered, "
               f"{sum(a.status == 'hit' for a in ok)} cache hit(s)")
    for r in results:
        if r.error is not None:
            click.echo(f"error: {r.error}", err=True)
    if out_path is not None and ok:
        from safetensors.torch import save_file

        tensors = {a.hash: a.rows.contiguous() for a in ok}
        save_file(tensors, str(out_path))
        click.echo(f"saved {len(tensors)} embedding(s) to {out_path}")
    if len(ok) != len(results):
        sys.exit(1)
