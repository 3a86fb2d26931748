r"""The host tier's chunks as data: each in one phase, every byte count derived.

Sans I/O, like ``gms.server.restart.keeper_stream``: no lane, no copier, no Trio.
:class:`~gms.server.tiers.host_memory.HostMemory` asks the book what to do and
tells it what happened; the book says which chunks to make, drop or hand on.
A chunk goes

    MAKING --pooled_in--> POOLED --take_pool--> RESERVED --keep_copy--> COPY --release--> (gone)
    (the pool pins it)                            ^     \--discard--> (gone)       (the ledger)
    NEW --created---------------------------------/
    (made for a copy or a publish; not_created: gone)

and never back: a chunk released is never reused (a client given its fd could
still map it).  The pool's and the reserved bytes count against the host budget
with the copies the log records (``in_flight``); the copies are state's memory,
the rest dies with the server.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import attrs


class Phase(enum.Enum):
    MAKING = "making"  # being pinned on the lane for the pool
    NEW = "new"  # being made on the lane for work in flight (no fd yet)
    POOLED = "pooled"  # made ahead of need, in the pool
    RESERVED = "reserved"  # made or taken for work in flight: a publish's copies, a writer's own
    COPY = "copy"  # a chunk of an allocation's host copy (the log knows the copy)


class ChunkError(Exception):
    """A chunk asked to move where its phase does not allow: a bug in the shell."""


def chunk_name(allocation_id: str, offset: int, size: int, whole: bool) -> str:
    """What a host copy's chunk is called outside this table (the keeper's key,
    a take-over's): the allocation's id for a copy in one chunk (as host copies
    always were), ``<id>/<offset>/<size>`` for one of several."""
    return allocation_id if whole else f"{allocation_id}/{offset}/{size}"


def parse_chunk_name(name: str) -> tuple[str, int | None, int | None]:
    """(allocation id, offset, size) of a :func:`chunk_name`; (id, None, None) for a
    whole copy.  Raises ValueError for a name that is neither."""
    allocation_id, _, rest = name.partition("/")
    if not rest:
        return allocation_id, None, None
    offset, size = rest.split("/")
    return allocation_id, int(offset), int(size)


def copy_parts(parts, total: int) -> list[tuple[int, int, int]] | None:
    """A kept host copy's (offset, size, fd) parts in order (offset None: the
    whole copy), or None where they do not make up its ``total`` bytes."""
    ordered = sorted((0, total, fd) if offset is None else (offset, size, fd) for offset, size, fd in parts)
    ends = [offset + size for offset, size, _ in ordered]
    offsets = [offset for offset, _, _ in ordered]
    return ordered if offsets[:1] == [0] and offsets[1:] == ends[:-1] and ends[-1] == total else None


@attrs.define
class ChunkBook:
    chunk_bytes: int
    _phase: dict[str, Phase] = attrs.field(factory=dict)
    _size: dict[str, int] = attrs.field(factory=dict)
    _pool: list[str] = attrs.field(factory=list)  # POOLED, oldest first
    _copies: dict[str, tuple[str, ...]] = attrs.field(factory=dict)  # allocation id -> its chunks, in order
    _bytes: dict[Phase, int] = attrs.field(factory=lambda: dict.fromkeys(Phase, 0))
    _count: dict[Phase, int] = attrs.field(factory=lambda: dict.fromkeys(Phase, 0))
    _lost: set[str] = attrs.field(factory=set)  # copies a resumed server found lost: nothing to release

    # -- what it holds ---------------------------------------------------------------

    def phase(self, chunk: str) -> Phase | None:
        return self._phase.get(chunk)

    def bytes_in(self, phase: Phase) -> int:
        return self._bytes[phase]

    @property
    def in_flight(self) -> int:
        """Bytes held beyond the recorded copies: the pool, work in flight, chunks being made."""
        return sum(self._bytes[p] for p in (Phase.POOLED, Phase.RESERVED, Phase.NEW, Phase.MAKING))

    @property
    def pooled(self) -> int:
        return len(self._pool)

    def fits(self, more: int, room: int | None) -> bool:
        """Whether ``more`` bytes fit what the host budget leaves (None: unbounded)."""
        return room is None or self.in_flight + more <= room

    def holds(self, allocation_id: str) -> bool:
        return allocation_id in self._copies

    def copies(self) -> tuple[int, int]:
        """(count, bytes) of host copies (the pool apart)."""
        return len(self._copies), self._bytes[Phase.COPY]

    def made_count(self) -> int:
        """How many chunks hold memory (an fd each), in O(1): the fd budget asks per request."""
        return len(self._phase) - self._count[Phase.MAKING] - self._count[Phase.NEW]

    def made(self) -> list[str]:
        """Every chunk that holds memory (an fd): all but those being made."""
        return [chunk for chunk, phase in self._phase.items() if phase is not Phase.MAKING and phase is not Phase.NEW]

    def size(self, chunk: str) -> int:
        return self._size[chunk]

    def chunks_of(self, allocation_id: str) -> list[tuple[str, int]]:
        """(chunk id, size) of an allocation's host copy, in order."""
        return [(chunk, self._size[chunk]) for chunk in self._copies[allocation_id]]

    def named_chunks(self, allocation_id: str) -> list[tuple[str, str]]:
        """(name, chunk id) of each chunk of an allocation's host copy (see chunk_name)."""
        chunks = self._copies[allocation_id]
        whole = len(chunks) == 1
        named, offset = [], 0
        for chunk in chunks:
            size = self._size[chunk]
            named.append((chunk_name(allocation_id, offset, size, whole), chunk))
            offset += size
        return named

    def copy_ids(self) -> list[str]:
        return list(self._copies)

    # -- moves ----------------------------------------------------------------------

    def _enter(self, chunk: str, phase: Phase, size: int | None = None) -> None:
        if size is not None:
            if chunk in self._phase:
                raise ChunkError(f"chunk {chunk!r} exists already ({self._phase[chunk].value})")
            self._size[chunk] = size
        else:
            self._bytes[self._phase[chunk]] -= self._size[chunk]
            self._count[self._phase[chunk]] -= 1
        self._phase[chunk] = phase
        self._bytes[phase] += self._size[chunk]
        self._count[phase] += 1

    def _leave(self, chunk: str, *allowed: Phase) -> int:
        phase = self._phase.get(chunk)
        if phase not in allowed:
            raise ChunkError(f"chunk {chunk!r} is {phase and phase.value}, not {'/'.join(p.value for p in allowed)}")
        del self._phase[chunk]
        size = self._size.pop(chunk)
        self._bytes[phase] -= size
        self._count[phase] -= 1
        return size

    def _expect(self, chunk: str, phase: Phase) -> None:
        if self._phase.get(chunk) is not phase:
            found = self._phase.get(chunk)
            raise ChunkError(f"chunk {chunk!r} is {found and found.value}, not {phase.value}")

    def new(self, chunks: Iterable[tuple[str, int]]) -> None:
        """Chunks to make for work in flight, counted from before they are made."""
        for chunk, size in chunks:
            self._enter(chunk, Phase.NEW, size)

    def created(self, chunk_ids: Iterable[str]) -> None:
        """Made: reserved for the work that asked."""
        for chunk in chunk_ids:
            self._expect(chunk, Phase.NEW)
            self._enter(chunk, Phase.RESERVED)

    def not_created(self, chunk_ids: Iterable[str]) -> None:
        for chunk in chunk_ids:
            self._leave(chunk, Phase.NEW)

    def discard(self, chunk_ids: Iterable[str]) -> list[str]:
        """Reserved chunks nobody will use: forgotten; those to drop (never back to the pool)."""
        gone = [chunk for chunk in chunk_ids if self._phase.get(chunk) is Phase.RESERVED]
        for chunk in gone:
            self._leave(chunk, Phase.RESERVED)
        return gone

    def making(self, chunk: str) -> None:
        """The pool starts pinning a chunk."""
        self._enter(chunk, Phase.MAKING, self.chunk_bytes)

    def pooled_in(self, chunk: str) -> None:
        """The chunk being pinned is made: into the pool."""
        self._expect(chunk, Phase.MAKING)
        self._enter(chunk, Phase.POOLED)
        self._pool.append(chunk)

    def not_made(self, chunk: str) -> None:
        self._leave(chunk, Phase.MAKING)

    def take_pool(self, count: int) -> list[str]:
        """Up to ``count`` pool chunks, oldest first, reserved for the caller."""
        taken, self._pool[:count] = self._pool[:count], []
        for chunk in taken:
            self._enter(chunk, Phase.RESERVED)
        return taken

    def pop_pool(self) -> str | None:
        """The newest pool chunk, given back (its memory is the caller's to drop)."""
        if not self._pool:
            return None
        chunk = self._pool.pop()
        self._leave(chunk, Phase.POOLED)
        return chunk

    def keep_copy(self, allocation_id: str, chunk_ids: list[str]) -> None:
        """Reserved chunks become the allocation's host copy (just before it is recorded)."""
        if allocation_id in self._copies:
            raise ChunkError(f"{allocation_id!r} has a host copy already")
        for chunk in chunk_ids:
            self._expect(chunk, Phase.RESERVED)
        for chunk in chunk_ids:
            self._enter(chunk, Phase.COPY)
        self._copies[allocation_id] = tuple(chunk_ids)

    def adopt_copy(self, allocation_id: str, chunks: list[tuple[str, int]]) -> None:
        """Chunks another server made, held from now on as the allocation's copy."""
        self.new(chunks)
        self.created(chunk for chunk, _ in chunks)
        self.keep_copy(allocation_id, [chunk for chunk, _ in chunks])

    def release(self, allocation_ids: Iterable[str]) -> tuple[list[str], list[str]]:
        """The host copies went (the ledger recorded it): (their chunks to drop, the
        names the keeper knew them by).  One never held here (lost) is forgotten."""
        gone: list[str] = []
        names: list[str] = []
        for allocation_id in allocation_ids:
            if allocation_id in self._lost:
                self._lost.discard(allocation_id)
                continue
            names += [name for name, _ in self.named_chunks(allocation_id)]
            for chunk in self._copies.pop(allocation_id):
                self._leave(chunk, Phase.COPY)
                gone.append(chunk)
        return gone, names

    def mark_lost(self, allocation_ids: Iterable[str]) -> None:
        """Copies that did not come over: their release finds nothing to release."""
        self._lost.update(allocation_ids)

    def check(self) -> None:
        """Every count is what the chunks add up to (the tests' and the model's question)."""
        sums = dict.fromkeys(Phase, 0)
        for chunk, phase in self._phase.items():
            sums[phase] += self._size[chunk]
        counts = {phase: sum(1 for p in self._phase.values() if p is phase) for phase in Phase}
        if sums != self._bytes or counts != self._count or set(self._size) != set(self._phase):
            raise ChunkError(f"the book's counts {self._bytes} are not its chunks' {sums}")
        if [c for c in self._pool if self._phase.get(c) is not Phase.POOLED] or \
                len(self._pool) != sum(1 for p in self._phase.values() if p is Phase.POOLED):
            raise ChunkError("the pool's order is not its pooled chunks")
        in_copies = [chunk for chunks in self._copies.values() for chunk in chunks]
        if sorted(in_copies) != sorted(c for c, p in self._phase.items() if p is Phase.COPY):
            raise ChunkError("the copies' chunks are not the chunks in COPY")
