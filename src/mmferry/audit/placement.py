"""Which placement each field needs, found by counterfactual audits.

One audit cannot tell "needs the device" from "merely ran there", so each field is
audited twice, alone on the device and alone on the host (the other fields stay where
their specs put them):

* on the device, a host sync derived from the field means the host reads it;
* on the host, a device mismatch or a copy to the device means a kernel needs it.

Both -> ``both``; only kernels -> ``device``; otherwise ``host`` (it costs no copy).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TextIO

import torch

from mmferry.audit.findings import AuditReport, Finding
from mmferry.audit.run import audit, placements_of
from mmferry.fields import FieldSpec, Placement

__all__ = ["FieldEvidence", "explain", "recommend", "spec_code", "suggest_specs"]

_NEEDS_DEVICE = ("device_mismatch", "implicit_h2d", "pageable_async_copy")


@dataclass(frozen=True)
class FieldEvidence:
    """Why ``field`` should be placed at ``placement``: the findings that name it when it is
    alone on the device (``on_device``) and alone on the host (``on_host``)."""

    field: str
    placement: Placement
    current: Placement
    reason: str
    on_device: tuple[Finding, ...]
    on_host: tuple[Finding, ...]


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, list | tuple):
        return any(_has_tensor(v) for v in value)
    return False


def _summary(findings: Iterable[Finding], what: str) -> str:
    findings = list(findings)
    n = sum(f.count for f in findings)
    sites = ", ".join(f"{f.op} at {f.location}" for f in findings[:3])
    more = ", ..." if len(findings) > 3 else ""
    return f"{n} {what}{'s' if n != 1 else ''} ({sites}{more})"


def explain(
    fn: Callable[..., Any],
    inputs: Mapping[str, Any],
    specs: Mapping[str, FieldSpec | Placement | str],
    *,
    module: torch.nn.Module | None = None,
    device: str | torch.device = "cuda",
    allow: Iterable[str] = (),
) -> dict[str, FieldEvidence]:
    """The recommended placement of every tensor field in ``specs``, with its evidence.

    Takes the same arguments as :func:`mmferry.audit.audit` and runs it at most twice per
    field (runs that repeat a placement are shared).
    """
    current = {k: p for k, p in placements_of(specs).items() if k in inputs}
    runs: dict[tuple[tuple[str, str], ...], AuditReport] = {}

    def run(name: str, placement: Placement) -> AuditReport:
        trial = {**current, name: placement}
        key = tuple(sorted((k, p.value) for k, p in trial.items()))
        if key not in runs:
            runs[key] = audit(fn, inputs, trial, module=module, device=device, allow=allow)
        return runs[key]

    out = {}
    for name, now in current.items():
        if not _has_tensor(inputs[name]):
            continue
        on_dev, on_host = run(name, Placement.DEVICE), run(name, Placement.HOST)
        dev_found = tuple(f for f in on_dev.findings if name in f.fields)
        host_found = tuple(f for f in on_host.findings if name in f.fields)
        syncs = [f for f in dev_found if f.kind == "host_sync"]
        uploads = [f for f in host_found if f.kind in _NEEDS_DEVICE]
        errors = [e for e in (on_dev.error, on_host.error) if e]
        if errors and now is Placement.BOTH:
            placement = Placement.BOTH
            reason = ("the code needs both sides (with one side only it raised: "
                      f"{errors[0]})")
        else:
            if syncs and uploads:
                placement = Placement.BOTH
            elif uploads:
                placement = Placement.DEVICE
            else:
                placement = Placement.HOST
            reason = (f"on the device: {_summary(syncs, 'host sync') if syncs else 'no host reads'}"
                      f"; on the host: "
                      f"{_summary(uploads, 'kernel use') if uploads else 'never meets a kernel'}")
            if errors:
                reason += f"; the evidence is partial, the call raised: {errors[0]}"
        out[name] = FieldEvidence(name, placement, now, reason, dev_found, host_found)
    return out


def recommend(
    fn: Callable[..., Any],
    inputs: Mapping[str, Any],
    specs: Mapping[str, FieldSpec | Placement | str],
    **options: Any,
) -> dict[str, Placement]:
    """The placement each tensor field of ``specs`` should have: host if every use is on
    the host, device if it only meets kernels, both if it needs both. Same options as
    :func:`mmferry.audit.audit`; :func:`explain` gives the evidence."""
    return {k: e.placement for k, e in explain(fn, inputs, specs, **options).items()}


def spec_code(spec: FieldSpec | Placement | str, placement: Placement) -> str:
    """Python source that builds ``spec`` with ``placement``."""
    p = f"placement={placement.value!r}"
    if not isinstance(spec, FieldSpec):
        return repr(placement.value)
    m = repr(spec.modality)
    dim = f", dim={spec.dim}" if spec.dim else ""
    if spec.kind == "batched":
        return f"mf.FieldSpec.batched({m}, {p})"
    if spec.kind == "shared" and spec.batch_size is not None:
        return f"mf.FieldSpec.shared({m}, {spec.batch_size}, {p})"
    if spec.sizes is not None:
        return f"mf.FieldSpec.flat_from_sizes({m}, {list(spec.sizes)}{dim}, {p})"
    if spec.slices is not None:
        slices = ", ".join(_slice_code(s, spec.dim) for s in spec.slices)
        return f"mf.FieldSpec.flat({m}, [{slices}]{dim}, {p})"
    return f"mf.FieldSpec(kind={spec.kind!r}, modality={m}{dim}, {p})"


def _slice_code(bounds: tuple[tuple[int | None, int | None, int | None], ...], dim: int) -> str:
    def one(b: tuple[int | None, int | None, int | None]) -> str:
        start, stop, step = b
        return f"slice({start}, {stop})" if step is None else f"slice({start}, {stop}, {step})"

    if len(bounds) == dim + 1 and all(b == (None, None, None) for b in bounds[:dim]):
        return one(bounds[dim])
    return "(" + ", ".join(one(b) for b in bounds) + ("," if len(bounds) == 1 else "") + ")"


def suggest_specs(
    fn: Callable[..., Any],
    inputs: Mapping[str, Any],
    specs: Mapping[str, FieldSpec | Placement | str],
    *,
    file: TextIO | Literal["stdout"] | None = "stdout",
    name: str = "specs",
    **options: Any,
) -> str:
    """Print (to ``file``: standard output as it is at call time by default; None prints
    nothing) and return the spec mapping with every placement corrected, as Python source; a
    comment gives the reason for each change."""
    evidence = explain(fn, inputs, specs, **options)
    lines = [f"{name} = {{"]
    for field, spec in specs.items():
        ev = evidence.get(field)
        placement = ev.placement if ev else (
            spec.placement if isinstance(spec, FieldSpec) else Placement.parse(spec))
        if ev is not None and ev.placement is not ev.current:
            lines.append(f"    # {field}: was {ev.current.value!r}; {ev.reason}")
        lines.append(f"    {field!r}: {spec_code(spec, placement)},")
    lines.append("}")
    code = "\n".join(lines)
    if file is not None:
        print(code, file=sys.stdout if file == "stdout" else file)
    return code
