"""Image preprocessing: mmferry's processors (uint8 pixels, ``exact`` and ``fast`` resize)
against transformers' PIL and torchvision processors, per built-in image model and size.

    python benchmarks/preprocess.py                             # every image model, 3 sizes
    python benchmarks/preprocess.py --only qwen2-vl --sizes 1920x1080
    python benchmarks/preprocess.py --quick                     # smoke run
    PYTHONPATH=src /work/venv-vllm/bin/python benchmarks/preprocess.py --only isaac
                                                 # with vLLM importable: Isaac's peer

Four tables, then the targets of issue 11:

* time: CPU-time medians per image of transformers' PIL processor, its torchvision processor,
  mmferry ``exact`` and ``fast`` (both ``pixel_dtype="uint8"``), one torch thread, the four
  called interleaved on the same photo-like image (``media.samples.photo_like``, as a PIL
  image); the figure is the median of per-repeat medians (``_common.py``). CPU time (this
  process's, ``time.process_time``) rather than wall time because every competitor runs on
  one thread and the machine is shared; ``--clock wall`` gives wall time. Targets: exact <=
  0.5x PIL, fast <= 0.5x torchvision. ``Pillow/PIL`` is the Pillow resizes ``exact`` makes,
  replayed alone, over the PIL processor's time: the PIL processor makes the same resizes, so
  no processor giving Pillow's pixels can go below it.
* pixels: max and mean |fast - exact| of mmferry's uint8 levels, next to transformers' own
  torchvision-vs-PIL difference in the same units (their normalised outputs read back as
  levels, channel by channel); whether mmferry's float32 ``exact`` output equals the PIL
  processor's bit for bit and how far float32 ``fast`` is from the torchvision one; and the
  max embedding difference of the tiny model (seeded random weights), fast vs exact and
  uint8 vs float32. Target: fast-vs-exact no larger than transformers' torchvision-vs-PIL
  (max and mean).
* wire bytes per image: all frames of ``mf.wire.encode`` of the split items, float32 vs
  uint8, and the pixel field's bytes alone. Target: uint8 pixels <= 0.25x float32.
* end to end: one request of 64 images through process -> split -> wire encode / decode ->
  batch -> ``Transfer("cpu")``, float32 (exact and fast resize) vs uint8 (fast, the default).
  Target: uint8 <= 0.5x float32 at the same resize (the dtype alone); the ratio against
  float32 ``exact`` (the pixels mmferry gave before issue 11) is printed too.

A model whose processor does not take ``pixel_dtype`` / ``resize_mode`` is reported as not
converted: its default call is timed against the peers, with no target verdict. A peer that
does not import (no torchvision; Isaac has no transformers processor, only vLLM's
``IsaacImageProcessor``, used when vLLM imports) is printed as unavailable. A model whose
processor fails is reported as an ERROR (exit status 1) and the others still run.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import platform
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from _common import (
    CpuWatch,
    Timing,
    configure_torch,
    fmt_bytes,
    fmt_ratio,
    time_interleaved,
    verdict,
    wait_for_idle,
)
from PIL import Image

import mmferry as mf
from mmferry.media.samples import photo_like

SIZES = ("448x448", "1024x768", "1920x1080")  # width x height
PIL, TV, EXACT, FAST, TODAY = "PIL", "torchvision", "exact", "fast", "today"
PILLOW = "pillow"  # the Pillow resizes our exact mode makes, replayed alone: its floor
TIME_TARGET, BYTES_TARGET, E2E_TARGET = 0.5, 0.25, 0.5
# transformers' differences are read back from float32 normalised values, a few 1e-5 levels
# off the integer level differences they stand for.
LEVEL_TOLERANCE = 1e-3
PIXELS = "pixel_values"
# Levels of the constant probe image that tells which output element is which channel.
PROBE = (40, 120, 200)
# Isaac's tiny test config has 8-pixel patches; the processor runs with the real ones.
CONFIGS: dict[str, Any] = {
    "isaac": {"hidden_size": 2048,
              "vision_config": {"patch_size": 16, "pixel_shuffle_scale_factor": 2}},
}


# -- peers ------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeerSpec:
    """One reference processor: where its class lives and how the engine builds it."""

    label: str
    module: str
    cls: str
    kwargs: Callable[[Any], dict[str, Any]]  # from our model: the same resize bounds


def _qwen_bounds(model: Any) -> dict[str, Any]:
    pc = model.processor_config
    return {"min_pixels": pc.min_pixels, "max_pixels": pc.max_pixels}


def _ov2(model: Any) -> dict[str, Any]:
    pc = model.processor_config
    return {**_qwen_bounds(model), "patch_size": pc.patch_size, "merge_size": pc.merge_size,
            "temporal_patch_size": pc.temporal_patch_size}


def _minicpm(model: Any) -> dict[str, Any]:
    pc = model.processor_config
    return {"max_slice_nums": pc.max_slice_nums, "scale_resolution": pc.scale_resolution}


def _isaac(model: Any) -> dict[str, Any]:
    pc, cfg = model.processor_config, model.config
    return {"patch_size": cfg.patch_size, "vision_max_num_patches": pc.max_num_patches,
            "vision_min_num_patches": pc.min_num_patches,
            "pixel_shuffle_scale": cfg.pixel_shuffle_scale_factor}


_QWEN = "transformers.models.qwen2_vl."
_ERNIE = "transformers.models.ernie4_5_vl_moe."
_MINICPM = "transformers.models.minicpmv4_6."
# What vLLM 0.33 builds for each model: transformers 5's default (torchvision) image
# processor from the checkpoint; OV2 is remote code whose image processor is transformers'
# Qwen2-VL one with a temporal patch of 1; Isaac's is vLLM's own (torch, no torchvision).
PEERS: dict[str, dict[str, PeerSpec]] = {
    "qwen2-vl": {
        PIL: PeerSpec("Qwen2VLImageProcessorPil", _QWEN + "image_processing_pil_qwen2_vl",
                      "Qwen2VLImageProcessorPil", _qwen_bounds),
        TV: PeerSpec("Qwen2VLImageProcessor", _QWEN + "image_processing_qwen2_vl",
                     "Qwen2VLImageProcessor", _qwen_bounds),
    },
    "minicpm-v-4.6": {
        PIL: PeerSpec("MiniCPMV4_6ImageProcessorPil",
                      _MINICPM + "image_processing_pil_minicpmv4_6",
                      "MiniCPMV4_6ImageProcessorPil", _minicpm),
        TV: PeerSpec("MiniCPMV4_6ImageProcessor", _MINICPM + "image_processing_minicpmv4_6",
                     "MiniCPMV4_6ImageProcessor", _minicpm),
    },
    "llava-onevision2": {
        PIL: PeerSpec("Qwen2VLImageProcessorPil(temporal_patch_size=1)",
                      _QWEN + "image_processing_pil_qwen2_vl", "Qwen2VLImageProcessorPil", _ov2),
        TV: PeerSpec("Qwen2VLImageProcessor(temporal_patch_size=1)",
                     _QWEN + "image_processing_qwen2_vl", "Qwen2VLImageProcessor", _ov2),
    },
    "ernie4.5-vl": {
        PIL: PeerSpec("Ernie4_5_VLMoeImageProcessorPil",
                      _ERNIE + "image_processing_pil_ernie4_5_vl_moe",
                      "Ernie4_5_VLMoeImageProcessorPil", _qwen_bounds),
        TV: PeerSpec("Ernie4_5_VLMoeImageProcessor", _ERNIE + "image_processing_ernie4_5_vl_moe",
                     "Ernie4_5_VLMoeImageProcessor", _qwen_bounds),
    },
    "isaac": {
        TV: PeerSpec("vLLM IsaacImageProcessor (torch)", "vllm.transformers_utils.processors.isaac",
                     "IsaacImageProcessor", _isaac),
    },
}


@dataclass
class Peer:
    label: str
    processor: Any = None  # None: unavailable, ``why`` says so
    why: str = ""

    def __call__(self, images: list[Image.Image]) -> Any:
        return self.processor(images=images, return_tensors="pt")


def load_peer(spec: PeerSpec, model: Any) -> Peer:
    try:
        cls = getattr(importlib.import_module(spec.module), spec.cls)
        return Peer(spec.label, cls(**spec.kwargs(model)))
    except Exception as e:  # not installed (torchvision, vLLM), or an import that fails here
        return Peer(spec.label, None, f"{type(e).__name__}: {str(e).splitlines()[0][:90]}")


# -- models -----------------------------------------------------------------------------


def image_models() -> list[str]:
    return [n for n in mf.models.names() if "image" in mf.models.model_class(n).modalities]


@dataclass
class Subject:
    """One model with its peers, and whether its processor takes the pixel options."""

    name: str
    model: Any
    peers: dict[str, Peer]
    converted: bool
    error: str | None = None  # what failed while preparing its cases
    _tiny: Any = None

    def tiny(self) -> Any:
        """The tiny architecture with seeded random weights, for embedding differences."""
        if self._tiny is None:
            self._tiny = mf.models.load(self.name)
        return self._tiny

    def ours(self, images: list[Image.Image], dtype: str | None = None,
             mode: str | None = None) -> dict[str, Any]:
        if dtype is None:
            return self.model.processor(images=images)
        return self.model.processor(images=images, pixel_dtype=dtype, resize_mode=mode)

    def available(self, kind: str) -> Peer | None:
        peer = self.peers.get(kind)
        return peer if peer is not None and peer.processor is not None else None


def load_subject(name: str) -> Subject:
    model = mf.models.load(name, config=CONFIGS.get(name, "tiny"), materialize=False)
    takes = inspect.signature(model.processor).parameters
    converted = "pixel_dtype" in takes and "resize_mode" in takes
    peers = {kind: load_peer(spec, model) for kind, spec in PEERS.get(name, {}).items()}
    return Subject(name, model, peers, converted)


# -- images and pixel comparisons -------------------------------------------------------


def parse_size(text: str) -> tuple[int, int]:
    """``WxH`` -> (width, height)."""
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size must be WIDTHxHEIGHT, got {text!r}") from None
    if w < 1 or h < 1:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return w, h


def photos(size: tuple[int, int], count: int, seed: int = 0) -> list[Image.Image]:
    w, h = size
    return [Image.fromarray(photo_like(h, w, seed=seed + i)) for i in range(count)]


def flat_pixels(outputs: Mapping[str, Any]) -> torch.Tensor:
    """The pixel field, every element in order (a per-item list concatenated)."""
    value = outputs[PIXELS]
    if isinstance(value, list | tuple):
        return torch.cat([torch.as_tensor(v).reshape(-1) for v in value])
    return torch.as_tensor(value).reshape(-1)


def layout(outputs: Mapping[str, Any]) -> Any:
    """The pixel field's shape, or its items' shapes: two outputs compare element by element
    only when their layouts are the same (flattened sizes can agree by chance)."""
    value = outputs[PIXELS]
    if isinstance(value, list | tuple) and len(value) != 1:
        return [tuple(torch.as_tensor(v).shape) for v in value]
    # One image's pixels as a one-item list or as a tensor: the same elements either way.
    return tuple(torch.as_tensor(value[0] if isinstance(value, list | tuple) else value).shape)


def peer_normalize(peer: Any) -> mf.Normalize | None:
    """A transformers processor's normalisation, as a :class:`mf.Normalize`."""
    if not hasattr(peer, "image_mean") or not hasattr(peer, "image_std"):
        return None
    return mf.Normalize(tuple(peer.image_mean), tuple(peer.image_std),
                        getattr(peer, "rescale_factor", 1 / 255))


