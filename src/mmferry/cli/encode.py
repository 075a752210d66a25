"""``mmferry encode``: media files to per-item embeddings through the whole data path."""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import torch

from mmferry.cli.args import DEVICE, MODEL, PIXELS, options, pixel_options, validated
from mmferry.cli.table import print_table
from mmferry.encoder import EncoderCache, EncoderModel, EncoderRunner
from mmferry.errors import ArgumentError, MediaError, MmferryError
from mmferry.items import Item, split_items
from mmferry.media import samples as sample_media

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
            paths.append(sample_media.write_image(folder / f"sample-{i}-{w}x{h}.png",
                                             sample_media.photo_like(h, w, seed=i)))
        elif modality == "video":
            frames = sample_media.video_like(_SAMPLE_FRAMES, h // 2, w // 2, seed=i)
            paths.append(sample_media.write_video(folder / f"sample-{i}-video", frames))
        else:
            seconds = _SAMPLE_SECONDS[i % len(_SAMPLE_SECONDS)]
            paths.append(sample_media.write_audio(folder / f"sample-{i}-{seconds:g}s.wav",
                                             sample_media.speech_like(seconds, _SAMPLE_RATE, seed=i),
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
    samples, rate = media
    return f"{len(samples) / rate:.2f}s"


def _prepare(model: EncoderModel, path: Path, pixels: dict[str, str]) -> _FileResult:
    from mmferry.media import decode_audio, load_image, load_video

    result = _FileResult(path)
    try:
        modality = result.modality = modality_of(path)
        if modality not in model.modalities:
            raise MediaError(f"is {modality}; {model.name} takes "
                             f"{', '.join(model.modalities)}", source=str(path))
        t0 = time.perf_counter()
        # Audio at its own rate: the processor resamples it to the rate its features need.
        media: Any = (load_image(path) if modality == "image" else
                      load_video(path) if modality == "video" else decode_audio(path))
        result.media = _describe_media(modality, media)
        t1 = time.perf_counter()
        options = pixels if modality in ("image", "video") else {}
        outputs = model.processor(**{_PROCESSOR_ARGUMENT[modality]: [media]}, **options)
        t2 = time.perf_counter()
        (result.item,) = split_items(outputs, model.field_specs(outputs))[modality]
        t3 = time.perf_counter()
        result.seconds = {"decode": t1 - t0, "process": t2 - t1, "split": t3 - t2}
    except (MmferryError, OSError) as e:
        result.error = str(e) if str(path) in str(e) else f"{path}: {e}"
    return result


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _load_model(name: str, weights: Path | None, device: torch.device) -> EncoderModel:
    """The model, or a one-line usage error naming the bad key or file: a checkpoint folder
    or config.json is user input, so nothing it holds may end in a traceback."""
    from mmferry import models

    try:
        return models.load(name, weights=weights).to(device).eval()
    except MmferryError as e:  # ArgumentError (config values), CheckpointError (tensors)
        raise ArgumentError(str(e), argument="--weights") from None
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError,
            ZeroDivisionError, RuntimeError) as e:
        # A config value the model's own validation missed; still the folder's fault.
        raise ArgumentError(f"{weights}: cannot build {name} from this checkpoint "
                            f"({type(e).__name__}: {e})", argument="--weights") from None


@click.command()
@click.argument("files", nargs=-1)
@options(MODEL, DEVICE, PIXELS)
@click.option("--out", type=click.Path(dir_okay=False),
              help="Save embeddings to this .safetensors file, keyed by item hash.")
@click.option("--samples", type=int, default=None,
              help="Encode N generated samples of the model's modalities instead of FILES "
                   "(the last repeats the first).")
@click.option("--max-tokens-per-step", type=int, default=None,
              help="Bound the output tokens of one encoder call.")
@click.option("--server", default=None, metavar="URL",
              help="Encode on a running `mmferry serve` at URL (render here, encode there).")
@validated
def encode(files: tuple[str, ...], model_name: str, weights: Path | None, device: torch.device,
           pixel_dtype: str | None, resize_mode: str | None, out: Path | None,
           samples: int | None, max_tokens_per_step: int | None, server: str | None) -> None:
    """Encode media FILES into embeddings and print, per item, its tokens, embedding shape,
    cache hit or miss, modality, media and stage times. The modality comes from the file:
    images, videos (a file PyAV decodes, or a folder of frames) and audio, as the model
    takes them. Exit code 1 when any file failed (the others are still encoded)."""
    from mmferry import models

    with tempfile.TemporaryDirectory(prefix="mmferry-samples-") as tmp:
        if server is not None:
            # Render here (the processor only, no weights), encode on the server.
            model = models.load(model_name, materialize=False)
        else:
            model = _load_model(model_name, weights, device)
        paths = (write_samples(samples, Path(tmp), model.modalities) if samples
                 else [Path(f) for f in files])
        show_progress = len(paths) >= 8 and sys.stderr.isatty()
        from tqdm import tqdm

        pixels = pixel_options({"pixel_dtype": pixel_dtype, "resize_mode": resize_mode})
        results = [_prepare(model, path, pixels) for path in
                   tqdm(paths, desc="preprocess", disable=not show_progress, unit="file")]
        prepared = [r for r in results if r.item is not None]
        if server is not None:
            answers = _encode_remote(server, prepared)
            summary = (f"model {model_name} on {server}: {sum(r.item is not None for r in prepared)}"
                       f" item(s) answered, {sum(a == 'hit' for _, a in answers.values())} "
                       "cache hit(s)")
        else:
            answers, summary = _encode_here(model, device, prepared, max_tokens_per_step)
    _report(results, answers, summary, out)


def _encode_here(model: EncoderModel, device: torch.device, prepared: list[_FileResult],
                 max_tokens_per_step: int | None) -> tuple[dict[int, tuple[torch.Tensor, str]], str]:
    runner = EncoderRunner(model, EncoderCache(max_tokens=1 << 20), device=device,
                           max_tokens_per_step=max_tokens_per_step)
    embeddings = runner.encode([r.item for r in prepared], request="cli") if prepared else []
    # Items the runner refused (its checks, the step budget, the cache) fail alone.
    for i, error in runner.last.errors.items():
        prepared[i].item, prepared[i].error = None, f"{prepared[i].path}: {error}"
    answers = {id(r): (e, status) for r, e, status in
               zip(prepared, embeddings, runner.last.status, strict=True) if r.item is not None}
    last = runner.last
    summary = (f"model {model.name} on {device}: {last.encoded} item(s) encoded in "
               f"{last.encoder_calls} encoder call(s), {last.status.count('repeat')} repeat(s), "
               f"{last.hits} cache hit(s); "
               + ", ".join(f"{k} {_ms(v)} ms" for k, v in last.seconds.items()))
    return answers, summary


def _encode_remote(server: str, prepared: list[_FileResult]) -> dict[int, tuple[torch.Tensor, str]]:
    """Encode on a running ``mmferry serve`` through :mod:`mmferry.client`."""
    from mmferry.client import Client, ClientError

    try:
        with Client(server) as client:
            replies = client.encode([r.item for r in prepared]) if prepared else []
    except ClientError as e:
        raise click.ClickException(f"{server}: {e}") from None
    answers = {}
    for r, reply in zip(prepared, replies, strict=True):
        if reply.error is not None:
            r.item, r.error = None, f"{r.path}: {reply.error}"
        else:
            answers[id(r)] = (reply.rows, reply.status)
    return answers


def _report(results: list[_FileResult], answers: dict[int, tuple[torch.Tensor, str]],
            summary: str, out: Path | None) -> None:
    """The per-file table, the summary, one line per error, the --out file; exit 1 when any
    file failed."""
    rows = [("file", "tokens", "embedding", "cache", "modality", "media", "decode ms",
             "process ms", "split ms")]
    for r in results:
        if id(r) not in answers:
            rows.append((r.path.name, "-", "-", "error", r.modality or "-", r.media, "-", "-",
                         "-"))
            continue
        emb, status = answers[id(r)]
        rows.append((r.path.name, str(emb.shape[0]), "x".join(map(str, emb.shape)), status,
                     r.modality, r.media, _ms(r.seconds["decode"]), _ms(r.seconds["process"]),
                     _ms(r.seconds["split"])))
    print_table(rows)
    if answers:
        click.echo(summary)
    for r in results:
        if r.error is not None:
            click.echo(f"error: {r.error}", err=True)
    if out is not None and answers:
        from safetensors.torch import save_file

        tensors = {r.item.hash: answers[id(r)][0].detach().cpu().contiguous()
                   for r in results if id(r) in answers}
        save_file(tensors, str(out))
        click.echo(f"saved {len(tensors)} embedding(s) to {out}")
    if len(answers) != len(results):
        sys.exit(1)
