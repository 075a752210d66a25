"""Typed errors, one per boundary of the data path.

Each is a ``ValueError`` so callers that already catch bad input keep working, and each
names what it refers to (a field, an item, a byte offset, a file, an argument) both in its
message and as an attribute.
"""

from __future__ import annotations


class MmferryError(ValueError):
    """Base of every error mmferry raises for bad input."""


class ContractError(MmferryError):
    """Processor output or items that break their field contract.

    ``field`` names the offending field (``None`` when the problem is not one field's).
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        self.field = field
        super().__init__(f"field {field!r}: {message}" if field is not None else message)


class WireError(MmferryError):
    """Malformed, truncated or oversized frames; ``offset`` is the byte offset in the frame."""

    def __init__(self, message: str, *, frame: int | None = None, offset: int | None = None) -> None:
        self.frame = frame
        self.offset = offset
        where = []
        if frame is not None:
            where.append(f"frame {frame}")
        if offset is not None:
            where.append(f"byte {offset}")
        super().__init__(f"{', '.join(where)}: {message}" if where else message)


class MediaError(MmferryError):
    """Media that cannot be decoded or exceeds a limit; ``source`` names the file or item."""

    def __init__(self, message: str, *, source: str | None = None) -> None:
        self.source = source
        super().__init__(f"{source}: {message}" if source is not None else message)


class ArgumentError(MmferryError):
    """A bad command-line or server argument; ``argument`` names it."""

    def __init__(self, message: str, *, argument: str | None = None) -> None:
        self.argument = argument
        super().__init__(f"{argument}: {message}" if argument is not None else message)


class CheckpointError(MmferryError):
    """A checkpoint folder that cannot load into a model; ``parameter`` names the (first)
    offending parameter when there is one."""

    def __init__(self, message: str, *, parameter: str | None = None) -> None:
        self.parameter = parameter
        super().__init__(message)


class EncoderCacheError(MmferryError):
    """An item that can never fit, or a cache whose referenced entries leave no room."""


class UnauditableOpError(RuntimeError):
    """An op the placement audit cannot run on the CPU (a custom op without a CPU kernel).

    Not a :class:`MmferryError`: the input is fine, the audit's reach is what ends."""