def level_steps(norm: mf.Normalize, probe: torch.Tensor) -> torch.Tensor:
    """Per element of a normalised output, how much one level moves it (``scale / std`` of its
    channel), the channel found from ``probe``: the same processor's output for a constant
    image of levels :data:`PROBE`."""
    a, b = norm.affine()
    expected = a * torch.tensor(PROBE, dtype=torch.float64) + b  # each channel's probe value
    channel = (probe.double()[:, None] - expected[None, :]).abs().argmin(1)
    return a[channel]


def level_diff(x: torch.Tensor, y: torch.Tensor,
               steps: torch.Tensor | None = None) -> tuple[float, float]:
    """(max, mean) |x - y| in levels: uint8 outputs directly, normalised ones over ``steps``."""
    d = (x.double() - y.double()).abs()
    if steps is not None:
        d = d / steps
    return float(d.max()), float(d.mean())


@dataclass
class Pixels:
    ours: tuple[float, float] | None = None  # fast vs exact, uint8 levels
    theirs: tuple[float, float] | None = None  # torchvision vs PIL, in levels
    exact_equal: bool | None = None  # our float32 exact == PIL, bit for bit
    fast_vs_tv: tuple[float, float] | None = None  # our float32 fast vs torchvision, levels
    # On the tiny model: max |embedding diff| fast vs exact (uint8), uint8 vs float32 (fast),
    # and max |embedding| (the scale of both).
    emb_fast_exact: float | None = None
    emb_u8_f32: float | None = None
    emb_scale: float | None = None
    notes: list[str] = field(default_factory=list)


