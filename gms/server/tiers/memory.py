"""One tier's server-owned memory: its table on the event loop, its backend on its lane.

The table (allocation id -> the handle and the one fd exported for it) is the
loop's alone: an export ``dup()``s an fd from it on the loop (a system call,
no CUDA), a status probe counts it there, and nothing else reads or writes
it, so no thread ever iterates what another changes.  The backend (CUDA or
memfd) is called from the tier's lane (:mod:`gms.server.tiers.lanes`): creation is
awaited, release is handed over once the state has recorded it.  A backend
whose small calls never wait (memfd: ``loop_bytes``) makes and frees a few
small allocations on the loop instead, which saves two thread wake-ups.
"""

from __future__ import annotations

import errno
import functools
import os
from collections import OrderedDict
from collections.abc import Iterable

from ...cuda import (
    DeviceInfo,
    Held,
    MemoryBackend,
    MemoryLost,
    NoFileDescriptors,
    OutOfMemory,
    align_up,
)
from ...fsm.errors import Rejection
from ..edge.admission import FdBudget, FdsExhausted, lending
from .lanes import Lane
from .table import Kept

_FD_EXHAUSTED = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)
_ON_LOOP_MAX = 8  # allocations made or released at once on the loop (backend.loop_bytes in all)


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


class Stock:
    """Small allocations made ahead of need: a few spares per recently asked size.

    A lane round trip costs an allocation two thread wake-ups (about 0.19 ms on
    the H100 host's VM, bench/core_ops.py), more than making a small
    allocation does; so once a small size is asked for, the lane keeps a few
    of it made in the background, and the next requests of that size take
    them on the loop.  Bounded by ``max_bytes`` (sizes up to a quarter of it,
    at most ``DEPTH`` spares each; the least recently asked size goes
    first); this memory is the server's own, outside every budget, and is
    given back first when the device is full."""

    DEPTH = 4

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._spares: OrderedDict[int, list[Held]] = OrderedDict()

    def missing(self, size: int, pending: int) -> int:
        """How many spares of ``size`` to make now, ``pending`` being made already."""
        if not 0 < size <= self.max_bytes // 4:
            return 0
        depth = min(self.DEPTH, self.max_bytes // 4 // size)
        return max(0, depth - len(self._spares.get(size, ())) - pending)

    def take(self, size: int) -> Held | None:
        spares = self._spares.get(size)
        if not spares:
            return None
        self._spares.move_to_end(size)
        held = spares.pop()
        self.bytes -= held.size
        return held

    def put(self, held: Held) -> list[Held]:
        """Keep ``held``; returns what no longer fits (for release)."""
        gone = []
        while self.bytes + held.size > self.max_bytes and self._spares:
            size, spares = next(iter(self._spares.items()))
            if size == held.size and len(self._spares) == 1:
                break
            old = spares.pop()
            if not spares:
                del self._spares[size]
            self.bytes -= old.size
            gone.append(old)
        if self.bytes + held.size > self.max_bytes:
            return [*gone, held]
        self._spares.setdefault(held.size, []).append(held)
        self.bytes += held.size
        return gone

    def drain(self) -> list[Held]:
        gone = [held for spares in self._spares.values() for held in spares]
        self._spares.clear()
        self.bytes = 0
        return gone


class Memory:
    def __init__(self, backend: MemoryBackend, lane: Lane, stock_bytes: int = 0, observer=None,
                 fds: FdBudget | None = None) -> None:
        self.backend = backend
        self.lane = lane
        self.name = backend.name
        self.granularity = backend.granularity
        self.stock = Stock(stock_bytes)
        self._restocking: dict[int, int] = {}  # size -> spares being made
        self._held: dict[str, Held] = {}
        self._bytes = 0
        self.released = 0  # allocations released since the start
        # Ids a resumed server found lost (their memory never held here): the
        # LAYOUT_LOST that drops their layout releases them, and finds nothing.
        self._lost: set[str] = set()
        # Told of every fd made or let go (the keeper link, where there is one):
        # ``held(tier, [(id, fd)])``, ``released(tier, [id])``; the tier is the lane's name.
        # The stock's spares are not told: they are no state, and die with the server.
        self.observer = observer
        self.fds = fds  # the server's (gms.server.edge.admission): each allocation holds an fd

    async def create(self, items: list[tuple[str, int]], *, fds_checked: bool = False) -> None:
        """Make memory for each (id, aligned size), from the stock or in one lane
        call; all or nothing.  Raises OutOfMemory (transient: the caller waits;
        ``drop_stock`` first), BackendError (fatal), or FdsExhausted (each holds
        an fd and the server has none to spare: at once; ``fds_checked``: the
        caller asked the budget already, on this turn of the loop)."""
        if self.fds is not None and not fds_checked:
            self.fds.check_memory(len(items))
        stock = self.stock
        taken = [stock.take(size) for _, size in items] if stock.bytes else None
        missing = items if taken is None else [item for item, held in zip(items, taken) if held is None]
        try:
            made = []
            if missing:
                made = self._made_here(missing) or await self.lane.call(_create_all, self.backend, missing)
        except NoFileDescriptors as exc:  # the count missed some: refused all the same
            self._give_back([held for held in taken or () if held is not None])
            raise FdsExhausted("fds", "node", len(self._held), len(items), len(self._held), str(exc)) from None
        except BaseException:
            self._give_back([held for held in taken or () if held is not None])
            raise
        if taken is not None:  # the made ones come in the order they were missing
            made = iter(made)
            made = [held or next(made) for held in taken]
        table = self._held
        for (allocation_id, _), held in zip(items, made):
            table[allocation_id] = held
            self._bytes += held.size
        if self.observer is not None:  # before the event that records them (the caller's)
            self.observer.held(self.lane.name, [(i, table[i].fd) for i, _ in items])
        if stock.max_bytes:
            self._restock({size for _, size in items})

    def _made_here(self, items: list[tuple[str, int]]) -> list[Held] | None:
        """Made on the loop where the backend allows it and they are few (a
        restore's thousand would stall it); None where the lane must make them,
        or where the loop found the tier full (the lane runs the releases
        queued before it first)."""
        if len(items) <= _ON_LOOP_MAX:
            total = 0
            for _, size in items:
                total += size
            if total <= self.backend.loop_bytes:
                try:
                    return _create_all(self.backend, items)
                except OutOfMemory:
                    pass
        return None

    async def adopt(self, kept: list[Kept]) -> list[tuple[str, str]]:
        """Memory another server made, each in one part, checked on the lane and held
        here from now on; returns (id, why) for each found lost."""
        items, lost = [], []
        for one in kept:
            if len(one.parts) != 1:
                one.close()
                lost.append((one.allocation_id, f"its memory came in {len(one.parts)} parts, not one"))
            else:
                _, size, fd = one.parts[0]  # (a part's own size as given; a whole one's, aligned here)
                items.append((one.allocation_id, fd, size if size is not None else align_up(one.size, self.granularity)))
        adopted, failed = await self.lane.call(_adopt_all, self.backend, items) if items else ([], [])
        lost += failed
        for allocation_id, held in adopted:
            self._held[allocation_id] = held
            self._bytes += held.size
        self.mark_lost(allocation_id for allocation_id, _ in lost)
        return lost

    def mark_lost(self, allocation_ids: Iterable[str]) -> None:
        """Ids whose memory did not come over: their release finds nothing to release."""
        self._lost.update(allocation_ids)

    def held_fds(self) -> list[tuple[str, int]]:
        """(id, fd) of everything held: what a take-over hands on (the fds stay open here)."""
        return [(allocation_id, held.fd) for allocation_id, held in self._held.items()]

    def fd_of(self, allocation_id: str) -> int:
        """The fd held for an allocation (it stays open here)."""
        return self._held[allocation_id].fd

    def _restock(self, sizes: Iterable[int]) -> None:
        for size in sizes:
            for _ in range(self.stock.missing(size, self._restocking.get(size, 0))):
                self._restocking[size] = self._restocking.get(size, 0) + 1
                self.lane.post_then(functools.partial(self._stocked, size), self.backend.create, size, "stock")

    def _stocked(self, size: int, ok: bool, made: Held | BaseException) -> None:
        self._restocking[size] -= 1
        if not ok:
            if not isinstance(made, OutOfMemory):
                self.lane.fail(made)  # a CUDA failure: fatal, as in any other lane work
            return
        self._give_back([made])

    def _give_back(self, helds: list[Held]) -> None:
        gone = [g for held in helds for g in self.stock.put(held)]
        if gone:
            self.lane.post(_release_all, self.backend, gone)

    def drop_stock(self) -> bool:
        """Release every spare (the device is full); True if there were any."""
        gone = self.stock.drain()
        if gone:
            self.lane.post(_release_all, self.backend, gone)
        return bool(gone)

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

    def export_lent(self, allocation_id: str) -> int:
        """One fd lent to a reply, as :meth:`export_many` lends them."""
        with lending(self.fds, 1):
            return self.export(allocation_id)

    def export_many(self, allocation_ids: Iterable[str]) -> list[int]:
        """Fds lent to a reply: the session gives them back to the budget once sent."""
        allocation_ids = list(allocation_ids)
        fds: list[int] = []
        with lending(self.fds, len(allocation_ids)):
            try:
                fds.extend(map(self.export, allocation_ids))
            except BaseException:
                for fd in fds:
                    os.close(fd)
                raise
        return fds

    def release(self, allocation_ids: list[str]) -> None:
        """Forget them here at once; free them here too if that is quick, else
        the lane does, after what it has queued."""
        if self._lost:
            allocation_ids = [i for i in allocation_ids if not self._was_lost(i)]
        if not allocation_ids:
            return
        table, gone, size = self._held, [], 0
        for allocation_id in allocation_ids:
            held = table.pop(allocation_id)
            gone.append(held)
            size += held.size
        if self.observer is not None:
            self.observer.released(self.lane.name, allocation_ids)
        self._bytes -= size
        self.released += len(gone)
        if len(gone) <= _ON_LOOP_MAX and size <= self.backend.loop_bytes:
            _release_all(self.backend, gone)
        else:
            self.lane.post(_release_all, self.backend, gone)

    def _was_lost(self, allocation_id: str) -> bool:
        if allocation_id in self._lost:
            self._lost.discard(allocation_id)
            return True
        return False

    def holds(self, allocation_id: str) -> bool:
        return allocation_id in self._held

    def live(self) -> tuple[int, int]:
        """(count, bytes) of memory this tier holds."""
        return len(self._held), self._bytes

    def fd_count(self) -> int:
        """Fds the table holds (one per allocation; the stock's few spares aside:
        they are outside every budget, as their memory is)."""
        return len(self._held)

    async def device_info(self) -> DeviceInfo:
        return await self.lane.call(self.backend.device_info)

    async def watch(self) -> None:
        await self.lane.watch()

    def stop(self) -> None:
        """Stop the lane, releasing nothing (another server holds it all now)."""
        self.lane.stop()

    async def close(self) -> None:
        """Release everything, wait for the lane to finish, stop it."""
        self.release(list(self._held))
        self.drop_stock()
        await self.lane.call(self.backend.close)
        self.lane.stop()
