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

Pinning costs about 0.24 s per GiB on the H100 host; the pool
(``gms.server.tiers.host_pool``) pays it ahead of need.  The server keeps the
physical total (host copies + pool + chunks in flight) within the host budget
by giving pool chunks back before making others.  A chunk is never reused once
released: a client that was given its fd (a restorer without a copier) could
still map it.

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

import itertools
import os
from collections.abc import Callable, Iterable

from ...cuda import align_up
from ...fsm import StateViolation
from ..edge.admission import FdBudget, lending
from .chunk_book import ChunkBook, copy_parts
from .copier_link import CopierLink
from .host_pool import HostPool
from .memory import Memory
from .pool_sizing import PoolSizing
from .table import Kept

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
        self.pool = HostPool(self, fixed_bytes=pool_bytes - pool_bytes % self.chunk_bytes if link is not None else 0,
                             sizing=sizing if link is not None else None)
        # Room the host budget leaves beyond the recorded host copies (None:
        # unbounded): asked of the state, which the service owns (fsm.host_room).
        self.room = room
        self._ids = itertools.count(1)
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

    def chunks_of(self, allocation_id: str) -> list[tuple[str, int]]:
        """(chunk id, size) of an allocation's host copy, in order."""
        return self.book.chunks_of(allocation_id)

    def fits(self, more: int) -> bool:
        return self.book.fits(more, self.room())

    # -- room ---------------------------------------------------------------------

    def spill_to(self, spill: Callable[[int], bool]) -> None:
        """Where room the host budget lacks is asked for before a request is refused:
        the disk tier, made after this table (the assembly, ``gms.server.assembly``)."""
        self._spill = spill

    def spill_for(self, more: int) -> bool:
        """Spill saved layouts for what the room the recorded host copies leave lacks
        of ``more`` bytes (before host copies are decided: the rules count those
        alone; and when the pool finds no room); whether any was freed."""
        room = self.room()
        return self._spill is not None and room is not None and more > room and self._spill(more - room)

    # -- making chunks -------------------------------------------------------------

    def chunk_id(self, allocation_id: str) -> str:
        """A new id for a chunk of an allocation's copy, never used before (the copier
        may still be unmapping a discarded chunk of the same allocation)."""
        return f"{allocation_id}.{next(self._ids)}"

    async def make(self, chunks: list[tuple[str, int]]) -> list[str]:
        """New chunks (id, size) on the lane, all or none, mapped by the copier,
        reserved for the caller, who keeps (``keep_copy``) or ``discard``s them.  Ids
        name the allocation they are for (memfd names show them): never reused."""
        if not chunks:
            return []
        ids = [chunk for chunk, _ in chunks]
        if self.fds is not None:
            self.fds.check_memory(len(chunks))  # each chunk holds an fd: refused at once past the bound
        await self.pool.make_room(sum(size for _, size in chunks))
        self.book.new(chunks)  # counted against the budget while made
        try:
            await self.chunks.create(list(chunks))
        except BaseException:
            self.book.not_created(ids)
            raise
        self.book.created(ids)
        self.to_copier(ids)
        return ids

    def keep_copy(self, allocation_id: str, chunk_ids: list[str]) -> None:
        """Reserved chunks become the allocation's host copy (just before it is recorded)."""
        self.book.keep_copy(allocation_id, chunk_ids)
        if self.observer is not None:  # before the event that records the copy (the caller's)
            named = self.book.named_chunks(allocation_id)
            self.observer.held(self.lane.name, [(name, self.chunks.fd_of(chunk)) for name, chunk in named])

    def discard(self, chunk_ids: Iterable[str]) -> None:
        """Reserved chunks nobody will use: released (never back to the pool: see above)."""
        self.drop(self.book.discard(chunk_ids))

    async def create(self, items: list[tuple[str, int]]) -> None:
        """One exact chunk per (allocation id, size): a writer's own host copies.
        Raises OutOfMemory (the host is full) or HostBudgetExceeded."""
        await self.make(items)  # the chunk of an exact copy is named after its allocation
        for allocation_id, _ in items:
            self.keep_copy(allocation_id, [allocation_id])

    def release(self, allocation_ids: Iterable[str]) -> None:
        """The host copies went (the ledger recorded it): release their chunks."""
        gone, names = self.book.release(allocation_ids)
        self.drop(gone)
        if names and self.observer is not None:  # after the event that released them (the ledger's)
            self.observer.released(self.lane.name, names)

    def drop(self, chunk_ids: list[str]) -> None:
        """Chunks the book let go: their memory released, the copier's mapping too."""
        if not chunk_ids:
            return
        self.chunks.release(chunk_ids)
        if self.link is not None:
            self.link.unmap(chunk_ids)
        self.pool.changed()

    def to_copier(self, chunk_ids: list[str]) -> None:
        if self.link is not None:
            fds = self.chunks.export_many(chunk_ids)
            self.link.map([(chunk, fd, self.book.size(chunk)) for chunk, fd in zip(chunk_ids, fds)])

    def live_chunks(self) -> list[tuple[str, int, int]]:
        """Every chunk held, for a copier that starts: (id, a new fd, size)."""
        ids = self.book.made()
        return list(zip(ids, self.chunks.export_many(ids), [self.book.size(c) for c in ids]))

    # -- exports (clients) ------------------------------------------------------------

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
        return self.export_chunks(chunks)

    def export_chunks(self, chunk_ids: list[str]) -> list[int]:
        """Fds lent to a reply (the session gives them back once sent), as the GPU tier's."""
        with lending(self.fds, len(chunk_ids)):
            return self.chunks.export_many(chunk_ids)

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
            total = align_up(one.size, self.granularity)
            parts = copy_parts(one.parts, total)
            if parts is None:
                for _, _, fd in one.parts:
                    os.close(fd)
                lost.append((one.allocation_id, f"its host copy's chunks do not make up its {total} bytes"))
                continue
            ids = copies[one.allocation_id] = []
            for _, size, fd in parts:
                chunk = self.chunk_id(one.allocation_id)
                wanted.append(Kept(chunk, size, ((0, size, fd),)))
                owner[chunk] = one.allocation_id
                ids.append(chunk)
        failed = dict(await self.chunks.adopt(wanted)) if wanted else {}
        sizes = {one.allocation_id: one.size for one in wanted}
        why_lost: dict[str, str] = {}
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
        self.to_copier(adopted)
        return lost

    def mark_lost(self, allocation_ids: Iterable[str]) -> None:
        """Copies that did not come over: their release finds nothing to release."""
        self.book.mark_lost(allocation_ids)

    # -- the rest of a tier's surface --------------------------------------------------

    async def device_info(self):
        return await self.chunks.device_info()

    async def watch(self) -> None:
        await self.chunks.watch()

    def stop(self) -> None:
        self.chunks.stop()

    async def close(self) -> None:
        await self.chunks.close()
