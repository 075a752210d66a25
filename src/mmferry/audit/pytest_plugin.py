"""pytest plugin: the ``placement_audit`` fixture, for model authors' own tests.

::

    def test_my_encoder_placement(placement_audit):
        placement_audit(model.encode, batch.data, batch.specs, module=model)
        placement_audit.model(model)  # every batch of the model's dummy inputs

Each call audits and fails the test with the report's table when any finding is outside
``allow`` (or the call raised); it returns the report otherwise. Registered through the
``pytest11`` entry point; nothing heavy is imported until the fixture is used.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from mmferry.audit.findings import AuditReport


class PlacementAudit:
    """Callable behind the ``placement_audit`` fixture."""

    def __call__(self, fn: Callable[..., Any], inputs: Mapping[str, Any],
                 specs: Mapping[str, Any], **options: Any) -> AuditReport:
        """Audit ``fn(**inputs)`` (options as :func:`mmferry.audit.audit`); fail on findings."""
        from mmferry.audit import audit

        report = audit(fn, inputs, specs, **options)
        self._check(report, getattr(fn, "__qualname__", type(fn).__name__))
        return report

    def model(self, model: Any, **options: Any) -> dict[str, AuditReport]:
        """Audit every batch of ``model``'s dummy inputs; fail on findings."""
        from mmferry.audit import audit_model

        reports = audit_model(model, **options)
        for batch, report in reports.items():
            self._check(report, f"{model.name} ({batch})")
        return reports

    @staticmethod
    def _check(report: AuditReport, what: str) -> None:
        if not report.ok:
            pytest.fail(f"placement audit of {what} failed:\n{report.format()}", pytrace=False)


@pytest.fixture
def placement_audit() -> PlacementAudit:
    """Audit a function or a model and fail the test on placement findings."""
    return PlacementAudit()
