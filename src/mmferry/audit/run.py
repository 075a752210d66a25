"""One audit run: place the inputs by their specs, tag the module, call the function."""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from mmferry.audit.findings import KINDS, AuditReport
from mmferry.audit.tracer import Tracer, UnauditableOpError, skipped_frame
from mmferry.errors import ArgumentError
from mmferry.fields import FieldSpec, Placement
from mmferry.transfer import Mirrored, parse_device

__all__ = ["audit", "audit_model", "placements_of"]


def placements_of(specs: Mapping[str, FieldSpec | Placement | str]) -> dict[str, Placement]:
    """Each field's placement; a spec may also be given as a bare placement."""
    out = {}
    for name, spec in specs.items():
        if isinstance(spec, FieldSpec):
            out[name] = spec.placement
        elif isinstance(spec, Placement | str):
            out[name] = Placement.parse(spec)
        else:
            raise ArgumentError(f"expected a FieldSpec or a placement, got {type(spec).__name__}",
                                argument=f"specs[{name!r}]")
    return out


def _simulated_device(device: str | torch.device) -> torch.device:
    return parse_device(device, simulated=True)


def _check_allow(allow: Iterable[str]) -> tuple[str, ...]:
    allow = (allow,) if isinstance(allow, str) else tuple(allow)
    for kind in allow:
        if kind not in KINDS:
            raise ArgumentError(f"unknown finding kind {kind!r}; expected one of {KINDS}",
                                argument="allow")
    return allow


def _module_of(fn: Callable[..., Any], module: torch.nn.Module | None) -> torch.nn.Module | None:
    if module is not None:
        return module
    if isinstance(fn, torch.nn.Module):
        return fn
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


def audit(
    fn: Callable[..., Any],
    inputs: Mapping[str, Any],
    specs: Mapping[str, FieldSpec | Placement | str],
    *,
    module: torch.nn.Module | None = None,
    device: str | torch.device = "cuda",
    allow: Iterable[str] = (),
) -> AuditReport:
    """Call ``fn(**inputs)`` once on the simulated ``device`` and report every fault.

    Each input named in ``specs`` is tracked as its field and placed where the spec says;
    an input without a spec is an untracked device value. Parameters and buffers of
    ``module`` (default: ``fn`` itself when it is an ``nn.Module`` or a bound method of
    one) live on the device. The call runs to the end past every finding; if it raises,
    the report keeps what was found and says why in ``error``. Findings whose kind is in
    ``allow`` are listed but do not make the report fail.
    """
    allow = _check_allow(allow)
    sim = _simulated_device(device)
    placements = {k: p for k, p in placements_of(specs).items() if k in inputs}
    tracer = Tracer(sim, {k: p.value for k, p in placements.items()})
    placed: dict[str, Any] = {}
    for name, value in inputs.items():
        p = placements.get(name)
        fields = frozenset((name,)) if p is not None else frozenset()
        if p is Placement.BOTH:
            placed[name] = Mirrored(host=tracer.place(value, False, fields),
                                    device=tracer.place(value, True, fields))
        else:
            placed[name] = tracer.place(value, p is not Placement.HOST, fields)
    owner = _module_of(fn, module)
    module_tensors = [] if owner is None else [*owner.parameters(), *owner.buffers()]
    error = None
    try:
        with tracer.active(module_tensors):
            fn(**placed)
    except Exception as e:  # the partial report is the result; the error is part of it
        error = _describe_error(e)
    return AuditReport(
        findings=tracer.finding_list(),
        placements={k: p.value for k, p in placements.items()},
        allow=allow,
        error=error,
        ops=tracer.ops,
        device=str(sim),
    )


def _describe_error(e: Exception) -> str:
    if isinstance(e, UnauditableOpError):
        return str(e)
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not skipped_frame(f.filename)]
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}{where}"


def audit_model(
    model: Any,
    *,
    device: str | torch.device = "cuda",
    allow: Iterable[str] = (),
) -> dict[str, AuditReport]:
    """Audit a model's ``encode`` on its own dummy inputs, one report per batch.

    ``model`` follows :class:`mmferry.encoder.model.EncoderModel`: its dummy inputs are
    split into items by its field specs and batched as the runtime batches them; each
    batch is audited with the model's parameters on the device. Keys are the batch's
    modality (with ``#2``, ``#3``... when a modality gives several batches).
    """
    from mmferry.batching import batch_items
    from mmferry.items import split_items

    outputs = model.dummy_inputs()
    items = split_items(outputs, model.field_specs(outputs))
    module = model if isinstance(model, torch.nn.Module) else None
    reports: dict[str, AuditReport] = {}
    for batch in batch_items(items):
        key, n = batch.modality, 1
        while key in reports:
            n += 1
            key = f"{batch.modality}#{n}"
        reports[key] = audit(model.encode, batch.data, batch.specs, module=module,
                             device=device, allow=allow)
    return reports
