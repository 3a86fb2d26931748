"""The adapter interfaces through which every side effect on memory happens.

Server side, a :class:`MemoryBackend` creates memory, exports it as a file
descriptor and releases it; it never maps.  Client side, a :class:`Mapper`
reserves address space and maps exported descriptors into it.  The host
backend (``gms.cuda.host``) and the CUDA VMM backend (``gms.cuda.vmm``)
implement both, so the server, the client and the tests do not change between
a laptop and a GPU host.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import attrs


class OutOfMemory(Exception):
    """Transient: the server retries (allocation backpressure)."""


class NoFileDescriptors(Exception):
    """The process has no fd to spare for new memory (EMFILE, ENFILE): refused
    at once, never waited out like OutOfMemory (it is the process's table that
    is full, not the device)."""


class BackendError(Exception):
    """A memory call failed for a reason other than out-of-memory: fatal."""


class MemoryLost(Exception):
    """An fd handed to a restarted server is no longer the memory it was (on CUDA:
    it does not import, as after a GPU reset): its layout is dropped."""


@attrs.frozen
class DeviceInfo:
    backend: str
    device: int
    name: str
    uuid: str
    total_bytes: int | None
    free_bytes: int | None


def align_up(size: int, granularity: int) -> int:
    return -(-size // granularity) * granularity


def contiguous_runs(ranges: Sequence[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """Merge (start, size) ranges that touch into (start, size) runs, in address order."""
    run_start = run_end = None
    for start, size in sorted(ranges):
        if run_end is not None and start == run_end:
            run_end += size
            continue
        if run_start is not None:
            yield run_start, run_end - run_start
        run_start, run_end = start, start + size
    if run_start is not None:
        yield run_start, run_end - run_start


@attrs.frozen
class Held:
    """Memory a backend made: its handle (None on the host backend) and the one fd
    exported for it, which every export dups."""

    handle: object
    fd: int
    size: int


class MemoryBackend(Protocol):
    """Server-owned memory of one tier: the device, or the host tier that keeps
    copies of evicted layouts (memfd on the host backend, pinned host memory
    made by ``cuMemCreate`` on CUDA).

    A backend keeps no table of what it made: the server does, on its event
    loop (``gms.server.tiers.memory``), and calls the backend from that tier's lane
    (``gms.server.tiers.lanes``), one call at a time; ``create`` and ``release``
    also from the loop, for a few allocations of up to ``loop_bytes`` in all."""

    name: str
    device: int
    granularity: int
    # Bytes that ``create`` and ``release`` handle in well under a millisecond
    # (memfd): the server does that on its loop and saves the lane's thread
    # wake-ups; 0 (CUDA): every call on the lane.
    loop_bytes: int

    def create(self, aligned_size: int, label: str = "") -> Held:
        """Create memory and export one fd for it; raise OutOfMemory when full.
        ``label`` (the allocation id) names it where the backend can (memfd names)."""

    def release(self, held: Held) -> None:
        """Close the fd and drop the handle (importers keep theirs)."""

    def adopt(self, fd: int, aligned_size: int) -> Held:
        """Take over memory another server made (its fd, kept alive by a keeper
        or handed over): check it is still that memory, without a context, and
        return it as if made here.  Raises MemoryLost (the caller closes ``fd``)."""

    def device_info(self) -> DeviceInfo: ...

    def close(self) -> None:
        """Release what the backend itself holds (not the memory: the server releases that)."""


class Mapper(Protocol):
    """Client-side address space: reserve once, map and unmap many times."""

    name: str
    granularity: int

    def reserve(self, size: int) -> int:
        """Reserve ``size`` bytes of address space; returns the address."""

    def map(self, fd: int, va: int, size: int, writable: bool) -> object:
        """Import ``fd`` (closing it) and map it at ``va``; returns a handle for unmap."""

    def map_many(self, items: Sequence[tuple[int, int, int]], writable: bool) -> list[object]:
        """``map`` for many (fd, va, size); access is granted once per contiguous run."""

    def map_host(self, fd: int, va: int, size: int) -> object:
        """Import a host-tier ``fd`` (closing it) at ``va`` for copies (``copy``) to
        and from it; returns a handle for unmap."""

    def unmap(self, va: int, size: int, handle: object) -> None:
        """Unmap and release the imported memory; the reservation stays."""

    def unmap_many(self, items: Sequence[tuple[int, int, object]]) -> None:
        """``unmap`` for many (va, size, handle), one unmap per contiguous run."""

    def free(self, va: int, size: int) -> None:
        """Give the reservation back."""

    def synchronize(self) -> None:
        """Wait for device work touching mapped memory (no-op on the host)."""

    def copy(self, dst: int, src: int, size: int) -> None:
        """Start copying ``size`` bytes between mapped ranges (device or host tier);
        ``synchronize`` waits for it."""

    def write(self, va: int, data: bytes) -> None:
        """Copy host bytes to mapped memory at ``va`` (synchronously)."""

    def read(self, va: int, size: int) -> bytes:
        """Copy ``size`` bytes of mapped memory at ``va`` to the host."""
