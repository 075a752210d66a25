"""What an audit reports: :class:`Finding` (one fault at one place) and :class:`AuditReport`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["KINDS", "AuditReport", "Finding", "fix_hint"]

# Kinds, in the order a report lists them within a field.
KINDS = (
    "device_mismatch",
    "host_sync",
    "implicit_h2d",
    "pageable_async_copy",
    "async_copy_race",
)

_WHAT = {
    "device_mismatch": "host and device values meet in one op; on a GPU this raises "
    "'Expected all tensors to be on the same device'",
    "host_sync": "a device value is read on the host: a GPU-to-host sync",
    "implicit_h2d": "a host tensor is copied to the device synchronously (a blocking copy)",
    "pageable_async_copy": "non_blocking copy from pageable or non-dense host memory: "
    "the driver stages it synchronously, nothing overlaps",
    "async_copy_race": "a buffer of an asynchronous copy is used before any sync",
}


@dataclass(frozen=True, slots=True)
class Finding:
    """One placement fault: what (``kind``, ``op``), where (``location``, ``"file:line"`` in
    the user's code), which input ``fields`` the values involved derive from, how often
    (``count``, identical findings at one location are merged) and a ``message`` ending
    in a one-line fix hint."""

    kind: str
    fields: tuple[str, ...]
    op: str
    location: str
    message: str
    count: int = 1


def fix_hint(kind: str, fields: tuple[str, ...], placements: Mapping[str, str],
             detail: str = "") -> str:
    """The one-line fix for a finding of ``kind`` on ``fields`` placed as ``placements``."""
    names = ", ".join(repr(f) for f in fields)
    placed = {placements.get(f) for f in fields}
    if kind == "device_mismatch":
        if detail == "needs_host":
            return ("fix: give this op a host tensor (keep the field on the host, or read "
                    "the host side of a 'both' field)")
        if not fields:
            return "fix: create the tensor on the device (device=x.device)"
        return (f"fix: place {names} on the device (placement='device', or 'both' if the host "
                "also reads it)")
    if kind == "host_sync":
        if not fields:
            return "fix: compute this value from host fields instead of device values"
        if placed == {"device"}:
            return (f"fix: place {names} on the host (placement='host', or 'both' if kernels "
                    "also use it)")
        return (f"fix: read {names} on the host side (host math from the host tensor, not from "
                "a device copy)")
    if kind == "implicit_h2d":
        if not fields:
            return ("fix: build the tensor on the device, or upload it once with "
                    ".pin_memory().to(device, non_blocking=True)")
        return (f"fix: place {names} on the device (placement='device' or 'both') instead of "
                "copying it inside the model")
    if kind == "pageable_async_copy":
        return ("fix: copy from pinned, contiguous memory (.contiguous().pin_memory()) or let "
                "the contract place the field on the device")
    if kind == "async_copy_race":
        if detail == "read":
            return ("fix: synchronize (torch.cuda.synchronize() or the copy's event) before "
                    "reading the copied result")
        return "fix: wait for the copy (event or stream sync) before writing the source buffer"
    raise ValueError(f"unknown finding kind {kind!r}")


def describe(kind: str, op: str, fields: tuple[str, ...], placements: Mapping[str, str],
             detail: str = "", note: str = "") -> str:
    """A finding's message: what happened (``op`` itself is the finding's own field), and
    the fix."""
    what = _WHAT[kind]
    if note:
        # A race's note already says which buffer and copy; others add the general cause.
        what = note if kind == "async_copy_race" else f"{note}: {what}"
    return f"{what}; {fix_hint(kind, fields, placements, detail)}"


@dataclass(frozen=True)
class AuditReport:
    """Every finding of one audited call.

    ``ok`` is true when the call ran to the end (``error`` is None) and every finding's kind
    is in ``allow``. ``placements`` gives each audited field's placement and ``ops`` the
    number of aten ops the audit saw. ``str(report)`` is a table grouped by field;
    :meth:`to_dict` / :meth:`to_json` give the same as plain data.
    """

    findings: list[Finding]
    placements: dict[str, str] = field(default_factory=dict)
    allow: tuple[str, ...] = ()
    error: str | None = None
    ops: int = 0
    device: str = "cuda"

    @property
    def ok(self) -> bool:
        return self.error is None and all(f.kind in self.allow for f in self.findings)

    @property
    def kinds(self) -> dict[str, int]:
        """Finding counts (occurrences) per kind."""
        out: dict[str, int] = {}
        for f in self.findings:
            out[f.kind] = out.get(f.kind, 0) + f.count
        return out

    def by_field(self) -> dict[str, list[Finding]]:
        """Findings grouped by field ("" for values that derive from no input field); a
        finding on several fields appears under each."""
        groups: dict[str, list[Finding]] = {}
        for f in self.findings:
            for name in f.fields or ("",):
                groups.setdefault(name, []).append(f)
        order = {name: i for i, name in enumerate(self.placements)}
        return dict(sorted(groups.items(), key=lambda kv: (kv[0] == "", order.get(kv[0], 1e9))))

    def format(self) -> str:
        """A readable table: one block per field, one row per finding."""
        status = "ok" if self.ok else "FAILED"
        n = sum(f.count for f in self.findings)
        lines = [f"placement audit ({self.device}, {self.ops} ops): {status}, "
                 f"{len(self.findings)} findings ({n} occurrences)"]
        if self.placements:
            lines.append("placements: " + ", ".join(f"{k}={v}" for k, v in self.placements.items()))
        for name, group in self.by_field().items():
            title = f"{name} ({self.placements.get(name, 'untracked')})" if name else "(no field)"
            lines.append(title)
            kind_w = max(len(f.kind) for f in group)
            op_w = max(len(f.op) for f in group)
            for f in sorted(group, key=lambda f: KINDS.index(f.kind)):
                allowed = "  (allowed)" if f.kind in self.allow else ""
                lines.append(f"  {f.kind:<{kind_w}}  x{f.count:<3d} {f.op:<{op_w}}  "
                             f"{f.location}{allowed}")
                lines.append(f"      {f.message}")
        if self.error:
            lines.append(f"the call raised: {self.error}")
        return "\n".join(lines)

    __str__ = format

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "device": self.device,
            "ops": self.ops,
            "placements": dict(self.placements),
            "allow": list(self.allow),
            "error": self.error,
            "findings": [{**asdict(f), "fields": list(f.fields)} for f in self.findings],
        }

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)