def compare_pixels(s: Subject, size: tuple[int, int]) -> Pixels:
    img = photos(size, 1)
    probe = [Image.new("RGB", size, PROBE)]
    out = Pixels()
    norm = None
    if s.converted:
        exact_out = s.ours(img, "uint8", EXACT)
        exact, fast = flat_pixels(exact_out), flat_pixels(s.ours(img, "uint8", FAST))
        if exact.dtype != torch.uint8 or fast.dtype != torch.uint8:
            out.notes.append(f"uint8 asked, got {exact.dtype} / {fast.dtype}")
        # Zero levels in the constant probe's output are padding (slices padded to one
        # length), not pixels.
        real = flat_pixels(s.ours(probe, "uint8", EXACT)) != 0
        out.ours = level_diff(exact[real], fast[real])
        norm = s.model.field_specs(exact_out)[PIXELS].normalize
        tiny = s.tiny()
        exact_emb, fast_emb, f32_emb = (
            embed(tiny, tiny.processor(images=img, pixel_dtype=d, resize_mode=m))
            for d, m in (("uint8", EXACT), ("uint8", FAST), ("float32", FAST)))
        out.emb_fast_exact = float((fast_emb - exact_emb).abs().max())
        out.emb_u8_f32 = float((fast_emb - f32_emb).abs().max())
        out.emb_scale = float(exact_emb.abs().max())
    pil, tv = s.available(PIL), s.available(TV)
    got = {kind: peer(img) for kind, peer in ((PIL, pil), (TV, tv)) if peer is not None}
    if not got:
        return out
    first = pil or tv
    norm = peer_normalize(first.processor) or norm
    if norm is None:
        out.notes.append("no normalisation known to read the peers' output in levels")
        return out
    steps = level_steps(norm, flat_pixels(first(probe)))
    if len(got) == 2 and layout(got[TV]) == layout(got[PIL]):
        out.theirs = level_diff(flat_pixels(got[TV]), flat_pixels(got[PIL]), steps)
    if not s.converted:
        return out
    ours = {PIL: s.ours(img, "float32", EXACT), TV: s.ours(img, "float32", FAST)}
    for kind, theirs in got.items():
        if layout(ours[kind]) != layout(theirs):
            note = (f"float32 layout {layout(ours[kind])} is not transformers' "
                    f"{layout(theirs)}: not compared")
            if note not in out.notes:
                out.notes.append(note)
        elif kind == PIL:
            out.exact_equal = torch.equal(flat_pixels(ours[kind]), flat_pixels(theirs))
        else:
            out.fast_vs_tv = level_diff(flat_pixels(ours[kind]), flat_pixels(theirs), steps)
    return out


