"""The copier's disk path: device allocations to a snapshot file and back, checksummed.

A :class:`~gms.copier.messages.FileCopy` names extents (at most 32 MiB of one
allocation each, ``gms.disk.format``).  They run on ``THREADS`` threads at
once, so several reads (or writes) are in flight on the disk while others are
checksummed and copied: each thread takes the next extent and

* saves it: device -> staging buffer (a pinned one, on CUDA), crc32, ``pwrite``;
* restores it: ``pread`` into the staging buffer, crc32 checked, -> device.

On the host backend the device allocation is memory mapped here, so the file
is read into it and written from it directly (no staging).  Transfers are
``O_DIRECT`` where the file system takes it and the extent is aligned (the
file is reopened so: the server's own descriptor stays buffered), so a
restore reads the disk, not the page cache, and a save does not fill it.
``pread``, ``pwrite``, the crc32 (``gms.checksum``) and the copies release the GIL.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

from ..checksum import crc32
from ..system.files import pwrite_all
from . import messages as msg
from .engine import Engine, Mapped

THREADS = int(os.environ.get("GMS_DISK_THREADS", "4"))
ALIGN = 4096


class Corrupt(Exception):
    """The file's bytes are not what was saved (a checksum, or the file is short)."""


def view(va: int, size: int) -> memoryview:
    """The ``size`` bytes at ``va`` of this process's memory, as a writable buffer."""
    return memoryview((ctypes.c_char * size).from_address(va)).cast("B")


class FileCopier:
    """Runs file copies for one copier process; keeps a staging buffer per thread."""

    def __init__(self, engine: Engine, threads: int = THREADS) -> None:
        self.engine = engine
        self.pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="copier-disk")
        self._local = threading.local()
        self._staging: list[Mapped] = []
        self._lock = threading.Lock()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for mapped in self._staging:
            self.engine.free_staging(mapped)
        self._staging.clear()

    def run(self, job: msg.FileCopy, device: list[Mapped], file_fd: int,
            each: Callable[[], None] = lambda: None) -> list[int]:
        """Every extent of ``job`` (``device``: its allocations, mapped); the crc32
        of each.  Raises Corrupt, or OSError and the engine's errors."""
        direct = _reopen_direct(file_fd, job.to_file)
        try:
            work = self._save if job.to_file else self._load
            futures = [
                self.pool.submit(
                    work, device[job.allocation[k]].va + job.offset[k], job.size[k], job.file_offset[k],
                    job.crc[k] if not job.to_file else 0, file_fd, direct, each,
                )
                for k in range(len(job.size))
            ]
            # Every extent ended before anything is raised: a failed one (a checksum that
            # does not match) must not let the caller unmap memory, or close the file,
            # that the others still read into (the copier died of that, now and then).
            wait(futures)
            return [future.result() for future in futures]
        finally:
            if direct is not None:
                os.close(direct)

    def _save(self, va: int, size: int, at: int, _crc: int, fd: int, direct: int | None, each) -> int:
        address = va
        if not self.engine.host_addressable:
            address = self._buffer(size).va
            self.engine.copy_now(address, va, size, to_host=True)
        data = view(address, size)
        crc = crc32(data)
        pwrite_all(_fd_for(direct, fd, address, size, at), data, at)
        each()
        return crc

    def _load(self, va: int, size: int, at: int, crc: int, fd: int, direct: int | None, each) -> int:
        address = va if self.engine.host_addressable else self._buffer(size).va
        data = view(address, size)
        _pread_all(_fd_for(direct, fd, address, size, at), data, at)
        got = crc32(data)
        if got != crc:
            raise Corrupt(f"the {size} bytes at {at} do not match their checksum ({got:08x}, saved {crc:08x})")
        if address != va:
            self.engine.copy_now(va, address, size, to_host=False)
        each()
        return got

    def _buffer(self, size: int) -> Mapped:
        mapped = getattr(self._local, "staging", None)
        if mapped is None or mapped.size < size:
            if mapped is not None:
                self.engine.free_staging(mapped)
                with self._lock:
                    self._staging.remove(mapped)
            mapped = self._local.staging = self.engine.staging(max(size, 32 << 20))
            with self._lock:
                self._staging.append(mapped)
        return mapped


def _reopen_direct(fd: int, writable: bool) -> int | None:
    """The file again, with O_DIRECT (a new open file: the server's stays buffered); None
    where the file system refuses it (tmpfs)."""
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        return None
    with contextlib.suppress(OSError):
        return os.open(f"/proc/self/fd/{fd}", (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC | direct)
    return None


def _fd_for(direct: int | None, fd: int, address: int, size: int, at: int) -> int:
    """O_DIRECT where the buffer, the size and the offset are aligned; else the buffered fd."""
    return fd if direct is None or (address | size | at) % ALIGN else direct


def _pread_all(fd: int, data: memoryview, at: int) -> None:
    while data:
        got = os.preadv(fd, [data], at)
        if got == 0:
            raise Corrupt(f"the file ends {len(data)} bytes short of an extent at {at}")
        data, at = data[got:], at + got


def check(job: msg.FileCopy, fds: int) -> str:
    """Why the job is malformed ('' if it is not); fds: device fds and the file's."""
    extents = len(job.size)
    if fds != len(job.device_sizes) + 1:
        return f"{len(job.device_sizes)} device allocations and a file came with {fds} fds"
    if not (len(job.allocation) == len(job.offset) == len(job.file_offset) == len(job.crc) == extents):
        return "the extent columns differ in length"
    for allocation, offset, at, size in zip(job.allocation, job.offset, job.file_offset, job.size):
        if at < 0:
            return f"an extent is at {at} of its file"
        if error := msg.extent_error(job.device_sizes, allocation, offset, size, "an extent"):
            return error
    return ""
