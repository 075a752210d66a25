"""``mmferry audit``: placement audit of built-in models (or the synthetic examples) on a
simulated device; exits non-zero when a finding outside ``--allow`` exists, so CI can gate
on it."""

from __future__ import annotations

import json
from typing import Any

import click

from mmferry.audit.findings import KINDS
from mmferry.cli.args import validated
from mmferry.errors import ArgumentError

__all__ = ["audit_command"]


def _example_targets(specs: tuple[str, ...]) -> list[tuple[str, Any, Any]]:
    from mmferry.audit import examples

    out = []
    for spec in specs:
        name, _, case_name = spec.partition(":")
        example = examples.EXAMPLES.get(name)
        if example is None:
            raise ArgumentError(f"unknown example {name!r}; known: {', '.join(examples.names())}",
                                argument="--example")
        try:
            case = example.case(case_name or None)
        except KeyError:
            cases = ", ".join(["correct", *example.wrong])
            raise ArgumentError(f"example {name!r} has no case {case_name!r}; cases: {cases}",
                                argument="--example") from None
        out.append((f"{name}:{case_name or 'correct'}", example, case))
    return out


def _list() -> None:
    from mmferry import models
    from mmferry.audit import examples

    click.echo("models: " + ", ".join(models.names()))
    click.echo("examples (--example NAME[:CASE]):")
    for name, ex in examples.EXAMPLES.items():
        click.echo(f"  {name:14s} {ex.summary}")
        click.echo(f"  {'':14s} cases: correct, {', '.join(ex.wrong)}")


@click.command("audit")
@click.argument("model_names", metavar="[MODEL]...", nargs=-1)
@click.option("--all", "all_models", is_flag=True, help="Audit every built-in model.")
@click.option("--example", "example_specs", multiple=True, metavar="NAME[:CASE]",
              help="Audit a synthetic example encoder (a wrong CASE shows its faults).")
@click.option("--allow", multiple=True, type=click.Choice(KINDS),
              help="A finding kind that does not fail the audit (repeatable).")
@click.option("--device", "simulated_device", default="cuda", show_default=True,
              help="The simulated device.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--list", "list_targets", is_flag=True, help="List models and examples, then exit.")
@validated
def audit_command(model_names: tuple[str, ...], all_models: bool, example_specs: tuple[str, ...],
                  allow: tuple[str, ...], simulated_device: str, as_json: bool,
                  list_targets: bool) -> None:
    """Audit field placements on a simulated device, without a GPU.

    Runs each model's encoder on its dummy inputs (or an example encoder) once on the CPU,
    with every field where its contract places it, and reports each device mismatch, host
    sync, implicit or pageable copy and asynchronous-copy race, grouped by field. Exits 1
    when any finding's kind is not --allow'ed (or the encoder raised), 0 otherwise.
    """
    from mmferry import models
    from mmferry.audit import audit, audit_model

    if list_targets:
        _list()
        return
    if all_models:
        model_names = tuple(models.names())
    examples = _example_targets(example_specs)
    if not model_names and not examples:
        raise ArgumentError("nothing to audit: give MODEL names, --all or --example NAME "
                            "(see --list)", argument="MODEL")

    results = []
    for name in model_names:
        for batch, report in audit_model(models.load(name), device=simulated_device, allow=allow).items():
            results.append((f"{name} ({batch})", report))
    for target, example, case in examples:
        report = audit(example.build(case.variant), example.inputs(), case.specs,
                       device=simulated_device, allow=allow)
        results.append((target, report))

    ok = all(report.ok for _, report in results)
    if as_json:
        click.echo(json.dumps({"ok": ok, "reports": [{"target": t, **r.to_dict()}
                                                      for t, r in results]}, indent=1))
    else:
        for target, report in results:
            click.echo(f"== {target}")
            click.echo(report.format())
    if not ok:
        raise SystemExit(1)
