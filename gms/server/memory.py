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

from ..cuda import DeviceInfo, Held, MemoryBackend, NoFileDescriptors
from ..fsm.errors import Rejection
from .admission import FdsExhausted
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
        self.fds = None  # the server's FdBudget (gms.server.admission), once serving

    async def create(self, items: list[tuple[str, int]]) -> None:
        """Make memory for each (id, aligned size), in one lane call; all or nothing.
        Raises OutOfMemory (transient: the caller waits), BackendError (fatal), or
        FdsExhausted (each holds an fd and the server has none to spare: at once)."""
        if self.fds is not None:
            self.fds.check_memory(len(items))
        try:
            made = await self.lane.call(_create_all, self.backend, items)
        except NoFileDescriptors as exc:  # the count missed some: refused all the same
            raise FdsExhausted("fds", "node", len(self._held), len(items), len(self._held), str(exc)) from None
        for (allocation_id, _), held in zip(items, made):
            self._held[allocation_id] = held
            self._bytes += held.size

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
        """Fds lent to a reply: the session gives them back to the budget once sent."""
        allocation_ids = list(allocation_ids)
        if self.fds is not None:
            self.fds.lend(len(allocation_ids))
        fds: list[int] = []
        try:
            for allocation_id in allocation_ids:
                fds.append(self.export(allocation_id))
        except BaseException:
            for fd in fds:
                os.close(fd)
            if self.fds is not None:
                self.fds.returned(len(allocation_ids))
            raise
        return fds

    def release(self, allocation_ids: Iterable[str]) -> None:
        """Forget them here at once; the lane closes and frees them after what it has queued."""
        gone = [self._held.pop(allocation_id) for allocation_id in allocation_ids]
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
