"""The one argument-validation path of every subcommand and server.

Subcommands are built from shared option groups (:data:`MODEL`, :data:`NETWORK`,
:data:`MEDIA`, ...). :func:`validate` is one pure function over the parsed options: it picks
its checks by which options the namespace holds (every option that has a check in
:data:`CHECKS`; every rule in :data:`RULES` whose options are all present), never by the
subcommand's name, so a new subcommand gets every check of every option it takes. It only
reads the values (and, for paths, the file system): no model is loaded, no port bound, no
device touched beyond asking whether CUDA exists. :func:`validated` runs it before a
command's body and turns an :class:`~mmferry.errors.ArgumentError` into a usage error
(exit code 2) that names the flag.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import click

from mmferry.errors import ArgumentError

__all__ = [
    "BATCHING",
    "CHECKS",
    "DEVICE",
    "MEDIA",
    "MODEL",
    "NETWORK",
    "PIXELS",
    "POOL",
    "RAY",
    "RULES",
    "Check",
    "check_device",
    "check_model",
    "check_out",
    "check_positive",
    "check_weights",
    "options",
    "parse_size",
    "pixel_options",
    "validate",
    "validated",
]

T = TypeVar("T", bound=Callable[..., Any])

# ---- checks of one value: each returns it normalised or raises ArgumentError -------------


def check_model(name: str, argument: str = "--model") -> str:
    from mmferry import models

    known = models.names()
    if name not in known:
        raise ArgumentError(f"unknown model {name!r}; known: {', '.join(known)}", argument=argument)
    return name


def check_weights(path: str | Path | None) -> Path | None:
    if path is None:
        return None
    p = Path(path)
    if not p.is_dir():
        raise ArgumentError(f"{p} is not a directory", argument="--weights")
    if not (p / "config.json").is_file():
        raise ArgumentError(f"{p} has no config.json", argument="--weights")
    return p


def check_device(device: str) -> Any:
    from mmferry.transfer import parse_device

    return parse_device(device, argument="--device", types=("cpu", "cuda"))


def check_simulated_device(device: str) -> str:
    """The audit's device is simulated: an accelerator name, which need not exist here."""
    from mmferry.transfer import parse_device

    parse_device(device, argument="--device", simulated=True)
    return device


def check_dtype(dtype: str) -> str:
    import torch

    if not isinstance(getattr(torch, dtype, None), torch.dtype) or \
            not getattr(torch, dtype).is_floating_point:
        raise ArgumentError(f"not a floating-point dtype: {dtype!r}", argument="--dtype")
    return dtype


def check_out(path: str | None, *, suffix: str = ".safetensors") -> Path | None:
    """A file the run can write, checked before any work starts: a run must not end by
    losing its results (a directory, a read-only file or folder, a missing folder)."""
    import tempfile

    if path is None:
        return None
    p = Path(path)
    if p.suffix != suffix:
        raise ArgumentError(f"expected a {suffix} file, got {p.name}", argument="--out")
    if not p.parent.is_dir():
        raise ArgumentError(f"directory {p.parent} does not exist", argument="--out")
    if p.is_dir():
        raise ArgumentError(f"{p} is a directory", argument="--out")
    if p.exists() and not os.access(p, os.W_OK):
        raise ArgumentError(f"{p} is not writable", argument="--out")
    try:
        with tempfile.NamedTemporaryFile(dir=p.parent, prefix=".mmferry-"):
            pass
    except OSError as e:
        raise ArgumentError(f"cannot write in {p.parent} ({e.strerror or e})",
                            argument="--out") from None
    return p


def check_positive(value: int | None, argument: str) -> int | None:
    if value is not None and value < 1:
        raise ArgumentError(f"must be a positive integer, got {value}", argument=argument)
    return value


def _non_negative(value: float, argument: str) -> float:
    if value < 0:
        raise ArgumentError(f"must not be negative, got {value}", argument=argument)
    return value


_SIZE = re.compile(r"(\d+)\s*([kmg]i?b?|b)?", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "ki": 1 << 10, "m": 10**6,
          "mb": 10**6, "mib": 1 << 20, "mi": 1 << 20, "g": 10**9, "gb": 10**9, "gib": 1 << 30,
          "gi": 1 << 30}


