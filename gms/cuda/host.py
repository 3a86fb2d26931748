"""Host-memory stand-in for the CUDA VMM adapters, for machines without a GPU.

Server side, each allocation is a sealed ``memfd`` sized to its aligned size;
its fd travels exactly like a VMM fd.  Client side, address space is reserved
with an anonymous ``PROT_NONE`` mapping and fds are mapped over it with
``MAP_FIXED | MAP_SHARED``; unmapping puts ``PROT_NONE`` back, so the
reservation (and every pointer into it) survives unmap/remap.

Capacity behaves like VRAM: released memory still counts while any client
maps it.  The server marks each memfd's open file description with a shared
OFD lock; SCM_RIGHTS copies and mmaps share that description, so the lock lives
exactly as long as the memory does.  A probe fd opened on the same file (a new
description) tests the lock to learn when the last user let go.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import stat
import struct
import threading

from .interface import BackendError, DeviceInfo, Held, MemoryLost, NoFileDescriptors, OutOfMemory

DEFAULT_GRANULARITY = 2 << 20

log = logging.getLogger("gms.host")

_F_OFD_GETLK = 36
_F_OFD_SETLK = 37
_FLOCK = struct.Struct("hhqqi4x")  # l_type, l_whence, l_start, l_len (0: whole file), l_pid


def _flock(lock_type: int) -> bytes:
    return _FLOCK.pack(lock_type, os.SEEK_SET, 0, 0, 0)


class HostBackend:
    """``memfd`` allocations; ``capacity`` (bytes, None: unlimited) makes OOM testable.

    Called from its lane thread (``gms.server.tiers.lanes``), like the CUDA backend,
    and for small allocations from the event loop too, so its counts take a
    lock.  It keeps no table of what it made."""

    name = "host"
    # A memfd is made in a few system calls, sparse until written; closing a
    # written one frees its pages, about 40 ms a GiB (0.09 ms for 2 MiB).
    loop_bytes = 4 << 20

    def __init__(
        self, device: int = 0, capacity: int | None = None, granularity: int = DEFAULT_GRANULARITY
    ) -> None:
        self.device = device
        self.capacity = capacity
        self.granularity = granularity
        self._live_bytes = 0
        # Released memory that clients may still map: (probe fd, size).
        self._draining: list[tuple[int, int]] = []
        self._counts = threading.Lock()  # the loop creates while the lane releases

    # -- accounting ---------------------------------------------------------

    def _prune_draining(self) -> int:
        """Forget released memory nobody maps any more; returns bytes still held (under the lock)."""
        held = []
        for probe, size in self._draining:
            answer = fcntl.fcntl(probe, _F_OFD_GETLK, _flock(fcntl.F_WRLCK))
            if _FLOCK.unpack(answer)[0] == fcntl.F_UNLCK:
                os.close(probe)
            else:
                held.append((probe, size))
        self._draining = held
        return sum(size for _, size in held)

    def bytes_in_use(self) -> int:
        """Server-owned bytes plus released bytes still mapped by clients."""
        with self._counts:
            return self._live_bytes + self._prune_draining()

    # -- MemoryBackend ------------------------------------------------------

    def create(self, aligned_size: int, label: str = "") -> Held:
        with self._counts:  # checked and counted at once: the loop and the lane both create
            if self.capacity is not None and self._live_bytes + self._prune_draining() + aligned_size > self.capacity:
                raise OutOfMemory(f"host capacity of {self.capacity} bytes reached")
            fd = self._memfd(aligned_size, label)
            self._live_bytes += aligned_size
        return Held(None, fd, aligned_size)

    def _memfd(self, aligned_size: int, label: str) -> int:
        try:
            fd = os.memfd_create(f"gms-{label}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                raise NoFileDescriptors(str(exc)) from exc
            if exc.errno == errno.ENOMEM:
                raise OutOfMemory(str(exc)) from exc
            raise BackendError(f"memfd_create failed: {exc}") from exc
        try:
            os.ftruncate(fd, aligned_size)
            # A client must not shrink memory under other readers (SIGBUS).
            fcntl.fcntl(
                fd,
                fcntl.F_ADD_SEALS,
                fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL,
            )
            if self.capacity is not None:
                fcntl.fcntl(fd, _F_OFD_SETLK, _flock(fcntl.F_RDLCK))
        except OSError as exc:
            os.close(fd)
            if exc.errno == errno.ENOMEM:
                raise OutOfMemory(str(exc)) from exc
            raise BackendError(f"preparing memfd failed: {exc}") from exc
        return fd

    def adopt(self, fd: int, aligned_size: int) -> Held:
        """A memfd is its memory: valid while it is a file of the size it was made.
        Its OFD lock (capacity counting) came with the fd: SCM_RIGHTS keeps the
        open file description, which owns the lock."""
        try:
            st = os.fstat(fd)
        except OSError as exc:
            raise MemoryLost(f"not an open fd: {exc}") from None
        if not stat.S_ISREG(st.st_mode) or st.st_size != aligned_size:
            raise MemoryLost(f"not a memfd of {aligned_size} bytes (mode {st.st_mode:o}, {st.st_size} bytes)")
        with self._counts:
            self._live_bytes += aligned_size
        return Held(None, fd, aligned_size)

    def release(self, held: Held) -> None:
        with self._counts:
            self._live_bytes -= held.size
            if self.capacity is not None:  # counted until no client maps it (capacity makes OOM testable)
                self._watch(held)
            os.close(held.fd)
            if self._draining:
                self._prune_draining()

    def _watch(self, held: Held) -> None:
        """A second description of the same file, to watch the lock from."""
        try:
            probe = os.open(f"/proc/self/fd/{held.fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            # No fd to spare (a flood of connections): count the memory as
            # free now rather than fail a release, which must not fail.
            log.warning("cannot watch released memory (%s): counted free now", exc)
        else:
            self._draining.append((probe, held.size))

    def device_info(self) -> DeviceInfo:
        if self.capacity is None:
            # Uncapped: the machine's RAM is the device (no single allocation beyond it).
            total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        else:
            total = self.capacity
            free = max(self.capacity - self.bytes_in_use(), 0)
        return DeviceInfo(
            backend=self.name,
            device=self.device,
            name="host memory (memfd)",
            uuid=f"host-{self.device}",
            total_bytes=total,
            free_bytes=free,
        )

    def close(self) -> None:
        for probe, _ in self._draining:  # at shutdown: nothing creates any more
            os.close(probe)
        self._draining = []


# -- client side ---------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_munmap = _libc.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_RESERVE_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)
_MAP_FIXED = 0x10
_PROT_NONE = 0


def _check_mmap(result: int | None, what: str) -> int:
    if result is None or result == _MAP_FAILED:
        err = ctypes.get_errno()
        raise BackendError(f"{what} failed: {os.strerror(err)}")
    return result


class HostMapper:
    """Maps host-backend fds into this process; addresses are real memory."""

    name = "host"

    def __init__(self, device: int = 0) -> None:
        self.device = device
        self.granularity = mmap.PAGESIZE

    def reserve(self, size: int) -> int:
        return _check_mmap(_mmap(None, size, _PROT_NONE, _RESERVE_FLAGS, -1, 0), "reserve")

    def map(self, fd: int, va: int, size: int, writable: bool) -> object:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        try:
            got = _check_mmap(_mmap(va, size, prot, mmap.MAP_SHARED | _MAP_FIXED, fd, 0), "map")
        finally:
            os.close(fd)
        if got != va:
            raise BackendError(f"map landed at {got:#x}, not {va:#x}")
        return va  # the host has no separate handle: the mapping is its address

    def map_many(self, items, writable: bool) -> list[object]:
        return [self.map(fd, va, size, writable) for fd, va, size in items]

    def map_host(self, fd: int, va: int, size: int) -> object:
        # The host tier is memfd too: the same mapping, always writable.
        return self.map(fd, va, size, True)

    def unmap(self, va: int, size: int, handle: object) -> None:
        # Replace the mapping with a fresh reservation in one call: no window
        # in which another thread's mmap could take the range.
        _check_mmap(_mmap(va, size, _PROT_NONE, _RESERVE_FLAGS | _MAP_FIXED, -1, 0), "unmap")

    def unmap_many(self, items) -> None:
        for va, size, handle in items:
            self.unmap(va, size, handle)

    def free(self, va: int, size: int) -> None:
        if _munmap(va, size) != 0:
            raise BackendError(f"munmap failed: {os.strerror(ctypes.get_errno())}")

    def synchronize(self) -> None:
        pass

    def copy(self, dst: int, src: int, size: int) -> None:
        ctypes.memmove(dst, src, size)

    def write(self, va: int, data: bytes) -> None:
        ctypes.memmove(va, data, len(data))

    def read(self, va: int, size: int) -> bytes:
        return ctypes.string_at(va, size)
