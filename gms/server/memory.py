"""One tier's server-owned memory: its table on the event loop, its backend on its lane.

The table (allocation id -> the handle and the one fd exported for it) is the
loop's alone: an export ``dup()``s an fd from it on the loop (a system call,
no CUDA), a status probe counts it there, and nothing else reads or writes
it, so no thread ever iterates what another changes.  The backend (CUDA or
memfd) is called only from the tier's lane (:mod:`gms.server.lanes`):
creation is awaited, release is handed over once the state has recorded it.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable

from ..cuda import DeviceInfo, Held, MemoryBackend, MemoryLost
from ..fsm.errors import Rejection
from .lanes import Lane

_FD_EXHAUSTED = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)


class ResourceExhausted(Rejection):
    """The server could not open another fd (its table or the system's is full)."""

    code = "RESOURCE_EXHAUSTED"


def _create_all(backend: MemoryBackend, items: list[tuple[str, int]]) -> list[Held]:
    """On the lane: all or nothing (a failure part-way releases what was made)."""
    made: list[Held] = []
    try:
        for allocation_id, size in items:
            made.append(backend.create(size, allocation_id))
    except BaseException:
        _release_all(backend, made)
        raise
    return made


def _adopt_all(backend: MemoryBackend, items: list[tuple[str, int, int]]):
    """On the lane: each (id, fd, size) checked; the lost ones' fds closed."""
    adopted, lost = [], []
    for allocation_id, fd, size in items:
        try:
            adopted.append((allocation_id, backend.adopt(fd, size)))
        except MemoryLost as exc:
            os.close(fd)
            lost.append((allocation_id, str(exc)))
    return adopted, lost


def _release_all(backend: MemoryBackend, held: Iterable[Held]) -> None:
    for one in held:
        backend.release(one)


class Memory:
    def __init__(self, backend: MemoryBackend, lane: Lane) -> None:
        self.backend = backend
        self.lane = lane
        self.name = backend.name
        self.granularity = backend.granularity
        self._held: dict[str, Held] = {}
        self._bytes = 0
        self.released = 0  # allocations released since the start
        # Told of every fd made or let go (the keeper link, where there is one):
        # ``held(tier, [(id, fd)])``, ``released(tier, [id])``; the tier is the lane's name.
        self.observer = None

    async def create(self, items: list[tuple[str, int]]) -> None:
        """Make memory for each (id, aligned size), in one lane call; all or nothing.
        Raises OutOfMemory (transient: the caller waits) or BackendError (fatal)."""
        made = await self.lane.call(_create_all, self.backend, items)
        for (allocation_id, _), held in zip(items, made):
            self._held[allocation_id] = held
            self._bytes += held.size
        if self.observer is not None:
            self.observer.held(self.lane.name, [(i, held.fd) for (i, _), held in zip(items, made)])

    async def adopt(self, items: list[tuple[str, int, int]]) -> list[tuple[str, str]]:
        """Memory another server made, by (id, fd, aligned size), checked on the lane
        and held here from now on; returns (id, why) for each found lost."""
        adopted, lost = await self.lane.call(_adopt_all, self.backend, items)
        for allocation_id, held in adopted:
            self._held[allocation_id] = held
            self._bytes += held.size
        return lost

    def held_fds(self) -> list[tuple[str, int]]:
        """(id, fd) of everything held: what a take-over hands on (the fds stay open here)."""
        return [(allocation_id, held.fd) for allocation_id, held in self._held.items()]

    def export(self, allocation_id: str) -> int:
        """A new fd for an allocation (the caller closes it).  Running out of fds (a
        flood of connections can fill the table) refuses this request; it must
        never stop the server."""
        try:
            return os.dup(self._held[allocation_id].fd)
        except OSError as exc:
            if exc.errno in _FD_EXHAUSTED:
                raise ResourceExhausted(
                    f"the server cannot open another file descriptor ({exc.strerror}); try again later"
                ) from None
            raise

    def export_many(self, allocation_ids: Iterable[str]) -> list[int]:
        fds: list[int] = []
        try:
            for allocation_id in allocation_ids:
                fds.append(self.export(allocation_id))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    def release(self, allocation_ids: Iterable[str]) -> None:
        """Forget them here at once; the lane closes and frees them after what it has queued."""
        allocation_ids = list(allocation_ids)
        gone = [self._held.pop(allocation_id) for allocation_id in allocation_ids]
        if gone and self.observer is not None:
            self.observer.released(self.lane.name, allocation_ids)
        if gone:
            self._bytes -= sum(held.size for held in gone)
            self.released += len(gone)
            self.lane.post(_release_all, self.backend, gone)

    def holds(self, allocation_id: str) -> bool:
        return allocation_id in self._held

    def live(self) -> tuple[int, int]:
        """(count, bytes) of memory this tier holds."""
        return len(self._held), self._bytes

    async def device_info(self) -> DeviceInfo:
        return await self.lane.call(self.backend.device_info)

    async def close(self) -> None:
        """Release everything, wait for the lane to finish, stop it."""
        self.release(list(self._held))
        await self.lane.call(self.backend.close)
        self.lane.stop()
