"""The disk tier's folder: snapshots made fresh, sealed atomically, found again, released.

One folder per server (``gms serve --disk-dir``), owned by the server's uid
and closed to everyone else (0700; a folder that is a link, another uid's, or
open to others' writes is refused: the daemon runs as root and these files are
model weights).  Every file is opened relative to the folder, never following
a link, under a name derived from what it holds (``format.file_name``).

A save writes ``.<name>.<pid>.<n>.tmp`` (``O_EXCL``), room reserved first
(``posix_fallocate``: a full disk fails here, before a byte is copied), then
the copier fills the data, then :meth:`DiskStore.seal` writes the manifest and
trailer, fsyncs the file, renames it into place and fsyncs the folder: a
snapshot is either whole and visible or not there.  A crash leaves at most a
temporary file, which the next start removes.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import stat
import threading
import time
from collections.abc import Callable

import attrs

from ..system.files import pwrite_all
from . import format as fmt

log = logging.getLogger("gms.disk")

_TEMPORARY = ".tmp"
# Reading a snapshot: never through a link, and never waiting on a FIFO or a
# device planted under a snapshot's name (only a regular file reads: _read_manifest).
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_ASIDE = ".corrupt"
SET_ASIDE_KEPT = 4  # set-aside files kept for the operator, the newest by their save stamp; older ones go
_counter = itertools.count()


class FolderRefused(OSError):
    """The disk folder is not one a daemon may keep weights in."""


@attrs.frozen
class Pending:
    """A snapshot being written: its temporary name in the folder, and its fd."""

    temporary: str
    name: str
    fd: int


@attrs.frozen
class Found:
    """A snapshot found in the folder at start: its file, and what it holds (or why not)."""

    file: str
    manifest: fmt.Manifest | None
    size: int = 0
    error: fmt.SnapshotError | None = None


class DiskStore:
    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._dir_fd = _folder(directory)
        # The highest save stamp any file in the folder carries (its name says it: no file opened).
        self.highest = max((s for n in os.listdir(self._dir_fd) if (s := fmt.stamp_of(n)) is not None), default=0)
        # Files in the folder no layout holds (set aside, or left on disk: refused at a
        # start, of another format), with their sizes: counted against the disk budget
        # beside the log's snapshots (gms.server.service.snapshots: Snapshots.fit).
        self._loose: dict[str, int] = {}
        self._loose_lock = threading.Lock()  # (the store's calls run on worker threads)

    def close(self) -> None:
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1

    # -- saving ------------------------------------------------------------------------

    def next_stamp(self) -> int:
        """A new save's stamp: the wall clock, or just past every snapshot this folder
        has held, whichever is higher (a clock set back never makes an older snapshot
        win over a newer one at the next cold start)."""
        self.highest = max(time.time_ns(), self.highest + 1)
        return self.highest

    def begin(self, name: str, size: int) -> Pending:
        """A temporary file of ``size`` bytes reserved to become ``name``: OSError
        (ENOSPC: a full disk) if not."""
        temporary = f".{name}.{os.getpid()}.{next(_counter)}{_TEMPORARY}"
        fd = os.open(
            temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self._dir_fd,
        )
        try:
            os.fchmod(fd, 0o600)
            os.posix_fallocate(fd, 0, size)
        except BaseException:
            self.abandon(Pending(temporary, name, fd))
            raise
        return Pending(temporary, name, fd)

    def seal(self, pending: Pending, manifest: fmt.Manifest) -> int:
        """Write the manifest and trailer after the data, make it durable and visible; its size."""
        at = manifest.data_bytes
        tail = fmt.encode(manifest, at)
        try:
            pwrite_all(pending.fd, tail, at)
            os.ftruncate(pending.fd, at + len(tail))  # (room was reserved for a bound on the manifest)
            os.fsync(pending.fd)
            os.rename(pending.temporary, pending.name, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
            os.fsync(self._dir_fd)
        except BaseException:
            self.abandon(pending)
            raise
        os.close(pending.fd)
        return at + len(tail)

    def abandon(self, pending: Pending) -> None:
        with contextlib.suppress(OSError):
            os.close(pending.fd)
        with contextlib.suppress(OSError):
            os.unlink(pending.temporary, dir_fd=self._dir_fd)

    # -- reading -------------------------------------------------------------------------

    def open(self, file: str) -> tuple[int, fmt.Manifest]:
        """The snapshot's fd (read-only) and its manifest; SnapshotError if it does not
        read as the snapshot its name says (OSError if it is not there)."""
        fd = os.open(file, _READ, dir_fd=self._dir_fd)
        try:
            manifest, _ = _read_named(fd, file)
        except BaseException:
            os.close(fd)
            raise
        return fd, manifest

    def scan(self, which: Callable[[str], bool] = lambda file: True) -> list[Found]:
        """Every snapshot in the folder (``which`` of them), in name order, read or refused."""
        return [
            self.find(name) for name in sorted(os.listdir(self._dir_fd))
            if name.endswith(fmt.SUFFIX) and not name.startswith(".") and which(name)
        ]

    def find(self, name: str) -> Found:
        """One snapshot of the folder, read or refused (one not there: refused)."""
        try:
            fd = os.open(name, _READ, dir_fd=self._dir_fd)
        except OSError as exc:
            return Found(name, None, error=fmt.CorruptSnapshot(f"cannot open it: {exc}"))
        try:
            return Found(name, *_read_named(fd, name))
        except fmt.SnapshotError as exc:
            return Found(name, None, error=exc)
        except OSError as exc:
            return Found(name, None, error=fmt.CorruptSnapshot(f"cannot read it: {exc}"))
        finally:
            os.close(fd)

    # -- letting go ------------------------------------------------------------------------

    def remove(self, file: str) -> None:
        """Unlink a released snapshot; one that will not go is left, and said so (never fatal)."""
        try:
            os.unlink(file, dir_fd=self._dir_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("snapshot %s was released but could not be removed: %s", file, exc)
            return
        with self._loose_lock:
            self._loose.pop(file, None)

    def set_aside(self, file: str) -> str:
        """Rename a snapshot that does not read out of the way (kept for the operator); its
        new name ("": it is not there)."""
        aside = file + _ASIDE
        try:
            os.rename(file, aside, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        except FileNotFoundError:
            return ""
        self.leave(aside)
        with self._loose_lock:
            self._loose.pop(file, None)
        return aside

    # -- what no layout holds ----------------------------------------------------------------

    def leave(self, file: str) -> None:
        """``file`` stays in the folder though no layout holds it: counted as loose."""
        try:
            size = os.stat(file, dir_fd=self._dir_fd, follow_symlinks=False).st_size
        except FileNotFoundError:
            return
        with self._loose_lock:
            self._loose[file] = size

    def find_loose(self, held: Callable[[str], bool]) -> None:
        """At a start: every snapshot or set-aside file in the folder not ``held`` is loose."""
        for name in os.listdir(self._dir_fd):
            if not name.startswith(".") and (name.endswith(fmt.SUFFIX) or name.endswith(fmt.SUFFIX + _ASIDE)) \
                    and not held(name):
                self.leave(name)

    @property
    def loose_bytes(self) -> int:
        with self._loose_lock:
            return sum(self._loose.values())

    def first_to_go(self, skip: set[str]) -> str | None:
        """The loose file to remove first when the budget needs room: set-aside ones
        before whole ones, the oldest save first (``skip``: not those).  None: no other."""
        with self._loose_lock:
            names = [n for n in self._loose if n not in skip]
        return min(names, key=lambda n: (not n.endswith(_ASIDE), fmt.stamp_of(n) or 0, n), default=None)

    def trim_set_aside(self, keep: int = SET_ASIDE_KEPT) -> list[str]:
        """Remove all but the ``keep`` newest set-aside files (by the stamp their names
        carry: the log's order of saves, not the clock's): the names removed.  Each
        cold start may set more aside; the folder must not fill with them."""
        aside = [n for n in os.listdir(self._dir_fd) if n.endswith(fmt.SUFFIX + _ASIDE) and not n.startswith(".")]
        aside.sort(key=lambda n: (fmt.stamp_of(n) or 0, n), reverse=True)
        for name in aside[keep:]:
            self.remove(name)
        return aside[keep:]

    def sweep(self) -> list[str]:
        """Remove temporary files (saves a crash cut short); the names removed.  A
        whole snapshot the log does not name stays: a later cold start may recover it."""
        removed = []
        for name in os.listdir(self._dir_fd):
            if name.startswith(".") and name.endswith(_TEMPORARY):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=self._dir_fd)
                removed.append(name)
        return removed

    def free_bytes(self) -> int:
        st = os.fstatvfs(self._dir_fd)
        return st.f_bavail * st.f_frsize


def purge(directory: str) -> tuple[int, list[str]]:
    """``gms stop --purge``: remove a stopped server's disk folder, every snapshot
    in it (sealed, set aside or half-written) and then the folder; another's
    files, and the folder holding them, stay.  Returns (files removed, names left).
    Nothing is followed through a link (the daemon runs as root)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return 0, []
    removed, left = 0, []
    try:
        for name in os.listdir(fd):
            ours = name.endswith((fmt.SUFFIX, fmt.SUFFIX + _ASIDE)) or (name.startswith(".") and name.endswith(_TEMPORARY))
            if not ours or stat.S_ISDIR(os.lstat(name, dir_fd=fd).st_mode):
                left.append(name)
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=fd)
                removed += 1
    finally:
        os.close(fd)
    if not left:
        os.rmdir(directory)
    return removed, sorted(left)


