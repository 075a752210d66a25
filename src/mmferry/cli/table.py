"""Plain-text tables for the command line."""

from __future__ import annotations

from collections.abc import Sequence

import click

__all__ = ["print_table"]


def print_table(rows: Sequence[Sequence[str]]) -> None:
    """Echo ``rows`` (the first is the header) as left-aligned columns."""
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