def embed(model: Any, outputs: Mapping[str, Any]) -> torch.Tensor:
    """The encoder's output for one request's items, batched and moved as an engine does."""
    batches = mf.batch_items(mf.split_items(outputs, model.field_specs(outputs)))
    transfer = mf.Transfer("cpu")
    with torch.no_grad():
        return torch.cat([model.encode(**dict(transfer.to_device(b))) for b in batches])


# -- wire bytes and the end-to-end path -------------------------------------------------


def wire_bytes(s: Subject, outputs: Mapping[str, Any]) -> tuple[int, int]:
    """(bytes of all frames, bytes of the pixel field) of one request's items on the wire."""
    frames = mf.wire.encode(mf.split_items(outputs, s.model.field_specs(outputs)))
    return sum(memoryview(f).nbytes for f in frames), flat_pixels(outputs).nbytes


def end_to_end(s: Subject, images: list[Image.Image], transfer: mf.Transfer,
               dtype: str | None, mode: str | None) -> list[Any]:
    outputs = s.ours(images, dtype, mode)
    items = mf.split_items(outputs, s.model.field_specs(outputs))
    decoded = mf.wire.decode(mf.wire.encode(items))
    return [transfer.to_device(b) for b in mf.batch_items(decoded)]


def e2e_paths(s: Subject) -> dict[str, tuple[str | None, str | None]]:
    if not s.converted:
        return {f"float32 ({TODAY})": (None, None)}
    return {"float32 exact": ("float32", EXACT), "float32 fast": ("float32", FAST),
            "uint8 fast": ("uint8", FAST)}


