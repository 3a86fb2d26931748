"""The event log: append-only, in memory, bounded by count and by bytes.

Appending folds first: an event the state refuses raises and is not stored
(a batch is stored all or nothing), so the log never holds an event its
state could not accept.  The two halves are separate steps, :meth:`EventLog.fold`
(what the batch would do, stored nowhere) and :meth:`EventLog.store` (only
while the state it was folded on is still the live one): a caller that must
decide before an ``await`` folds once, and stores that fold after it if
nothing was appended meanwhile.  Entries live in
fixed-size chunks, each remembering the (immutable) state before its first
entry; retention drops whole chunks from the front, and the oldest kept
chunk's start state becomes the snapshot.  No re-fold is needed at the cut,
and ``replay()`` (snapshot + tail) always equals the live state.

The byte bound counts each kept entry (``gms.store.sizes``) and what the
snapshot keeps alive beyond the live state (metadata since dropped); a chunk
closes at ``chunk_size`` entries or a sixteenth of the bound, and the
snapshot's share is recounted when a chunk opens or goes, so the log holds at
most the bound plus one chunk (and the events of one request).

Numbers are never used twice for the node's life.  A live take-over goes on
from the last number; a restart after a crash cannot know how many of the
dead server's last events its keeper never got (at most those of its last
2 ms, none that told of a lasting change: ``gms.server.restart.mirror``), so
it numbers from the next multiple of :data:`RESTART_STRIDE` above the last
event it has (:meth:`EventLog.skip_lost`), and the history has a gap there,
just before its SERVER_RESUMED.  A chunk holds consecutive numbers; a gap
opens a new one.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import attrs

from ..fsm.events import Event, ServerResumed
from ..fsm.node import EMPTY_NODE, NodeState, fold
from .prior import Prior
from .sizes import entry_bytes, pinned_bytes

_MIN_CHUNK_BYTES = 64 << 10
_NEVER = float("inf")
# A restart numbers from the next multiple of this above the last event it has:
# no server appends 2**32 events between two restarts (at 225,000 a second, five
# hours of nothing but appends), so none it lost can have a number that high, and
# numbers stay below 2**53 (a JSON reader's exact integers) for 2**21 restarts.
RESTART_STRIDE = 1 << 32


def after_loss(last_seq: int) -> int:
    """The first number a server restarted after a crash uses (see the module's doc)."""
    return (last_seq // RESTART_STRIDE + 1) * RESTART_STRIDE


def restart_gap(seq: int, event: Event, last_seq: int) -> bool:
    """Is event ``seq`` a restart that follows event ``last_seq`` across its gap?"""
    return type(event) is ServerResumed and event.follows_seq == last_seq and seq == after_loss(last_seq)


def refold(state: NodeState, entries: list[LogEntry], expected: int) -> tuple[list[NodeState], NodeState]:
    """Entries from number ``expected`` on, folded again on ``state``: the state
    before each, and after all.  A gap (but a restart's) or a refusal raises."""
    befores = []
    for entry in entries:
        if entry.seq != expected and not restart_gap(entry.seq, entry.event, expected - 1):
            raise ValueError(f"event {entry.seq} cannot follow event {expected - 1}")
        befores.append(state)
        state = fold(state, entry.event)
        expected = entry.seq + 1
    return befores, state


class LogEntry(NamedTuple):
    """One stored event.  A named tuple, as immutable as a frozen attrs class
    and made at half its cost: one is made for every event."""

    seq: int
    mono_ns: int
    wall_ns: int
    event: Event


class Folded:
    """A batch folded on ``base`` and not stored: ``befores[i]`` is the state
    ``events[i]`` was folded on, ``state`` the state after the last.  (A plain
    slotted class, not attrs: one is made for every append.)"""

    __slots__ = ("base", "events", "befores", "state")

    def __init__(
        self, base: NodeState, events: Sequence[Event], befores: list[NodeState], state: NodeState
    ) -> None:
        self.base = base
        self.events = events
        self.befores = befores
        self.state = state


class StaleFold(RuntimeError):
    """A fold stored after the live state moved on: a bug in its caller."""


@attrs.frozen
class Snapshot:
    """The state after every entry with ``seq <= last_seq`` (0: the empty log)."""

    last_seq: int
    state: NodeState


class _Chunk:
    __slots__ = ("start_seq", "start_state", "entries", "bytes")

    def __init__(self, start_seq: int, start_state: NodeState) -> None:
        self.start_seq = start_seq
        self.start_state = start_state
        self.entries: list[LogEntry] = []
        self.bytes = 0


def _start_seq(chunk: _Chunk) -> int:
    return chunk.start_seq


class EventLog:
    """Sequence numbers start at 1 and have no gaps but where a restart began
    (:meth:`skip_lost`).

    ``retain`` bounds the entries kept (``None``: keep all): once more than
    ``retain`` were appended, between ``retain`` and ``retain + chunk_size``
    entries are kept.  ``max_bytes`` bounds what they hold (``None``: no
    bound; see the module's doc).
    """

    def __init__(
        self, *, retain: int | None = 1_000_000, chunk_size: int = 4096, max_bytes: int | None = None
    ) -> None:
        if retain is not None and retain < 0:
            raise ValueError("retain must be >= 0")
        if chunk_size < 1:
            raise ValueError("chunk_size must be >= 1")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self._retain = retain
        self._chunk_size = chunk_size
        self._max_bytes = max_bytes
        # The live state, every appended event folded: read it, never set it (an
        # attribute, not a property: every request reads it, most of them more than once).
        self.state: NodeState = EMPTY_NODE
        self._chunk_bytes = None if max_bytes is None else max(max_bytes // 16, _MIN_CHUNK_BYTES)
        self._next_seq = 1
        self._chunks: deque[_Chunk] = deque([_Chunk(1, EMPTY_NODE)])
        self._kept = 0
        self._bytes = 0  # of the kept entries
        self._pinned = 0  # by the snapshot, beyond the live state: recounted at chunk boundaries
        self._trim_at = 0  # _trim sets it: the kept count at which an append must trim
        # Events of the node's earlier servers, before the snapshot: shown, never folded (gms.store.prior).
        self._prior: Prior | None = None

    @classmethod
    def resumed(
        cls, snapshot: Snapshot, entries: Iterable[LogEntry] = (), *, retain: int | None = 1_000_000,
        chunk_size: int = 4096, max_bytes: int | None = None, prior: Prior | None = None,
    ) -> EventLog:
        """A log that goes on from another server's: its snapshot is ``snapshot``
        (the state after event ``last_seq``), then ``entries`` (the events after
        it, folded again, keeping their numbers and times: a gap or a refusal
        raises); the next event appended is numbered after the last of them.
        The entries are counted against ``max_bytes`` as appended ones are, and
        the snapshot's share of metadata from the start (a take-over's snapshot
        is the live state: none).  The one gap allowed is just before a
        SERVER_RESUMED (a restart after a crash: :meth:`skip_lost`).  ``prior``:
        the events before the snapshot, as the keeper kept them: in the history,
        within the same bounds (they go first)."""
        log = cls(retain=retain, chunk_size=chunk_size, max_bytes=max_bytes)
        log._prior = prior if prior is not None and prior.batches else None
        log.state = snapshot.state
        log._next_seq = snapshot.last_seq + 1
        log._chunks = deque([_Chunk(log._next_seq, snapshot.state)])
        entries = list(entries)
        befores, log.state = refold(snapshot.state, entries, log._next_seq)
        log._keep(entries, befores)
        if max_bytes is not None:
            log._pinned = pinned_bytes(log._chunks[0].start_state, log.state)
        log._trim()
        return log

    def _keep(self, entries: list[LogEntry], befores: list[NodeState]) -> None:
        """Entries folded already (``befores[i]`` the state before ``entries[i]``),
        kept in chunks: a chunk closes at ``chunk_size`` entries or its share of
        the byte bound, remembering the state before its first entry; a gap
        in the numbers (a restart's) opens one too."""
        chunk = self._chunks[-1]
        for entry, before in zip(entries, befores):
            if entry.seq != chunk.start_seq + len(chunk.entries):
                chunk = _Chunk(entry.seq, before)
                if self._chunks[-1].entries:
                    self._chunks.append(chunk)
                else:  # (nothing kept yet: the first kept number moves with it)
                    self._chunks[-1] = chunk
            elif len(chunk.entries) == self._chunk_size or (
                self._chunk_bytes is not None and chunk.bytes >= self._chunk_bytes
            ):
                chunk = _Chunk(entry.seq, before)
                self._chunks.append(chunk)
            chunk.entries.append(entry)
            if self._max_bytes is not None:
                size = entry_bytes(entry.event)
                chunk.bytes += size
                self._bytes += size
        if entries:
            self._next_seq = entries[-1].seq + 1
            self._kept += len(entries)

    # -- writing -----------------------------------------------------------

    def skip_lost(self) -> None:
        """A server restarted after a crash, before it appends anything: number
        its events past any the dead server may have used (:func:`after_loss`;
        the next entry opens a chunk at the gap)."""
        self._next_seq = after_loss(self.last_seq)

    def append(self, event: Event) -> LogEntry:
        """Fold, then store; a refused event (the fold raises) is not stored."""
        (entry,) = self.extend((event,))
        return entry

    def extend(self, events: Iterable[Event]) -> list[LogEntry]:
        """Append all or nothing: each event folds on the state the ones before it
        leave, and if any is refused none is stored (a free and its cascade, a
        batch of metadata puts, land together or not at all)."""
        return self.store(self.fold(events))

    def fold(self, events: Iterable[Event], after: Folded | None = None) -> Folded:
        """What appending ``events`` would do, stored nowhere (a refusal raises):
        each folds on the state the ones before it leave; ``after``: a batch
        folded already, which these go on (one batch, stored whole)."""
        events = events if isinstance(events, list | tuple) else tuple(events)
        if after is None:
            base, state, befores = self.state, self.state, []
        else:
            base, state, befores = after.base, after.state, list(after.befores)
            events = [*after.events, *events]
        for event in events[len(befores):]:
            befores.append(state)
            state = fold(state, event)
        return Folded(base, events, befores, state)

    def store(self, folded: Folded) -> list[LogEntry]:
        """Store a batch folded on the live state (StaleFold if another was stored since)."""
        if folded.base is not self.state:
            raise StaleFold("the batch was folded on a state that is no longer the live one")
        mono_ns, wall_ns = time.monotonic_ns(), time.time_ns()  # one moment for the batch
        chunks = len(self._chunks)
        seq = self._next_seq
        entries = []
        for event in folded.events:
            entries.append(LogEntry(seq, mono_ns, wall_ns, event))
            seq += 1
        self._keep(entries, folded.befores)
        self.state = state = folded.state
        if len(self._chunks) != chunks and self._max_bytes is not None:
            self._pinned = pinned_bytes(self._chunks[0].start_state, state)
        if self._kept >= self._trim_at:
            self._trim()
        return entries

    def _over(self) -> bool:
        prior = self._prior
        # What dropping the oldest (a prior batch while there are any, else a chunk) would leave.
        if prior is not None:
            kept_after, extra = self._kept + prior.count - prior.batches[0].count, prior.bytes
        else:
            kept_after, extra = self._kept - len(self._chunks[0].entries), 0
        if self._retain is not None and kept_after >= self._retain:
            return True
        return self._max_bytes is not None and self._bytes + self._pinned + extra > self._max_bytes

    def _trim(self) -> None:
        chunks = self._chunks
        while self._prior is not None and self._over():
            self._prior.drop_oldest()
            if not self._prior.batches:
                self._prior = None
        while len(chunks) > 1 and self._over():
            chunk = chunks.popleft()
            self._kept -= len(chunk.entries)
            self._bytes -= chunk.bytes
            if self._max_bytes is not None:
                self._pinned = pinned_bytes(chunks[0].start_state, self.state)
        self._trim_at = self._next_trim()

    def _next_trim(self) -> float:
        """The kept count at which an append must trim again: any (0) under a byte
        bound; else once the entries past the oldest chunk reach ``retain`` (its
        length known once another follows it; alone, it closes at ``chunk_size``)."""
        if self._max_bytes is not None or self._prior is not None:
            return 0
        if self._retain is None:
            return _NEVER
        chunks = self._chunks
        return self._retain + (len(chunks[0].entries) if len(chunks) > 1 else self._chunk_size)

    @property
    def bytes(self) -> int:
        """What the kept entries and the snapshot hold, as the byte bound counts it."""
        return self._bytes + self._pinned

    # -- reading -----------------------------------------------------------

    @property
    def snapshot(self) -> Snapshot:
        first = self._chunks[0]
        return Snapshot(first.start_seq - 1, first.start_state)

    @property
    def first_seq(self) -> int:
        """Sequence number of the oldest kept entry (``last_seq + 1`` when empty),
        an earlier server's (``prior``) included."""
        return self._prior.first_seq if self._prior is not None else self._chunks[0].start_seq

    @property
    def last_seq(self) -> int:
        return self._next_seq - 1

    def __len__(self) -> int:
        return self._kept

    def entries(self) -> Iterable[LogEntry]:
        for chunk in self._chunks:
            yield from chunk.entries

    def since(self, since_seq: int = 0, limit: int | None = None) -> list[LogEntry]:
        """Kept entries with ``seq > since_seq``, oldest first, at most ``limit``
        (an earlier server's first: they are older)."""
        start = since_seq + 1
        prior = self._prior
        left = self._kept + (prior.count if prior else 0) if limit is None else max(limit, 0)
        out: list[LogEntry] = []
        if prior is not None and start < self._chunks[0].start_seq:
            out = prior.since(since_seq, left)
            left -= len(out)
        chunks = self._chunks
        index = self._chunk_index(start)
        while left > 0 and index < len(chunks):
            chunk = chunks[index]
            lo = max(0, start - chunk.start_seq)  # (0 past a gap)
            taken = chunk.entries[lo : lo + left]
            out.extend(taken)
            left -= len(taken)
            index += 1
        return out

    def entry(self, seq: int) -> LogEntry | None:
        """The kept entry with sequence number ``seq``, if any (O(log chunks))."""
        if not self.first_seq <= seq <= self.last_seq:
            return None
        if seq < self._chunks[0].start_seq:
            return self._prior.entry(seq) if self._prior is not None else None
        chunk = self._chunks[self._chunk_index(seq)]
        index = seq - chunk.start_seq
        return chunk.entries[index] if index < len(chunk.entries) else None  # (None: in a gap)

    def _chunk_index(self, seq: int) -> int:
        """The chunk holding ``seq`` (chunks close by count or by bytes: their
        sizes differ, so it is searched for: O(log chunks))."""
        return max(0, bisect.bisect_right(self._chunks, seq, key=_start_seq) - 1)

    def replay(self) -> NodeState:
        """Fold the kept entries over the snapshot: always equals :attr:`state`."""
        state = self._chunks[0].start_state
        for entry in self.entries():
            state = fold(state, entry.event)
        return state


def replay(log: EventLog) -> NodeState:
    return log.replay()
