"""The server's stream to its keeper, sans I/O: what to send, in what order, and what waits for it.

:class:`KeeperStream` is the keeper channel's protocol object (the h11
pattern): the server tells it what happened (memory made or let go, events
stored, a write done, a base due) and it answers what bytes and fds to send
next (:meth:`next_segment`), learns what the kernel took (:meth:`took`), and
says what an answer must wait for (:meth:`behind`, :meth:`target`).  No
socket, no Trio, no clock: ``gms.server.restart.mirror.KeeperLink`` drives it
over the socket, and ``tests/test_keeper_stream.py`` drives it with none.

Its life (:class:`Phase`)::

    UNATTACHED --attach--> ATTACHED --first base sent--> BASED --(a base due, made, sent)--> BASED
         \\__________________________\\______________________\\--gone--> GONE (a new channel: UNATTACHED)

What a frame is for (the channel's words: ``gms.handover.words.Say``):
``HOLD`` memory made (its fds, dup'd: they ride the frame's first byte),
before the event that records it; ``EVENTS`` log entries as stored, before
the memory they released is let go; ``RELEASE`` memory let go; ``PART`` and
``BASE`` a new base; ``CONFIRM``, ``READY``, ``STOPPING``.

Ordering and waiting.  Frames are queued, then *handed on* (to the out
queue, in order) at the end of a write: at once if one of them tells of a
lasting change (``gms.fsm.is_lasting``) or many wait, else a moment later
(``soon``: the shell flushes within ``SOON_S``, so one system call carries
many requests' events).  An answer that tells of a lasting change of a
layout waits until the kernel took the frame with that layout's last such
change (:meth:`target`); a request that added much to a keeper far behind
waits too (:meth:`pressed`).  Nothing else waits on the keeper.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Iterable, Iterator

from ...fsm import is_lasting
from ...handover import frames
from ...handover.image import StateImage, encode_entries, encode_image
from ...handover.journal import KeptBase, PartWriter
from ...handover.words import Leaving, Say
from ...store import LogEntry
from .frame_queue import FrameQueue

MIN_TAIL_BYTES = 4 << 20  # a new base once this many bytes of events were sent since the last one
BACKLOG_BYTES = 8 << 20  # past this, or past ...
TAIL_BOUND_BYTES = 4 * MIN_TAIL_BYTES  # ... this much of events since the keeper's base, a request that added
SMALL_BYTES = 64 << 10  # ... more than this to the keeper's stream waits for the keeper to catch up
_COUNTED_BYTES = 16 << 10  # batches of events counted against their connection (smaller ones never wait)
TRIM_AFTER_BYTES = 64 << 20  # the heap's free pages given back after this many bytes of frames (gms.system.heap)
STEP_BYTES = 1 << 20  # a base's encoding lets others run after about this much


def memory_key(tier: str, allocation_id: str) -> str:
    return f"{tier}:{allocation_id}"


def split_key(key: str) -> tuple[str, str]:
    tier, _, allocation_id = key.partition(":")
    return tier, allocation_id


class Phase(enum.Enum):
    UNATTACHED = "unattached"  # a channel, nothing sent yet (the hand-back, or a keeper found again)
    ATTACHED = "attached"  # serving: frames flow, the first base is on its way
    BASED = "based"  # the keeper has a whole base
    GONE = "gone"  # no channel (a keeper that went away, or none yet)


_GONE = Phase.GONE
_LIVE = (Phase.ATTACHED, Phase.BASED)  # (looked up once: these are asked on every request)


class LinkState(str, enum.Enum):
    """What ``gms status`` says of the keeper (``keeper``)."""

    STARTING = "starting"  # not attached, or its first base on the way: a crash may lose the node
    ATTACHED = "attached"  # a crash loses nothing
    BEHIND = "behind"  # frames wait for the keeper to read (answers to lasting changes wait too)
    GONE = "gone"  # no keeper: a crash loses the node


class KeeperStream:
    def __init__(self, close_fds: Callable[[Iterable[int]], None] | None = None) -> None:
        self._close = close_fds or _close
        self.phase = Phase.GONE
        self.parts = False  # the keeper keeps its base in parts (else whole images)
        self.keeper_keys: set[str] = set()  # what the keeper holds of ours already (its hand-back)
        self.rebase_due = False  # a base is to be made, a little at a time (the shell's task)
        self.frames = FrameQueue(self._close)
        self._writer = PartWriter()
        self._image: Callable[[], StateImage] | None = None
        self._held_keys: Callable[[], list[str]] = list
        self._wants_ack: Callable[[], bool] = lambda: False
        self._tail_bytes = 0  # events since the base being made (or the last one) was taken
        self._tail_before = 0  # while a base is made: the events between the last one and it
        self._added: dict[int, int] = {}  # conn -> bytes its big batches of events added
        self._base_cost = 0  # bytes the last base sent
        self.since_trim = 0  # bytes of frames made since the heap's free pages were last given back
        self._tails_since = 0  # events frames queued since the base being made was taken
        # Where the frames are (queued, handed on, taken): the stream's positions.
        q = self.frames
        self.flush, self.next_segment, self.took, self.target = q.flush, q.next_segment, q.took, q.target
        self.position, self.backlog_bytes = q.position, q.backlog_bytes

    # -- the channel's life ------------------------------------------------------------

    @property
    def open(self) -> bool:
        return self.phase is not _GONE

    @property
    def attached(self) -> bool:
        return self.phase in _LIVE

    @property
    def state(self) -> LinkState:
        if self.phase is Phase.GONE:
            return LinkState.GONE
        if self.phase is not Phase.BASED:
            return LinkState.STARTING
        return LinkState.BEHIND if self.frames.out else LinkState.ATTACHED

    def opened(self, parts: bool = False, keeper_keys: Iterable[str] = ()) -> None:
        """A new channel (a keeper's hand-back read): nothing of ours is attached yet."""
        self.phase, self.parts, self.keeper_keys = Phase.UNATTACHED, parts, set(keeper_keys)

    def attach(
        self,
        image: Callable[[], StateImage],
        held: list[tuple[str, int]],
        held_keys: Callable[[], list[str]],
        wants_ack: Callable[[], bool],
        provisional: int | None = None,
        kept: KeptBase | None = None,
    ) -> None:
        """Serving from now on: queue the fds the keeper lacks of ``held``; the shell
        then sends a whole base, at once (:meth:`base_now`) or a little at a time.
        ``provisional`` (a take-over's, from that pid) rides the first fds: a keeper
        holding any of them knows they are not its node until CONFIRM.  ``kept``:
        the base this keeper holds in parts, that this node was rebuilt from: the
        first base sends what differs from it."""
        self._image, self._held_keys, self._wants_ack = image, held_keys, wants_ack
        self.hold_batch([(key, fd) for key, fd in held if key not in self.keeper_keys], provisional)
        self.phase = Phase.ATTACHED
        self._writer.forget()
        if kept is not None and self.parts:
            self._writer.adopt(kept)

    def gone(self) -> None:
        """The channel is done: drop what waits for it (a later keeper gets a whole base)."""
        self.phase = Phase.GONE
        self.frames.drop()
        self.rebase_due = False
        self.keeper_keys = set()
        self._writer.forget()

    # -- what happens ---------------------------------------------------------------------

    def held(self, tier: str, items: list[tuple[str, int]]) -> None:
        """Memory made: goes with the next frame, before the event that records it."""
        if self.phase in _LIVE:
            self.hold_batch([(memory_key(tier, i), fd) for i, fd in items])

    def released(self, tier: str, allocation_ids: list[str]) -> None:
        """Memory let go (after its event)."""
        if self.phase in _LIVE:
            body = {"keys": [memory_key(tier, i) for i in allocation_ids]}
            if self._wants_ack():
                body["ack"] = True
            self.send(Say.RELEASE, body)

    def logged(self, entries: list[LogEntry]) -> bool:
        """Events stored: handed on at the write's :meth:`flush`, or with an earlier frame.
        A base falls due once the events since the last one outweigh it (True: an
        older keeper's whole image was handed on at once)."""
        if self.phase not in _LIVE:
            return False
        blob = encode_entries(entries)
        lasting = frozenset(entry.event.layout for entry in entries if is_lasting(entry.event))
        # The numbers beside the opaque batch: a keeper keeps it as history by them (gms.keeper.store).
        body = {"entries": blob, "span": [entries[0].seq, entries[-1].seq, len(entries)]} if entries else {"entries": blob}
        self._queue(Say.EVENTS, body, lasting=lasting)
        self._tail_bytes += len(blob)
        self.since_trim += len(blob)
        if len(blob) > _COUNTED_BYTES:
            added = self._added
            if len(added) > 1024:  # connections long gone: their next big request counts afresh
                added.clear()
            conn = entries[0].event.conn
            added[conn] = added.get(conn, 0) + len(blob)
        self._tails_since += 1
        if self.parts:
            self._writer.note(entries)
        if self.rebase_due:
            return False
        if self.parts:
            # What the keeper keeps beyond the state is the events since its base:
            # a few MiB, whatever the state's size (a base sends only what changed).
            self.rebase_due = self._tail_bytes >= MIN_TAIL_BYTES
        elif self._tail_bytes >= max(MIN_TAIL_BYTES, self._base_cost):  # an older keeper: whole images
            self.base_now(None)
            return True
        return False

    def send(self, kind: Say, body: dict | None = None) -> None:
        """Queue a frame and hand on everything queued (``CONFIRM``, ``READY``, ...)."""
        self._queue(kind, body)
        self.flush()

    def stopping(self, why: Leaving) -> None:
        self.send(Say.STOPPING, {"why": why.value})

    # -- what an answer waits for --------------------------------------------------------------

    def added(self, conn: int) -> int:
        """Bytes of events the connection's requests added (big batches only: those
        whose clients may be asked to wait)."""
        return self._added.get(conn, 0)

    def behind(self, layouts: Iterable[str] | None = None, conn: int | None = None, since: int = 0) -> bool:
        """Has the keeper not been given everything yet (``layouts``: every lasting
        change of these layouts, and of the node)?  ``conn``, ``since``: its
        :meth:`added` before the request answered; one that added more than
        SMALL_BYTES also waits while the keeper is far behind (:meth:`pressed`)."""
        if layouts is None:
            return self.frames.waiting
        return self.frames.sent < self.target(layouts) or self.pressed(conn, since)

    def pressed(self, conn: int | None, since: int) -> bool:
        """A request that added much while the keeper is far behind (BACKLOG_BYTES
        not taken, or TAIL_BOUND_BYTES of events since its base): its client waits,
        so what waits here and what the keeper keeps beyond the state stay bounded."""
        if conn is None or self.phase is _GONE or self._added.get(conn, 0) - since <= SMALL_BYTES:
            return False
        return self.backlog_bytes() > BACKLOG_BYTES or self._tail_bytes + self._tail_before > TAIL_BOUND_BYTES

    def rebases_when_quiet(self) -> bool:
        """Whether a quiet spell after events brings a new base: a keeper that keeps it in
        parts (a new base costs what changed; one of whole images would copy the state)."""
        return self.parts and self.phase is Phase.BASED

    @property
    def events_since_base(self) -> int:
        """Events frames queued since the last base was taken."""
        return self._tails_since

    # -- bases -----------------------------------------------------------------------------------

    def base_now(self, keys: list[str] | None, provisional: int | None = None, history: list | None = None) -> None:
        """A whole base at once (when attaching, or for a keeper that keeps images);
        ``history``: batches of the events before it, for a keeper that has none
        (``[first, last, count, blob]``: gms.store.prior)."""
        image = self._image()
        body: dict = {}
        if history:
            body["history"] = history
        if self.parts:
            parts, names = self._writer.parts(image)
            for name, data in parts.items():
                self._queue(Say.PART, {"key": name, "data": data})
            body["parts"] = names
            cost = sum(map(len, parts.values()))
        else:
            blob = encode_image(image)
            body["image"] = blob
            cost = len(blob)
        if keys is not None:
            body["keys"] = keys
        if provisional is not None:
            body["provisional"] = provisional
        self.send(Say.BASE, body)
        self._base_cost, self._tail_bytes, self._tails_since = cost, 0, 0
        self.phase = Phase.BASED

    def rebase(self) -> Iterator[bool]:
        """Make the next base, the parts that changed since the last one: the state
        is immutable, so the image taken first is the base, and the events queued
        meanwhile are its tail.  Yields between steps (True: hand on what is queued
        first); the shell lets others run at each.  Stops early if the channel goes."""
        self.rebase_due = False
        image = self._image()
        self._tails_since, self._tail_before, self._tail_bytes = 0, self._tail_bytes, 0
        cost = since = 0
        steps = self._writer.steps(image)
        try:
            for name, data in steps:
                if not self.open:
                    self._writer.forget()
                    return
                if name is None:  # a good place to let others run
                    yield False
                    continue
                self._queue(Say.PART, {"key": name, "data": data})
                cost += len(data)
                since += len(data)
                if since >= STEP_BYTES:
                    since = 0
                    self.flush()
                    yield True
        except BaseException:
            self._writer.forget()
            raise
        if not self.open:
            self._writer.forget()
            return
        self.send(Say.BASE, {"parts": steps.keys, "tails": self._tails_since, "keys": self._held_keys()})
        self._base_cost, self._tail_before, self.phase = cost, 0, Phase.BASED
        self.since_trim += cost

    # -- inside ------------------------------------------------------------------------------------

    def _queue(self, kind: Say, body: dict | None = None, fds: list[int] | None = None,
               lasting: frozenset = frozenset()) -> None:
        if self.phase is not _GONE:
            self.frames.queue(frames.encode_frame(kind, body, len(fds or ())), fds or [], lasting)
        elif fds:
            self._close(fds)

    def hold_batch(self, keyed: list[tuple[str, int]], provisional: int | None = None) -> None:
        """Queue holds for ``keyed`` (an attach that sends a frame at a time calls it
        itself).  The fds are duplicated: the frame may wait here while the memory's
        own fd is closed."""
        for start in range(0, len(keyed), frames.MAX_FDS):  # a frame's fds ride one system call
            batch = keyed[start : start + frames.MAX_FDS]
            body: dict = {"keys": [key for key, _ in batch]}
            if provisional is not None and start == 0:
                body["provisional"] = provisional
            if self.open:
                self._queue(Say.HOLD, body, [os.dup(fd) for _, fd in batch])


def _close(fds: Iterable[int]) -> None:
    for fd in fds:
        os.close(fd)