def check_e2e(s: Subject, images: list[Image.Image], transfer: mf.Transfer) -> None:
    """Each path's pixels arrive in the dtype the processor made, in one batch."""
    for label, (dtype, mode) in e2e_paths(s).items():
        moved = end_to_end(s, images, transfer, dtype, mode)
        want = {"uint8": torch.uint8, "float32": torch.float32, None: torch.float32}[dtype]
        value = moved[0][PIXELS] if len(moved) == 1 else None
        got = value[0].dtype if isinstance(value, list | tuple) else getattr(value, "dtype", None)
        if got != want:
            raise AssertionError(f"{s.name} end to end {label}: {len(moved)} batch(es), "
                                 f"pixels {got}")


# -- run --------------------------------------------------------------------------------


@dataclass
class Case:
    subject: Subject
    size: tuple[int, int]
    fns: dict[str, Callable[[], object]]
    timings: dict[str, Timing]
    pixels: Pixels
    bytes: dict[str, tuple[int, int]]  # dtype -> (all frames, pixel field)


def pillow_resizes(s: Subject, images: list[Image.Image]) -> Callable[[], object]:
    """The Pillow resizes ``exact`` makes on ``images``, replayed: the part of its time the
    PIL peer spends too (it makes the same resizes), so no processor giving Pillow's pixels
    can take less."""
    calls: list[tuple[Image.Image, tuple[int, int], Any]] = []
    original = Image.Image.resize

    def record(self: Image.Image, size: Any, resample: Any = None, *args: Any, **kwargs: Any) -> Any:
        calls.append((self, tuple(size), resample))
        return original(self, size, resample, *args, **kwargs)

    Image.Image.resize = record  # type: ignore[method-assign]
    try:
        s.ours(images, "uint8", EXACT)
    finally:
        Image.Image.resize = original  # type: ignore[method-assign]
    return lambda: [image.resize(size, resample) for image, size, resample in calls]


def build_case(s: Subject, size: tuple[int, int], count: int) -> Case:
    imgs = photos(size, count)
    fns: dict[str, Callable[[], object]] = {}
    for kind in (PIL, TV):
        peer = s.available(kind)
        if peer is not None:
            fns[kind] = lambda p=peer: p(imgs)
    if s.converted:
        fns[EXACT] = lambda: s.ours(imgs, "uint8", EXACT)
        fns[FAST] = lambda: s.ours(imgs, "uint8", FAST)
        fns[PILLOW] = pillow_resizes(s, imgs)
    else:
        fns[TODAY] = lambda: s.ours(imgs)
    one = imgs[:1]
    if s.converted:
        sizes = {"float32": wire_bytes(s, s.ours(one, "float32", FAST)),
                 "uint8": wire_bytes(s, s.ours(one, "uint8", FAST))}
    else:
        sizes = {"float32": wire_bytes(s, s.ours(one))}
    return Case(s, size, fns, {k: Timing() for k in fns}, compare_pixels(s, size), sizes)