def _folder(directory: str) -> int:
    """The folder, made 0700 if missing; FolderRefused where it is a link, another
    uid's, or others may write in it."""
    os.makedirs(os.path.dirname(os.path.abspath(directory)), mode=0o755, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise FolderRefused(exc.errno, f"the disk folder {directory} cannot be opened (a link?): {exc.strerror}")
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or not stat.S_ISDIR(st.st_mode):
        os.close(fd)
        raise FolderRefused(
            0, f"the disk folder {directory} is not this server's alone (owner uid {st.st_uid}, "
            f"mode {stat.S_IMODE(st.st_mode):o}): it must be uid {os.geteuid()}'s, writable by nobody else",
        )
    return fd


def _read_named(fd: int, file: str) -> tuple[fmt.Manifest, int]:
    """The manifest and size of the snapshot ``file``; CorruptSnapshot where it
    holds another than its name says."""
    manifest, size = _read_manifest(fd)
    if not fmt.names_it(manifest, file):
        raise fmt.CorruptSnapshot(f"the file holds {manifest.name!r}, not the snapshot it is named for")
    return manifest, size


def _read_manifest(fd: int) -> tuple[fmt.Manifest, int]:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise fmt.CorruptSnapshot("not a regular file")
    size = st.st_size
    tail = os.pread(fd, fmt.TRAILER.size, max(0, size - fmt.TRAILER.size))
    version, at, length, crc = fmt.read_trailer(tail, size)
    body = os.pread(fd, length, at)
    if len(body) != length:
        raise fmt.CorruptSnapshot("the manifest is cut short")
    return fmt.decode(body, version, crc, data_end=at), size
