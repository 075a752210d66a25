"""``mmferry encode``: media files to per-item embeddings through the whole data path."""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from mmferry.cli.args import (
    check_device,
    check_model,
    check_out,
    check_positive,
    check_weights,
    validated,
)
from mmferry.cli.table import print_table
from mmferry.encoder import EncoderCache, EncoderModel, EncoderRunner
from mmferry.errors import MediaError, MmferryError
from mmferry.items import Item, split_items
from mmferry.media import samples

__all__ = ["encode"]

# Sizes of the generated samples (width, height); the last sample repeats the first.
_SAMPLE_SIZES = [(448, 448), (320, 240), (224, 336), (640, 480), (256, 256)]
_SAMPLE_FRAMES = 4
_SAMPLE_SECONDS = [3.0, 7.5, 1.5, 12.0, 5.0]
_SAMPLE_RATE = 16000
# How a file's extension names its modality; an unknown extension is tried as an image.
_EXTENSIONS = {
    "audio": {".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".m4a", ".aac", ".wma"},
    "video": {".mp4", ".mkv", ".webm", ".avi", ".mov", ".m4v", ".mpg", ".mpeg", ".ts", ".3gp"},
}
# The processor keyword each modality's media goes under.
_PROCESSOR_ARGUMENT = {"image": "images", "video": "videos", "audio": "audios"}


@dataclass
class _FileResult:
    path: Path
    modality: str | None = None
    media: str = "-"
    item: Item | None = None
    error: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)


def write_samples(n: int, folder: Path, modalities: tuple[str, ...]) -> list[Path]:
    """``n`` deterministic, realistic media files cycling through ``modalities`` (a video is a
    folder of PNG frames, audio a WAV file); the last repeats the first when n > 1."""
    paths: list[Path] = []
    for i in range(n):
        if n > 1 and i == n - 1:
            paths.append(paths[0])
            break
        modality = modalities[i % len(modalities)]
        w, h = _SAMPLE_SIZES[i % len(_SAMPLE_SIZES)]
        if modality == "image":
            paths.append(samples.write_image(folder / f"sample-{i}-{w}x{h}.png",
                                             samples.photo_like(h, w, seed=i)))
        elif modality == "video":
            frames = samples.video_like(_SAMPLE_FRAMES, h // 2, w // 2, seed=i)
            paths.append(samples.write_video(folder / f"sample-{i}-video", frames))
        else:
            seconds = _SAMPLE_SECONDS[i % len(_SAMPLE_SECONDS)]
            paths.append(samples.write_audio(folder / f"sample-{i}-{seconds:g}s.wav",
                                             samples.speech_like(seconds, _SAMPLE_RATE, seed=i),
                                             _SAMPLE_RATE))
    return paths


def modality_of(path: Path) -> str:
    """The modality of a media file: a folder is a video's frames; else by extension, and a
    file of unknown extension is an image when Pillow recognises its header."""
    if path.is_dir():
        return "video"
    suffix = path.suffix.lower()
    for modality, suffixes in _EXTENSIONS.items():
        if suffix in suffixes:
            return modality
    return "image"


def _describe_media(modality: str, media: Any) -> str:
    if modality == "image":
        return f"{media.width}x{media.height}"
    if modality == "video":
        return f"{len(media)}x{media[0].width}x{media[0].height}"
    return "-"


def _prepare(model: EncoderModel, path: Path) -> _FileResult:
    from mmferry.media import load_image, load_video

    result = _FileResult(path)
    try:
        modality = result.modality = modality_of(path)
        if modality not in model.modalities:
            raise MediaError(f"is {modality}; {model.name} takes "
                             f"{', '.join(model.modalities)}", source=str(path))
        t0 = time.perf_counter()
        # Audio is decoded by the processor, at the rate its features need.
        media: Any = (load_image(path) if modality == "image" else
                      load_video(path) if modality == "video" else path)
        result.media = _describe_media(modality, media)
        t1 = time.perf_counter()
        outputs = model.processor(**{_PROCESSOR_ARGUMENT[modality]: [media]})
        t2 = time.perf_counter()
        (result.item,) = split_items(outputs, model.field_specs(outputs))[modality]
        t3 = time.perf_counter()
        result.seconds = {"decode": t1 - t0, "process": t2 - t1, "split": t3 - t2}
    except (MmferryError, OSError) as e:
        result.error = str(e)
    return result


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


@click.command()
@click.argument("files", nargs=-1, type=click.Path())
@click.option("--model", "model_name", default="qwen2-vl", show_default=True,
              help="Built-in model (see `mmferry models`).")
@click.option("--weights", type=click.Path(file_okay=False),
              help="Local checkpoint folder (config.json + safetensors); default: tiny random weights.")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda[:N].")
@click.option("--out", type=click.Path(dir_okay=False),
              help="Save embeddings to this .safetensors file, keyed by item hash.")
@click.option("--samples", "sample_count", type=int, default=None,
              help="Encode N generated samples of the model's modalities instead of FILES "
                   "(the last repeats the first).")
@click.option("--max-tokens-per-step", type=int, default=None,
              help="Bound the output tokens of one encoder call.")
@validated
def encode(files: tuple[str, ...], model_name: str, weights: str | None, device: str,
           out: str | None, sample_count: int | None, max_tokens_per_step: int | None) -> None:
    """Encode media FILES into embeddings and print, per item, its modality, media, tokens,
    embedding shape, cache hit or miss and stage times. The modality comes from the file:
    images, videos (a file PyAV decodes, or a folder of frames) and audio, as the model
    takes them. Exit code 1 when any file failed (the others are still encoded)."""
    from mmferry import models

    check_model(model_name)
    weights_dir = check_weights(weights)
    dev = check_device(device)
    out_path = check_out(out)
    check_positive(sample_count, "--samples")
    check_positive(max_tokens_per_step, "--max-tokens-per-step")
    if sample_count is None and not files:
        raise click.UsageError("give FILES to encode, or --samples N")
    if sample_count is not None and files:
        raise click.UsageError("give FILES or --samples, not both")

    with tempfile.TemporaryDirectory(prefix="mmferry-samples-") as tmp:
        model = models.load(model_name, weights=weights_dir).to(dev).eval()
        paths = (write_samples(sample_count, Path(tmp), model.modalities) if sample_count
                 else [Path(f) for f in files])
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

    rows = [("file", "tokens", "embedding", "cache", "modality", "media", "decode ms",
             "process ms", "split ms")]
    by_id = dict(zip(map(id, good), embeddings, strict=True))
    for r in results:
        if r.item is None:
            rows.append((r.path.name, "-", "-", "error", r.modality or "-", r.media, "-", "-",
                         "-"))
            continue
        emb = by_id[id(r)]
        rows.append((r.path.name, str(emb.shape[0]), "x".join(map(str, emb.shape)), status[id(r)],
                     r.modality, r.media, _ms(r.seconds["decode"]), _ms(r.seconds["process"]),
                     _ms(r.seconds["split"])))
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