def run(subjects: list[Subject], args: argparse.Namespace,
        clock: Callable[[], float]) -> tuple[list[Case], dict[str, dict[str, Timing]]]:
    transfer = mf.Transfer("cpu")
    e2e_images = photos(args.e2e_size, args.e2e_images) if args.e2e_images > 0 else []
    cases: list[Case] = []
    e2e: dict[str, dict[str, Callable[[], object]]] = {}
    e2e_timings: dict[str, dict[str, Timing]] = {}
    for s in subjects:
        # A model whose processor fails (a conversion in progress) is reported, and the
        # others still run.
        try:
            built = [build_case(s, size, args.images) for size in args.sizes]
            if e2e_images:
                check_e2e(s, e2e_images, transfer)
        except Exception as e:
            s.error = f"{type(e).__name__}: {e}"
            continue
        cases += built
        if e2e_images:
            e2e[s.name] = {label: (lambda d=d, m=m, s=s: end_to_end(s, e2e_images, transfer,
                                                                    d, m))
                           for label, (d, m) in e2e_paths(s).items()}
            e2e_timings[s.name] = {label: Timing() for label in e2e[s.name]}
    for _ in range(args.repeats):
        for case in cases:
            time_interleaved(case.fns, case.timings, runs=args.runs, warmups=args.warmups,
                             clock=clock)
        for name, fns in e2e.items():
            time_interleaved(fns, e2e_timings[name], runs=args.e2e_runs, warmups=1, clock=clock)
    return cases, e2e_timings


# -- report -----------------------------------------------------------------------------


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.2f}"


def _median(case: Case, kind: str, per: int) -> float | None:
    t = case.timings.get(kind)
    return None if t is None else t.median / per


