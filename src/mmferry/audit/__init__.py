"""Placement audit: run a function once on the CPU while simulating the device, and report
every placement fault (device mismatch, host sync, implicit or unsafe copies).

``audit(fn, inputs, specs)`` puts each input where its spec's placement says (``both``
fields arrive as :class:`~mmferry.transfer.Mirrored`), module parameters and buffers on
the device, and calls ``fn(**inputs)`` with real values. ``recommend`` finds the placement
each field needs; ``suggest_specs`` prints the corrected contract as code.
"""

from mmferry.audit.findings import KINDS, AuditReport, Finding
from mmferry.audit.placement import FieldEvidence, explain, recommend, suggest_specs
from mmferry.audit.run import audit, audit_model, placements_of
from mmferry.audit.tracer import UnauditableOpError

__all__ = [
    "KINDS",
    "AuditReport",
    "FieldEvidence",
    "Finding",
    "UnauditableOpError",
    "audit",
    "audit_model",
    "explain",
    "placements_of",
    "recommend",
    "suggest_specs",
]
