"""Reading untrusted files: regular files only, size-checked before reading, never blocking.

A path from a user or a peer may name a directory, a FIFO (whose reader blocks until a
writer comes), a device (``/dev/zero`` never ends) or a file far larger than anything the
caller can use. :func:`read_regular` opens without blocking, checks on the open descriptor
(so the file cannot be swapped between check and read) that it is a regular file of at most
``max_bytes``, and reads at most that many bytes.
"""

from __future__ import annotations

import os
import stat

__all__ = ["FileRefused", "read_regular"]


class FileRefused(OSError):
    """A path that is not a readable regular file within the size limit; ``reason`` says why
    in words (the caller wraps it in the typed error of its boundary)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def read_regular(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """The bytes of the regular file at ``path``, at most ``max_bytes`` of them.

    Raises:
        FileRefused: no such file, not a regular file (a directory, FIFO, socket or device),
            larger than ``max_bytes``, or unreadable; ``reason`` says which.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise FileRefused("no such file") from None
    except IsADirectoryError:
        raise FileRefused("a directory, not a file") from None
    except OSError as e:
        raise FileRefused(f"cannot open the file ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise FileRefused("a directory, not a file")
        if not stat.S_ISREG(st.st_mode):
            raise FileRefused("not a regular file (a FIFO, socket or device)")
        if st.st_size > max_bytes:
            raise FileRefused(f"file is {st.st_size} bytes, above the limit of {max_bytes}")
        chunks, total = [], 0
        while total <= max_bytes:
            chunk = os.read(fd, min(1 << 24, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > max_bytes:  # it grew while being read
            raise FileRefused(f"file grew past the limit of {max_bytes} bytes while read")
        return b"".join(chunks)
    except FileRefused:
        raise
    except OSError as e:
        raise FileRefused(f"cannot read the file ({e.strerror or e})") from None
    finally:
        os.close(fd)

