"""The host tier's memory: host copies made of chunks, and a pool of chunks made ahead of need.

A host copy is one or more *chunks* of server-owned host memory (pinned, on
CUDA: ``cuMemCreate`` on the GPU's host NUMA node), each made on the host
tier's lane and, where the server has a copier, kept mapped by the copier
for its whole life (``gms.server.tiers.copier_link``).  Two kinds:

* one chunk of exactly the allocation's size, made when asked for (a writer
  filling its own host copies, today's protocol: ``ExportHostCopiesRequest``);
* chunks of ``chunk_bytes`` (64 MiB by default) taken from the **pool**, plus
  one exact chunk for the rest, when the copier fills a publish's host copies.
  A VMM allocation cannot be split or mapped at an offset, so memory made
  ahead of need, not knowing the sizes it will hold, comes in equal chunks.

Pinning costs about 0.24 s per GiB on the H100 host (13 times the D2H copy
it prepares); the pool pays it on the lane while nothing waits, up to
``pool_bytes`` whenever it falls short, or (``sizing``: ``--host-pool auto``,
the default) up to what the builds under way may publish
(``gms.server.tiers.pool_sizing``), giving back what they no longer need.
Its bytes count against the host
budget (they are pinned memory the server holds) but are no host copy: the
event log, which says what exists, does not know them, and the status probe
shows them apart (``host_pool_bytes``).  The server keeps the physical total
(host copies + pool + chunks in flight) within the budget by giving pool
chunks back before making others.  A chunk is never reused once released: a
client that was given its fd (a restorer without a copier) could still map it.

The table of chunks is a :class:`~gms.server.tiers.memory.Memory` keyed by chunk id
(on the loop; its backend on the lane); which chunk is in which phase (pinned for
the pool, pooled, reserved for work in flight, part of a copy) and every byte
count is the book's (:class:`~gms.server.tiers.chunk_book.ChunkBook`, sans I/O);
this class is the shell that makes, maps and drops what the book says.

Restarts and take-overs (``gms.server.restart.mirror``, ``gms.server.restart.resume``): the
chunks of every host copy are state's memory, so the keeper is told of each
as the copy is made (before the event that records it) and let go, and a
take-over hands them on.  Each goes under a name that says what it is to
its copy (``chunk_book.chunk_name``): the allocation's id for a copy of one chunk,
``<id>/<offset>/<size>`` for each of several (the log knows only a copy's
total), so a new server can put a copy back together, in order, whatever
chunk size it runs with.  The pool and the chunks reserved for a transfer in
flight are no state (no event names them): they are not kept, and die with
the server; the new one makes its own pool.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator

import trio

from ...cuda import OutOfMemory, align_up
from ...fsm import HostBudgetExceeded, StateViolation
from ..edge.admission import FdBudget
from .chunk_book import ChunkBook, Phase
from .copier_link import CopierLink
from .memory import Memory
from .pool_sizing import POLL_S, PoolSizing
from .table import Kept

log = logging.getLogger("gms.server.host")
DEFAULT_CHUNK_BYTES = 64 << 20


class HostMemory:
    def __init__(
        self,
        chunks: Memory,
        *,
        link: CopierLink | None = None,
        pool_bytes: int = 0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        observer=None,
        fds: FdBudget | None = None,
        room: Callable[[], int | None] = lambda: None,
        sizing: PoolSizing | None = None,
    ) -> None:
        """``pool_bytes``: the pool's size, fixed (0: none); ``sizing``: sized by
        the builds under way instead (pool_bytes is then ignored)."""
        self.chunks = chunks
        self.backend = chunks.backend
        self.lane = chunks.lane
        self.name = chunks.name
        self.granularity = chunks.granularity
        self.link = link
        self.chunk_bytes = align_up(max(chunk_bytes, 1), self.granularity)
        self.book = ChunkBook(self.chunk_bytes)
        # Without a copier, pool chunks would only wait: nothing fills them.
        self.sizing = sizing if link is not None else None
        self._fixed = pool_bytes - pool_bytes % self.chunk_bytes if link is not None and sizing is None else 0
        # Room the host budget leaves beyond the recorded host copies (None:
        # unbounded): asked of the state, which the service owns (fsm.host_room).
        self.room = room
        self._wanted = 0  # bytes a request waits to have room for: the pool yields to it
        self._ids = itertools.count(1)
        self._wake = trio.Event()
        self._pinned = trio.Event()  # set each time the pool's chunk in the making is done
        self._copying = 0  # transfers under way: the pool waits for none (below)
        self._quiet = trio.Event()
        self._pool_warned = False
        # Told of every host copy's chunks as the copy is made or let go (the
        # keeper link, where there is one): ``held("host", [(name, fd)])``,
        # ``released("host", [name])``.  The pool's chunks are not told.
        self.observer = observer
        self.fds = fds  # the server's (gms.server.edge.admission): each chunk holds an fd
        # Asked for room the budget lacks before a request is refused (the disk
        # tier's spill, gms.server.service.snapshots): bytes -> whether it freed any.
        self._spill: Callable[[int], bool] | None = None

    # -- what the table holds -------------------------------------------------------

    def holds(self, allocation_id: str) -> bool:
        return self.book.holds(allocation_id)

    def live(self) -> tuple[int, int]:
        """(count, bytes) of host copies (the pool apart)."""
        return self.book.copies()

    def fd_count(self) -> int:
        """Fds held: one per chunk made (of the copies, the pool and work in flight)."""
        return self.book.made_count()

    def held_fds(self) -> list[tuple[str, int]]:
        """(name, fd) of every host copy's chunks: what the keeper keeps and a
        take-over hands on (the fds stay open here)."""
        return [
            (name, self.chunks.fd_of(chunk))
            for allocation_id in self.book.copy_ids()
            for name, chunk in self.book.named_chunks(allocation_id)
        ]

    @property
    def pool_bytes(self) -> int:
        return self.book.bytes_in(Phase.POOLED)

    @property
    def keeps_pool(self) -> bool:
        return bool(self._fixed) or self.sizing is not None

    def pool_target(self) -> int:
        """What the pool should hold now, in whole chunks."""
        return self._fixed if self.sizing is None else self.sizing.target(self.chunk_bytes)

    def chunks_of(self, allocation_id: str) -> list[tuple[str, int]]:
        """(chunk id, size) of an allocation's host copy, in order."""
        return self.book.chunks_of(allocation_id)

    def _fits(self, more: int) -> bool:
        return self.book.fits(more, self.room())

    # -- making chunks -------------------------------------------------------------

    def chunk_id(self, allocation_id: str) -> str:
        """A new id for a chunk of an allocation's copy, never used before (the copier
        may still be unmapping a discarded chunk of the same allocation)."""
        return f"{allocation_id}.{next(self._ids)}"

    def spill_to(self, spill: Callable[[int], bool]) -> None:
        """Where room the host budget lacks is asked for before a request is refused:
        the disk tier, made after this table (the assembly, ``gms.server.assembly``)."""
        self._spill = spill

    def spill_for(self, more: int) -> None:
        """Before host copies of ``more`` bytes are decided: spill saved layouts
        for what the recorded copies leave short (the rules count those alone)."""
        room = self.room()
        if self._spill is not None and room is not None and more > room:
            self._spill(more - room)

    async def _make_room(self, more: int) -> None:
        """Give pool chunks back until ``more`` bytes fit the host budget (a chunk the
        pool is pinning now is waited for, then given back); else refuse."""
        while True:
            while not self._fits(more) and self.book.pooled:
                self._drop([self.book.pop_pool()])
            if self._fits(more):
                return
            if self._spill is not None and self._spill(self.book.in_flight + more - (self.room() or 0)):
                continue  # host copies recorded gone: the room is the state's
            if not self.book.bytes_in(Phase.MAKING):
                raise HostBudgetExceeded(
                    f"host tier full: no room for {more} more bytes under the host budget "
                    f"({self.book.in_flight} bytes in flight beyond the host copies)"
                )
            self._wanted += more  # the pool makes no more chunks meanwhile
            try:
                await self._pinned.wait()
            finally:
                self._wanted -= more

    async def make(self, chunks: list[tuple[str, int]]) -> list[str]:
        """New chunks (id, size) on the lane, all or none, mapped by the copier,
        reserved for the caller, who keeps (``keep_copy``) or ``discard``s them.  Ids
        name the allocation they are for (memfd names show them): never reused."""
        if not chunks:
            return []
        ids = [chunk for chunk, _ in chunks]
        if self.fds is not None:
            self.fds.check_memory(len(chunks))  # each chunk holds an fd: refused at once past the bound
        await self._make_room(sum(size for _, size in chunks))
        self.book.new(chunks)  # counted against the budget while made
        try:
            await self.chunks.create(list(chunks))
        except BaseException:
            self.book.not_created(ids)
            raise
        self.book.created(ids)
        self._to_copier(ids)
        return ids

    def take_pool(self, count: int) -> list[str]:
        """Up to ``count`` pool chunks, reserved for the caller (no wait: made already)."""
        taken = self.book.take_pool(count)
        self._wake.set()
        return taken

    def keep_copy(self, allocation_id: str, chunk_ids: list[str]) -> None:
        """Reserved chunks become the allocation's host copy (just before it is recorded)."""
        self.book.keep_copy(allocation_id, chunk_ids)
        if self.observer is not None:  # before the event that records the copy (the caller's)
            named = self.book.named_chunks(allocation_id)
            self.observer.held(self.lane.name, [(name, self.chunks.fd_of(chunk)) for name, chunk in named])

    def discard(self, chunk_ids: Iterable[str]) -> None:
        """Reserved chunks nobody will use: released (never back to the pool: see above)."""
        self._drop(self.book.discard(chunk_ids))

    async def create(self, items: list[tuple[str, int]]) -> None:
        """One exact chunk per (allocation id, size): a writer's own host copies.
        Raises OutOfMemory (the host is full) or HostBudgetExceeded."""
        await self.make(items)  # the chunk of an exact copy is named after its allocation
        for allocation_id, _ in items:
            self.keep_copy(allocation_id, [allocation_id])

    def release(self, allocation_ids: Iterable[str]) -> None:
        """The host copies went (the ledger recorded it): release their chunks."""
        gone, names = self.book.release(allocation_ids)
        self._drop(gone)
        if names and self.observer is not None:  # after the event that released them (the ledger's)
            self.observer.released(self.lane.name, names)

    def _drop(self, chunk_ids: list[str]) -> None:
        """Chunks the book let go: their memory released, the copier's mapping too."""
        if not chunk_ids:
            return
        self.chunks.release(chunk_ids)
        if self.link is not None:
            self.link.unmap(chunk_ids)
        self._wake.set()  # room for the pool, maybe

    def _to_copier(self, chunk_ids: list[str]) -> None:
        if self.link is not None:
            fds = self.chunks.export_many(chunk_ids)
            self.link.map([(chunk, fd, self.book.size(chunk)) for chunk, fd in zip(chunk_ids, fds)])

    def live_chunks(self) -> list[tuple[str, int, int]]:
        """Every chunk held, for a copier that starts: (id, a new fd, size)."""
        ids = self.book.made()
        return list(zip(ids, self.chunks.export_many(ids), [self.book.size(c) for c in ids]))

    # -- exports (clients) ------------------------------------------------------------

    def _lend(self, count: int) -> None:
        """Fds dup'ed for a reply count against the budget until it is sent (the
        session gives them back): as the GPU tier's exports do."""
        if self.fds is not None:
            self.fds.lend(count)

    def export_many(self, allocation_ids: Iterable[str]) -> list[int]:
        """One fd per host copy: only for copies of one chunk (today's protocol)."""
        chunks = []
        for allocation_id in allocation_ids:
            held = self.book.chunks_of(allocation_id)
            if len(held) != 1:
                raise StateViolation(
                    f"the host copy of {allocation_id!r} is held in {len(held)} chunks: "
                    "ask ExportHostChunksRequest for them"
                )
            chunks.append(held[0][0])
        return self._export_lent(chunks)

    def export_chunks(self, chunk_ids: list[str]) -> list[int]:
        return self._export_lent(chunk_ids)

    def _export_lent(self, chunk_ids: list[str]) -> list[int]:
        self._lend(len(chunk_ids))
        try:
            return self.chunks.export_many(chunk_ids)
        except BaseException:
            if self.fds is not None:
                self.fds.returned(len(chunk_ids))
            raise

    # -- a node taken over (gms.server.restart.resume) -------------------------------------------

    async def adopt(self, kept: list[Kept]) -> list[tuple[str, str]]:
        """Host copies another server made, each in the chunks ``chunk_book.chunk_name``
        names: every chunk checked on the lane and held from now on, the copier
        told of each (now, or when it starts).  A copy whose chunks do not make it
        up, or one of whose chunks is no longer its memory, is lost whole (its fds
        closed, its other chunks released); returns (allocation id, why) for each."""
        lost: list[tuple[str, str]] = []
        wanted: list[Kept] = []  # one per chunk, named by its chunk id
        copies: dict[str, list[str]] = {}
        owner: dict[str, str] = {}
        for one in kept:
            allocation_id, total = one.allocation_id, align_up(one.size, self.granularity)
            parts = sorted((0, total, fd) if offset is None else (offset, size, fd) for offset, size, fd in one.parts)
            offsets = [offset for offset, _, _ in parts]
            ends = [offset + size for offset, size, _ in parts]
            if offsets[:1] != [0] or offsets[1:] != ends[:-1] or ends[-1] != total:
                for _, _, fd in parts:
                    os.close(fd)
                lost.append((allocation_id, f"its host copy's chunks do not make up its {total} bytes"))
                continue
            ids = copies[allocation_id] = []
            for _, size, fd in parts:
                chunk = self.chunk_id(allocation_id)
                wanted.append(Kept(chunk, size, ((0, size, fd),)))
                owner[chunk] = allocation_id
                ids.append(chunk)
        failed = dict(await self.chunks.adopt(wanted)) if wanted else {}
        sizes = {one.allocation_id: one.size for one in wanted}
        why_lost = {}
        for chunk, why in failed.items():
            why_lost.setdefault(owner[chunk], why)
        adopted: list[str] = []
        for allocation_id, ids in copies.items():
            if allocation_id in why_lost:
                self.chunks.release([chunk for chunk in ids if chunk not in failed])
                lost.append((allocation_id, why_lost[allocation_id]))
                continue
            self.book.adopt_copy(allocation_id, [(chunk, sizes[chunk]) for chunk in ids])
            adopted += ids
        self.mark_lost(allocation_id for allocation_id, _ in lost)
        self._to_copier(adopted)
        return lost

    def mark_lost(self, allocation_ids: Iterable[str]) -> None:
        """Copies that did not come over: their release finds nothing to release."""
        self.book.mark_lost(allocation_ids)

    # -- the pool -----------------------------------------------------------------------

    @contextlib.contextmanager
    def copying(self) -> Iterator[None]:
        """A transfer through the copier runs: the pool pins nothing new meanwhile.
        Pinning and the copier mapping the new chunk would run beside the copy
        (a host mapping's set-access beside a copy slows it to 0.8 of the
        floor, bench/restore_copy_probe.py); the pool refills between transfers."""
        self._copying += 1
        try:
            yield
        finally:
            self._copying -= 1
            if not self._copying:
                self._quiet.set()
                self._quiet = trio.Event()

    async def keep_pool(self) -> None:
        """Refill the pool whenever it falls short, and (sized by the builds) give
        back what it holds beyond its target (a task in the server's nursery)."""
        if not self.keeps_pool:
            return
        self._wake.set()
        while True:
            with trio.move_on_after(POLL_S if self.sizing is not None else math.inf):
                await self._wake.wait()
            self._wake = trio.Event()
            while self._copying:  # a publish may be taking chunks: decided once it is done
                await self._quiet.wait()
            while self.book.pooled and self.pool_bytes > self.pool_target():
                self._drop([self.book.pop_pool()])
            book = self.book
            while book.pooled * self.chunk_bytes + book.bytes_in(Phase.MAKING) < self.pool_target() and \
                    self._fits(self.chunk_bytes + self._wanted):
                if self._copying:
                    await self._quiet.wait()
                    continue  # decided again: the world changed meanwhile
                chunk = f"pool-{next(self._ids)}"
                book.making(chunk)
                try:
                    await self.chunks.create([(chunk, self.chunk_bytes)])
                except BaseException as exc:
                    book.not_made(chunk)
                    if not isinstance(exc, OutOfMemory):
                        raise
                    if not self._pool_warned:
                        log.warning("host pool: the host has no more memory to pin (%s); trying again later", exc)
                        self._pool_warned = True
                    break
                finally:
                    self._pinned.set()
                    self._pinned = trio.Event()
                book.pooled_in(chunk)
                self._to_copier([chunk])

    # -- the rest of a tier's surface --------------------------------------------------

    async def device_info(self):
        return await self.chunks.device_info()

    async def watch(self) -> None:
        await self.chunks.watch()

    def stop(self) -> None:
        self.chunks.stop()

    async def close(self) -> None:
        await self.chunks.close()
