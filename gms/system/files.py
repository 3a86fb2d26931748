"""Files a gms process writes in folders others may write too (a ready file, a
saved journal): made fresh, following no link, readable by whom they say.

A daemon run as root that opens ``DIR/device-0.ready`` for writing follows a
link a local user planted there, and writes where the link points
(``/etc/...``).  :func:`write_new` opens the folder without following a link
in its last name, creates a file of its own under a temporary name (``O_EXCL``:
never an existing file or link), and renames it into place (a link at that
name is replaced, not followed).  :func:`remove` unlinks the name in that
folder (a link is removed, never what it points to).  Standard library only.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import IO


def _folder(path: str, mode: int) -> int:
    os.makedirs(path, mode=mode, exist_ok=True)
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


@contextlib.contextmanager
def write_new(folder: str, name: str, mode: int = 0o600, *, folder_mode: int = 0o755) -> Iterator[IO[str]]:
    """A text file open for writing that becomes ``folder/name`` (mode ``mode``,
    whatever the umask) when the block ends without an error; nothing is left
    behind when it raises.  OSError where the folder is a link or cannot be made."""
    dir_fd = _folder(folder, folder_mode)
    temporary = f".{name}.{os.getpid()}.new"
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                     dir_fd=dir_fd)
        try:
            os.fchmod(fd, mode)  # (the umask may have taken bits away; it never adds any)
            with open(fd, "w", encoding="utf-8", closefd=True) as out:
                yield out
            os.rename(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=dir_fd)
            raise
    finally:
        os.close(dir_fd)


def remove(folder: str, name: str) -> None:
    """Unlink ``folder/name`` (a link there is removed, not followed); gone already is fine."""
    try:
        dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    finally:
        os.close(dir_fd)


def pwrite_all(fd: int, data, at: int) -> None:
    """Write all of ``data`` (bytes or a buffer) at offset ``at`` of ``fd``: a
    ``pwrite`` may write less than it was given."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, at)
        view, at = view[written:], at + written