def parse_size(value: str | int, argument: str) -> int:
    """``1048576``, ``64MiB``, ``10MB``, ``2GiB`` -> bytes (positive)."""
    if isinstance(value, int):
        size = value
    else:
        m = _SIZE.fullmatch(value.strip())
        if m is None:
            raise ArgumentError(f"not a size: {value!r} (e.g. 64MiB, 10MB, 1048576)",
                                argument=argument)
        size = int(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
    if size < 1:
        raise ArgumentError(f"must be a positive size, got {value!r}", argument=argument)
    return size


def check_port(port: int) -> int:
    if not 0 <= port <= 65535:
        raise ArgumentError(f"must be 0..65535 (0: any free port), got {port}", argument="--port")
    return port


def check_host(host: str) -> str:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if host != "localhost" and not re.fullmatch(r"[A-Za-z0-9.-]+", host):
            raise ArgumentError(f"not an address to bind: {host!r}", argument="--host") from None
    return host


def check_api_keys(keys: tuple[str, ...]) -> tuple[str, ...]:
    if any(len(k) < 8 or k != k.strip() for k in keys):
        raise ArgumentError("an API key must be at least 8 characters, without surrounding space",
                            argument="--api-key")
    return tuple(keys)


def check_server(url: str) -> str:
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ArgumentError(f"expected http(s)://HOST[:PORT], got {url!r}", argument="--server")
    return url.rstrip("/")


_DOMAIN = re.compile(r"(\*\.)?[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]*"
                     r"[A-Za-z0-9])?)*\.?")


def check_domains(values: tuple[str, ...]) -> tuple[str, ...]:
    out = []
    for value in values:
        for entry in filter(None, (e.strip() for e in value.split(","))):
            try:
                ipaddress.ip_address(entry)
            except ValueError:
                if entry != "*" and not _DOMAIN.fullmatch(entry):
                    raise ArgumentError(f"{entry!r} is not a host name, *.domain, an IP "
                                        "address or *", argument="--allowed-media-domains") from None
            out.append(entry.lower())
    return tuple(out)


def check_private(value: str) -> tuple[bool, tuple[Any, ...]]:
    """``all`` (the bare flag) or comma-separated networks (``127.0.0.0/8,10.1.0.0/16``)."""
    if value.strip().lower() == "all":
        return True, ()
    nets = []
    for entry in filter(None, (e.strip() for e in value.split(","))):
        try:
            nets.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            raise ArgumentError(f"{entry!r} is not a network (e.g. 127.0.0.0/8) or 'all'",
                                argument="--allow-private-addresses") from None
    if not nets:
        raise ArgumentError("give 'all' or networks", argument="--allow-private-addresses")
    return False, tuple(nets)


def check_local_path(path: str) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise ArgumentError(f"{p} is not a directory", argument="--allowed-local-media-path")
    return Path(os.path.realpath(p))


def check_fetch_timeout(value: str) -> dict[str, float]:
    """``image=5,video=30,audio=10`` (seconds per modality) or one number for all."""
    try:
        seconds = float(value)
    except ValueError:
        out = {}
        for entry in filter(None, (e.strip() for e in value.split(","))):
            modality, sep, number = entry.partition("=")
            try:
                out[modality.strip()] = float(number) if sep else float("nan")
            except ValueError:
                out[modality.strip()] = float("nan")
        if not out or any(not (v > 0) or not k for k, v in out.items()):
            raise ArgumentError(f"expected MODALITY=SECONDS[,...] with positive seconds, got "
                                f"{value!r}", argument="--fetch-timeout") from None
        return out
    if not seconds > 0:
        raise ArgumentError(f"must be positive, got {value!r}", argument="--fetch-timeout")
    return {"image": seconds, "video": seconds, "audio": seconds}


def check_choice(value: str, choices: tuple[str, ...], argument: str) -> str:
    if value not in choices:
        raise ArgumentError(f"{value!r} is not one of {', '.join(choices)}", argument=argument)
    return value


@dataclass(frozen=True)
class Check:
    """The check of one option: its flag (how errors name it) and the function."""

    flag: str
    fn: Callable[[Any], Any]


def _positive(flag: str) -> Check:
    return Check(flag, lambda v: check_positive(v, flag))


def _size(flag: str) -> Check:
    return Check(flag, lambda v: parse_size(v, flag))


#: option (namespace key) -> its check; applied whenever the namespace holds the option.
CHECKS: dict[str, Check] = {
    "model_name": Check("--model", check_model),
    "model_names": Check("MODEL", lambda names: tuple(check_model(n, "MODEL") for n in names)),
    "weights": Check("--weights", check_weights),
    "device": Check("--device", check_device),
    "simulated_device": Check("--device", check_simulated_device),
    "dtype": Check("--dtype", check_dtype),
    "out": Check("--out", check_out),
    "samples": _positive("--samples"),
    "max_tokens_per_step": _positive("--max-tokens-per-step"),
    "server": Check("--server", check_server),
    "host": Check("--host", check_host),
    "port": Check("--port", check_port),
    "api_keys": Check("--api-key", check_api_keys),
    "workers": _positive("--workers"),
    "max_inflight": _positive("--max-inflight"),
    "max_request_bytes": _size("--max-request-bytes"),
    "max_media_bytes": _size("--max-media-bytes"),
    "max_image_pixels": _positive("--max-image-pixels"),
    "max_items": _positive("--max-items"),
    "max_redirects": Check("--max-redirects", lambda v: int(_non_negative(v, "--max-redirects"))),
    "fetch_timeout": Check("--fetch-timeout", check_fetch_timeout),
    "allowed_media_domains": Check("--allowed-media-domains", check_domains),
    "allow_private_addresses": Check("--allow-private-addresses", check_private),
    "allowed_local_media_path": Check("--allowed-local-media-path", check_local_path),
    "max_batch_tokens": _positive("--max-batch-tokens"),
    "batch_wait_ms": Check("--batch-wait-ms", lambda v: _non_negative(v, "--batch-wait-ms")),
    "cache_max_tokens": _positive("--cache-max-tokens"),
    "min_render_replicas": Check("--min-render-replicas",
                                 lambda v: int(_non_negative(v, "--min-render-replicas"))),
    "max_render_replicas": _positive("--max-render-replicas"),
    "encoder_replicas": _positive("--encoder-replicas"),
    "render_cpus": Check("--render-cpus", lambda v: _non_negative(v, "--render-cpus")),
    "encoder_cpus": Check("--encoder-cpus", lambda v: _non_negative(v, "--encoder-cpus")),
    "encoder_gpus": Check("--encoder-gpus", lambda v: _non_negative(v, "--encoder-gpus")),
    "ingress_cpus": Check("--ingress-cpus", lambda v: _non_negative(v, "--ingress-cpus")),
    "imbalance_threshold": Check("--imbalance-threshold",
                                 lambda v: int(_non_negative(v, "--imbalance-threshold"))),
    "router": Check("--router", lambda v: check_choice(v, ("affinity", "pow2"), "--router")),
}


def _one_of_files_or_samples(ns: Mapping[str, Any]) -> None:
    if ns["samples"] is None and not ns["files"]:
        raise ArgumentError("give FILES to encode, or --samples N", argument="FILES")
    if ns["samples"] is not None and ns["files"]:
        raise ArgumentError("give FILES or --samples, not both", argument="--samples")


def _server_without_weights(ns: Mapping[str, Any]) -> None:
    if ns["server"] is not None and ns["weights"] is not None:
        raise ArgumentError("the server encodes with its own weights; drop --weights",
                            argument="--server")


def _models_or_all(ns: Mapping[str, Any]) -> None:
    if ns["all_models"] and ns["model_names"]:
        raise ArgumentError("give model names or --all, not both", argument="--all")


def _batch_fits_cache(ns: Mapping[str, Any]) -> None:
    if ns["max_batch_tokens"] > ns["cache_max_tokens"]:
        raise ArgumentError(f"{ns['max_batch_tokens']} is more than --cache-max-tokens "
                            f"{ns['cache_max_tokens']}", argument="--max-batch-tokens")


def _pixels_need_images(ns: Mapping[str, Any]) -> None:
    from mmferry import models

    modalities = models.model_class(ns["model_name"]).modalities
    for key, flag in (("pixel_dtype", "--pixel-dtype"), ("resize_mode", "--resize-mode")):
        if ns[key] is not None and not {"image", "video"} & set(modalities):
            raise ArgumentError(f"{ns['model_name']} takes no images or videos",
                                argument=flag)


def pixel_options(ns: Mapping[str, Any]) -> dict[str, str]:
    """The processor keywords ``--pixel-dtype`` / ``--resize-mode`` give (those set only)."""
    return {k: ns[k] for k in ("pixel_dtype", "resize_mode") if ns.get(k) is not None}


def _private_needs_domains(ns: Mapping[str, Any]) -> None:
    if ns["allow_private_addresses"] is not None and not ns["allowed_media_domains"]:
        raise ArgumentError("only applies to fetched URLs; give --allowed-media-domains too",
                            argument="--allow-private-addresses")


def _render_replicas_range(ns: Mapping[str, Any]) -> None:
    if ns["min_render_replicas"] > ns["max_render_replicas"]:
        raise ArgumentError(f"{ns['min_render_replicas']} is more than --max-render-replicas "
                            f"{ns['max_render_replicas']}", argument="--min-render-replicas")


def _ray_port(ns: Mapping[str, Any]) -> None:
    if ns["port"] == 0:
        raise ArgumentError("Ray Serve's HTTP proxy needs a fixed port", argument="--port")


#: (options that must all be in the namespace, the rule over them), applied in order.
RULES: list[tuple[frozenset[str], Callable[[Mapping[str, Any]], None]]] = [
    (frozenset({"files", "samples"}), _one_of_files_or_samples),
    (frozenset({"server", "weights"}), _server_without_weights),
    (frozenset({"all_models", "model_names"}), _models_or_all),
    (frozenset({"max_batch_tokens", "cache_max_tokens"}), _batch_fits_cache),
    (frozenset({"allow_private_addresses", "allowed_media_domains"}), _private_needs_domains),
    (frozenset({"model_name", "pixel_dtype", "resize_mode"}), _pixels_need_images),
    (frozenset({"min_render_replicas", "max_render_replicas"}), _render_replicas_range),
    (frozenset({"port", "ray_address"}), _ray_port),
]


def validate(ns: Mapping[str, Any]) -> dict[str, Any]:
    """Every check of every option ``ns`` holds, then every rule whose options it holds; the
    namespace with values normalised (paths, devices, sizes in bytes, parsed lists). ``None``
    (an option not given, without default) is not checked.

    Raises:
        ArgumentError: naming the flag of the first bad option.
    """
    out = dict(ns)
    for key, value in ns.items():
        check = CHECKS.get(key)
        if check is None or value is None:
            continue
        try:
            out[key] = check.fn(value)
        except ArgumentError as e:
            if e.argument == check.flag:
                raise
            raise ArgumentError(str(e), argument=check.flag) from None
    for needs, rule in RULES:
        if needs <= out.keys():
            rule(out)
    return out


def validated(command: T) -> T:
    """Run :func:`validate` on a click command's options, then its body with the normalised
    values; an :class:`ArgumentError` from either becomes a usage error (exit code 2)."""

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        try:
            kwargs = validate(kwargs)
            return command(**kwargs)
        except ArgumentError as e:
            raise click.UsageError(str(e)) from None

    return wrapper  # type: ignore[return-value]


# ---- option groups ------------------------------------------------------------------------

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def options(*groups: list[Decorator]) -> Decorator:
    """Apply option groups to a click command (in the order given, for ``--help``)."""

    def apply(fn: Callable[..., Any]) -> Callable[..., Any]:
        for group in reversed(groups):
            for option in reversed(group):
                fn = option(fn)
        return fn

    return apply


MODEL: list[Decorator] = [
    click.option("--model", "model_name", default="qwen2-vl", show_default=True,
                 help="Built-in model (see `mmferry models`)."),
    click.option("--weights", type=click.Path(file_okay=False),
                 help="Local checkpoint folder (config.json + safetensors); default: tiny random "
                      "weights."),
]

DEVICE: list[Decorator] = [
    click.option("--device", default="cpu", show_default=True, help="cpu or cuda[:N]."),
]


def NETWORK(port: int, max_request_bytes: str = "64MiB", *, any_port: bool = True
            ) -> list[Decorator]:
    """The network group, with the server's default port and body cap (``any_port``: the
    server can bind port 0)."""
    port_help = "Port to bind (0: any free port; the bound one is printed)." if any_port \
        else "Port to bind."
    return [
        click.option("--host", default="127.0.0.1", show_default=True,
                     help="Address to bind (loopback by default; 0.0.0.0 exposes the server)."),
        click.option("--port", type=int, default=port, show_default=True, help=port_help),
        click.option("--api-key", "api_keys", multiple=True, metavar="KEY",
                     help="Require 'Authorization: Bearer KEY' on /v1/ routes (repeatable)."),
        click.option("--max-request-bytes", default=max_request_bytes, show_default=True,
                     help="Largest request body; larger ones get 413."),
    ]


MEDIA: list[Decorator] = [
    click.option("--allowed-media-domains", multiple=True, metavar="HOST[,HOST]",
                 help="Hosts media URLs may name (*.domain for subdomains, * for any). "
                      "Default: URLs are refused."),
    click.option("--allow-private-addresses", is_flag=False, flag_value="all", default=None,
                 metavar="[all|CIDR,...]",
                 help="Let URLs reach non-public addresses: every one (bare flag), or only these "
                      "networks. Default: private, loopback and link-local are refused."),
    click.option("--allowed-local-media-path", metavar="DIR",
                 help="Media may name files under DIR ('path' entries). Default: refused."),
    click.option("--max-media-bytes", default="32MiB", show_default=True,
                 help="Largest item (upload, base64 data, fetched URL or file)."),
    click.option("--max-image-pixels", type=int, default=89_478_485, show_default=True,
                 help="Largest image, from its header, before decoding."),
    click.option("--max-items", type=int, default=32, show_default=True,
                 help="Most media items per request."),
    click.option("--fetch-timeout", default="image=5,video=30,audio=10", show_default=True,
                 help="Seconds a URL fetch may take, per modality (or one number)."),
    click.option("--max-redirects", type=int, default=5, show_default=True,
                 help="Redirects a fetch follows, each re-checked."),
]

PIXELS: list[Decorator] = [
    click.option("--pixel-dtype", type=click.Choice(["uint8", "float32"]), default=None,
                 help="Image and video pixels as uint8 levels with the normalisation in their "
                      "contract (the default; a quarter of the bytes), or normalised float32 "
                      "as transformers gives them."),
    click.option("--resize-mode", type=click.Choice(["fast", "exact"]), default=None,
                 help="fast (the default): the pixels of transformers' torchvision processors, "
                      "which vLLM uses; exact: those of its PIL processors."),
]

POOL: list[Decorator] = [
    click.option("--workers", type=int, default=None,
                 help="Render processes (default: the number of cores)."),
    click.option("--max-inflight", type=int, default=None,
                 help="Requests admitted at once (default: 4 per worker); past it, 503."),
]

BATCHING: list[Decorator] = [
    click.option("--max-batch-tokens", type=int, default=16384, show_default=True,
                 help="Most encoder tokens in one cross-request batch."),
    click.option("--batch-wait-ms", type=float, default=5.0, show_default=True,
                 help="How long a batch waits for more requests to join it."),
    click.option("--cache-max-tokens", type=int, default=1 << 20, show_default=True,
                 help="Encoder-cache capacity in tokens (rows)."),
]

RAY: list[Decorator] = [
    click.option("--ray-address", default=None, metavar="ADDRESS",
                 help="Ray cluster to join (e.g. HEAD_IP:6379, or 'auto'). Default: RAY_ADDRESS, "
                      "else a new one-machine cluster."),
    click.option("--min-render-replicas", type=int, default=1, show_default=True,
                 help="Render replicas kept running (the deployment autoscales above it; 0: "
                      "none until a render request comes)."),
    click.option("--max-render-replicas", type=int, default=4, show_default=True,
                 help="Most render replicas."),
    click.option("--render-cpus", type=float, default=1.0, show_default=True,
                 help="CPUs reserved per render replica (one process each, one core)."),
    click.option("--encoder-replicas", type=int, default=1, show_default=True,
                 help="Encoder replicas (each with its own encoder cache)."),
    click.option("--encoder-gpus", type=float, default=None,
                 help="GPUs per encoder replica. Default: 1 where the cluster has GPUs, else 0 "
                      "(the encoder runs on the CPU)."),
    click.option("--encoder-cpus", type=float, default=1.0, show_default=True,
                 help="CPUs reserved per encoder replica."),
    click.option("--ingress-cpus", type=float, default=0.5, show_default=True,
                 help="CPUs reserved for the HTTP ingress."),
    click.option("--router", default="affinity", show_default=True,
                 type=click.Choice(["affinity", "pow2"]),
                 help="Encoder routing: affinity (rendezvous hashing on the largest item's hash, "
                      "load fallback) or pow2 (Ray Serve's default)."),
    click.option("--imbalance-threshold", type=int, default=8, show_default=True,
                 help="Affinity yields to load when the chosen encoder replica has this many more "
                      "requests outstanding than the least loaded one."),
]
