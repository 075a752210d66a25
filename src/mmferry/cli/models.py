"""``mmferry models``: each built-in model with its fields, kinds and placements."""

from __future__ import annotations

import click

from mmferry.cli.args import validated
from mmferry.cli.table import print_table

__all__ = ["models_command"]


@click.command("models")
@validated
def models_command() -> None:
    """List each built-in model with its fields, their kinds and placements (from the
    contract the model declares for its dummy inputs)."""
    from mmferry import models

    rows = [("model", "modality", "field", "kind", "placement")]
    for name in models.names():
        model = models.load(name)
        outputs = model.dummy_inputs()
        for field, spec in model.field_specs(outputs).items():
            kind = "flat_from_sizes" if spec.sizes is not None else spec.kind
            if spec.dim:
                kind += f" (dim={spec.dim})"
            rows.append((name, spec.modality, field, kind, spec.placement.value))
    print_table(rows)