def _sci(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


def _levels(pair: tuple[float, float] | None) -> str:
    return "-" if pair is None else f"{pair[0]:.0f} / {pair[1]:.3f}"


Target = tuple[str, bool | None]


def report_time(cases: list[Case], per: int, unit: str) -> list[Target]:
    print(f"\ntime per image, median {unit} ms ({per} image(s) per call)")
    print(f"{'model':<18}{'size':<11}{'PIL':>9}{'torchvis':>10}{'exact':>9}{'fast':>9}"
          f"{'exact/PIL':>11}{'fast/tv':>9}{'Pillow/PIL':>12}   notes")
    targets: list[Target] = []
    for c in cases:
        s, label = c.subject, f"{c.size[0]}x{c.size[1]}"
        pil, tv = _median(c, PIL, per), _median(c, TV, per)
        exact, fast, today, pillow = (_median(c, k, per) for k in (EXACT, FAST, TODAY, PILLOW))
        notes = [f"{kind}: {p.label} unavailable ({p.why})"
                 for kind, p in s.peers.items() if p.processor is None]
        if not s.peers:
            notes.append("no reference processor known")
        if not s.converted:
            notes.insert(0, f"NOT CONVERTED (processor takes no pixel_dtype/resize_mode); "
                            f"today's processor {_ms(today)} ms = {fmt_ratio(today, pil)} PIL, "
                            f"{fmt_ratio(today, tv)} torchvision")
        print(f"{s.name:<18}{label:<11}{_ms(pil):>9}{_ms(tv):>10}{_ms(exact):>9}{_ms(fast):>9}"
              f"{fmt_ratio(exact, pil):>11}{fmt_ratio(fast, tv):>9}{fmt_ratio(pillow, pil):>12}"
              f"   {'; '.join(notes)}")
        where = f"{s.name} {label}"
        if not s.converted:
            targets.append((f"{where}: not converted", None))
            continue
        names = {kind: p.label for kind, p in s.peers.items()}
        targets.append((f"{where} exact <= {TIME_TARGET}x {names.get(PIL, 'PIL (none)')}: "
                        f"{_ratio3(exact, pil)} (Pillow's resizes alone: {_ratio3(pillow, pil)})",
                        None if pil is None else exact <= TIME_TARGET * pil))
        targets.append((f"{where} fast <= {TIME_TARGET}x {names.get(TV, 'torchvision (none)')}: "
                        f"{_ratio3(fast, tv)}", None if tv is None else fast <= TIME_TARGET * tv))
    return targets


def report_pixels(cases: list[Case]) -> list[Target]:
    print("\npixel differences in levels (0-255), max / mean |diff|, one image per size; max "
          "|embedding diff| of the tiny model (seeded random weights) on the same image")
    print(f"{'model':<18}{'size':<11}{'mmferry fast-exact':>20}{'transformers tv-PIL':>21}"
          f"{'f32 exact==PIL':>16}{'f32 fast-tv':>14}{'emb fast-exact':>16}{'emb u8-f32':>12}"
          f"{'max |emb|':>11}")
    targets: list[Target] = []
    for c in cases:
        p, s, label = c.pixels, c.subject, f"{c.size[0]}x{c.size[1]}"
        same = "-" if p.exact_equal is None else ("yes" if p.exact_equal else "NO")
        print(f"{s.name:<18}{label:<11}{_levels(p.ours):>20}{_levels(p.theirs):>21}"
              f"{same:>16}{_levels(p.fast_vs_tv):>14}{_sci(p.emb_fast_exact):>16}"
              f"{_sci(p.emb_u8_f32):>12}{_sci(p.emb_scale):>11}   {'; '.join(p.notes)}")
        if not s.converted:
            continue
        text = (f"{s.name} {label} fast-vs-exact <= transformers' tv-vs-PIL: "
                f"{_levels(p.ours)} vs {_levels(p.theirs)}")
        ok = None if p.ours is None or p.theirs is None else (
            p.ours[0] <= p.theirs[0] + LEVEL_TOLERANCE
            and p.ours[1] <= p.theirs[1] + LEVEL_TOLERANCE)
        targets.append((text, ok))
    return targets


def report_bytes(cases: list[Case]) -> list[Target]:
    print("\nwire bytes per image: all frames of wire.encode of the split items, and the pixel "
          "field's bytes alone")
    print(f"{'model':<18}{'size':<11}{'float32':>13}{'uint8':>13}{'ratio':>8}"
          f"{'pixels f32':>13}{'pixels u8':>12}{'ratio':>8}")
    targets: list[Target] = []
    for c in cases:
        (f32, f32_px), (u8, u8_px) = c.bytes["float32"], c.bytes.get("uint8", (None, None))
        label = f"{c.size[0]}x{c.size[1]}"
        print(f"{c.subject.name:<18}{label:<11}{fmt_bytes(f32):>13}{fmt_bytes(u8):>13}"
              f"{_ratio3(u8, f32):>8}{fmt_bytes(f32_px):>13}{fmt_bytes(u8_px):>12}"
              f"{_ratio3(u8_px, f32_px):>8}")
        if u8 is not None:
            # Judged on the pixels: the rest of the frames (grids, the header) is the same
            # few hundred bytes either way.
            targets.append((f"{c.subject.name} {label} uint8 pixel bytes <= {BYTES_TARGET}x "
                            f"float32: {_ratio3(u8_px, f32_px)} (all frames "
                            f"{_ratio3(u8, f32)})", u8_px <= BYTES_TARGET * f32_px))
    return targets


def _ratio3(a: float | None, b: float | None) -> str:
    """A ratio to three decimals: a verdict at the 0.5x line must show which side it is on."""
    return "-" if a is None or b is None or b <= 0 else f"{a / b:.3f}x"


def report_e2e(timings: dict[str, dict[str, Timing]], args: argparse.Namespace,
               unit: str) -> list[Target]:
    if not timings:
        return []
    w, h = args.e2e_size
    print(f"\nend to end, {args.e2e_images} images of {w}x{h} in one request: process -> split "
          f"-> wire encode/decode -> batch -> Transfer('cpu'), median {unit} ms per request")
    print(f"{'model':<18}{'float32 exact':>15}{'float32 fast':>14}{'uint8 fast':>12}"
          f"{'u8/f32 fast':>13}{'u8/f32 exact':>14}")
    targets: list[Target] = []
    for name, by_path in timings.items():
        med = {label: t.median for label, t in by_path.items()}
        f32e, f32f, u8 = (med.get(k) for k in ("float32 exact", "float32 fast", "uint8 fast"))
        today = med.get(f"float32 ({TODAY})")
        note = "" if today is None else (f"NOT CONVERTED: float32 (today's processor) "
                                         f"{_ms(today)} ms")
        print(f"{name:<18}{_ms(f32e):>15}{_ms(f32f):>14}{_ms(u8):>12}{fmt_ratio(u8, f32f):>13}"
              f"{fmt_ratio(u8, f32e):>14}   {note}")
        if u8 is None:
            targets.append((f"{name} end to end: not converted", None))
            continue
        targets.append((f"{name} end to end uint8 <= {E2E_TARGET}x float32 (same fast resize): "
                        f"{_ratio3(u8, f32f)} (vs float32 exact: {_ratio3(u8, f32e)})",
                        u8 <= E2E_TARGET * f32f))
    return targets


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--only", nargs="+", metavar="MODEL", default=None,
                   help=f"run only these models (image models: {', '.join(image_models())})")
    p.add_argument("--sizes", nargs="+", type=parse_size, default=None, metavar="WxH",
                   help=f"image sizes, width x height (default {' '.join(SIZES)})")
    p.add_argument("--repeats", type=int, default=3, help="times the whole case set runs")
    p.add_argument("--runs", type=int, default=10, help="timed calls per competitor per repeat")
    p.add_argument("--warmups", type=int, default=1, help="untimed calls before each case")
    p.add_argument("--images", type=int, default=1, help="images per processor call")
    p.add_argument("--e2e-images", type=int, default=64,
                   help="images in the end-to-end request (0: skip it)")
    p.add_argument("--e2e-size", type=parse_size, default=parse_size("448x448"), metavar="WxH")
    p.add_argument("--e2e-runs", type=int, default=5, help="timed end-to-end calls per repeat")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                   help="process CPU time (default) or wall time")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 repeat, 1 run, no warm-up, 4 end-to-end images")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                   help="first wait up to this long for two quiet 4 s windows (< 8%% CPU)")
    args = p.parse_args(argv)
    known = image_models()
    unknown = sorted(set(args.only or ()) - set(known))
    if unknown:
        p.error(f"not an image model: {', '.join(unknown)} (image models: {', '.join(known)})")
    args.models = [m for m in known if not args.only or m in args.only]
    args.sizes = args.sizes or [parse_size(s) for s in SIZES]
    if args.quick:
        args.repeats, args.runs, args.warmups, args.e2e_runs = 1, 1, 0, 1
        args.e2e_images = min(args.e2e_images, 4)
    for name in ("repeats", "runs", "images", "e2e_runs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_torch(args.threads)
    clock, unit = (time.process_time, "CPU") if args.clock == "cpu" else (time.perf_counter, "wall")
    try:
        import torchvision

        tv_version = torchvision.__version__
    except ImportError:
        tv_version = "not installed"
    import transformers

    print(f"python {platform.python_version()}, torch {torch.__version__}, torchvision "
          f"{tv_version}, transformers {transformers.__version__}, numpy {np.__version__}, "
          f"Pillow {Image.__version__}, mmferry {mf.__version__}; {torch.get_num_threads()} "
          f"torch thread(s); {args.repeats} repeat(s) x {args.runs} runs after {args.warmups} "
          f"warm-up(s); {unit} time, medians of per-repeat medians")
    subjects = [load_subject(name) for name in args.models]
    for s in subjects:
        peers = ", ".join(f"{k} = {p.label}" + ("" if p.processor is not None else " (unavailable)")
                          for k, p in s.peers.items()) or "none known"
        print(f"{s.name}: {'converted' if s.converted else 'NOT CONVERTED'}; peers: {peers}")
    if args.wait_idle > 0:
        quiet = wait_for_idle(args.wait_idle)
        print(f"idle wait: {'machine quiet' if quiet else 'gave up, machine still busy'}")
    watch = CpuWatch().start()
    cases, e2e = run(subjects, args, clock)
    watch.stop()
    targets = report_time(cases, args.images, unit)
    targets += report_pixels(cases)
    targets += report_bytes(cases)
    targets += report_e2e(e2e, args, unit)
    failed = [s for s in subjects if s.error is not None]
    for s in failed:
        print(f"\nERROR {s.name}: {s.error}")
    print("\ntargets")
    for s in failed:
        print(f"  {'ERROR':<6}{s.name}: no figures (see above)")
    for text, met in targets:
        print(f"  {'n/a' if met is None else verdict(met):<6}{text}")
    print(f"\nforeign CPU: {watch.foreign_s:.2f} s used by other processes, steal "
          f"{watch.steal_s:.2f} s, during {watch.wall_s:.1f} s of timing "
          "(well above 0 means contaminated wall-time figures)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
