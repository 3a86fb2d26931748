"""The serving lock: which engine set may serve (and own the KV cache).

Every implementation keeps the same small contract (:class:`ServingLock`),
so the coordinator does not care whether the lock is a file on one node or a
Kubernetes Lease (``gms.failover.lease``).

:class:`FileServingLock` is the one-node lock.  It is an open-file-description
lock (``F_OFD_SETLK``) on a file: the kernel drops it when the last descriptor
of the open file closes, which includes the holder process dying, so a crash
can never leave it held.  OFD locks (unlike classic POSIX ``fcntl`` locks)
belong to the open file, not the process: two locks in one process exclude
each other too, and ``F_OFD_GETLK`` tests the lock without taking it, so
asking who holds it never disturbs a concurrent acquire.  The holder's
identity is written into the file while the lock is held; a record left by a
dead holder is ignored, because nobody holds the lock behind it.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import struct
import threading
import time
from typing import Protocol, runtime_checkable


@runtime_checkable
class ServingLock(Protocol):
    def try_acquire(self, holder: str) -> bool:
        """Non-blocking; True if ``holder`` now holds it (renews if it already did)."""
        ...

    def release(self, holder: str) -> None:
        """No-op unless held by ``holder``."""
        ...

    def holder(self) -> str | None:
        """The current live holder, None if free or expired."""
        ...


# struct flock on Linux (x86_64 and aarch64 alike): short l_type, short
# l_whence, off_t l_start, off_t l_len, pid_t l_pid, padded to 32 bytes.
_FLOCK = struct.Struct("@hhqqi4x")


def _flock(kind: int) -> bytes:
    return _FLOCK.pack(kind, os.SEEK_SET, 0, 0, 0)  # the whole file; pid must be 0 for OFD locks


class FileServingLock:
    """A :class:`ServingLock` over an OFD lock on ``path`` (created if missing).

    The lock is held by this object's open file: ``holder`` names the engine
    set on whose behalf it is held.  Another process (or another instance)
    asking for the same name while this one holds it is refused: only the
    open file that took the kernel lock can renew or release it.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._fd: int | None = None
        self._holder: str | None = None
        self._mutex = threading.Lock()  # one instance may be shared by threads

    # -- the contract ---------------------------------------------------------

    def try_acquire(self, holder: str) -> bool:
        if not holder:
            raise ValueError("a holder needs a name")
        with self._mutex:
            if self._fd is not None:
                return self._holder == holder  # already ours: nothing expires, nothing to renew
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK))
            except OSError:  # EAGAIN/EACCES: someone holds it
                os.close(fd)
                return False
            try:
                self._write_record(fd, holder)
            except BaseException:
                os.close(fd)  # closing the file drops the lock
                raise
            self._fd, self._holder = fd, holder
            return True

    def release(self, holder: str) -> None:
        with self._mutex:
            if self._fd is None or self._holder != holder:
                return
            fd, self._fd, self._holder = self._fd, None, None
            try:
                os.ftruncate(fd, 0)  # no stale name for readers
            finally:
                os.close(fd)

    def holder(self) -> str | None:
        with self._mutex:
            if self._fd is not None:
                return self._holder
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            probe = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock(fcntl.F_RDLCK))
            if _FLOCK.unpack(probe)[0] == fcntl.F_UNLCK:
                return None  # nobody holds it: whatever the file says is stale
            record = self._read_record(fd)
        finally:
            os.close(fd)
        # Held, but the holder may be between taking the lock and writing its
        # name: it is held by someone whose name we do not know yet.
        return record.get("holder") if record else "?"

    # -- beyond the contract --------------------------------------------------

    def record(self) -> dict | None:
        """What the file says about its holder (holder, pid, host, acquired_at)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            return self._read_record(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        with self._mutex:
            if self._fd is not None:
                os.close(self._fd)
                self._fd, self._holder = None, None

    def __repr__(self) -> str:
        return f"FileServingLock({self.path!r}, held={self._holder!r})"

    @staticmethod
    def _write_record(fd: int, holder: str) -> None:
        record = {"holder": holder, "pid": os.getpid(), "host": socket.gethostname(),
                  "acquired_at": time.time()}
        data = json.dumps(record).encode() + b"\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)

    @staticmethod
    def _read_record(fd: int) -> dict | None:
        data = os.pread(fd, 4096, 0)
        try:
            record = json.loads(data)
        except ValueError:
            return None
        return record if isinstance(record, dict) else None
