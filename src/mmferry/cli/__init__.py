"""The ``mmferry`` command."""

from __future__ import annotations

import click

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mmferry")
def main() -> None:
    """mmferry: the multimodal input data path of LLM inference engines."""



from mmferry.cli.audit import audit_command  # noqa: E402
from mmferry.cli.encode import encode  # noqa: E402
from mmferry.cli.launch import launch  # noqa: E402
from mmferry.cli.models import models_command  # noqa: E402
from mmferry.cli.serve import serve_command  # noqa: E402

main.add_command(audit_command)
main.add_command(encode)
main.add_command(launch)
main.add_command(models_command)
main.add_command(serve_command)
