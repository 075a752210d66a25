"""``python -m mmferry``: the ``mmferry`` command."""

from mmferry.cli import main

main()
