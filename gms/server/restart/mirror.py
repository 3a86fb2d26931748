"""The server's side of its keeper: everything that must outlive the server, sent as it happens.

A server under a keeper (``gms/keeper``) starts by saying hello on the keeper
channel and reading what the keeper hands back (:meth:`KeeperLink.hello`):
the listening socket, and after a crash the last server's state and memory.
Once it serves it *attaches* (:meth:`KeeperLink.attach`): it sends the fds
the keeper lacks and a *base* (the state, with the keys of every fd it
holds; the keeper closes any other).  From then on, in the order they happen
on the event loop:

* ``hold``: memory made (an allocation; a host copy's chunks, named by their
  place in the copy: ``gms.server.tiers.host_memory.chunk_name``), its fd, before
  the event that records it (a server that dies between the two leaves an fd
  no event names: the next server closes it).  Memory that is no state (the
  host pool, chunks of a transfer in flight, the stock's spares) is never sent;
* ``events``: log entries as they are appended (``MirroredLog``), before the
  memory they released is let go;
* ``release``: memory let go, after its event (``ack``: say when it is closed,
  so a session waiting for memory tries again then: the keeper's fd kept it);
* a new base once the events sent since the last one outweigh what it costs:
  the parts of the state that changed (``gms.handover.journal``: ``part``
  frames, then ``base`` naming every part), encoded a little at a time
  between other work, so that neither process ever holds a second copy of
  the state nor stalls the loop for it;
* ``ready`` once serving, ``stopping`` before a deliberate exit.

**Nothing waits on the keeper but what must.**  Frames go out in order,
without blocking: what the keeper's socket does not take now waits here
(:meth:`KeeperLink.flush`) and a task sends it as the keeper reads
(:meth:`KeeperLink.run`).  A frame the kernel took is in the keeper's queue
and outlives this process, so an answer that tells a client of a lasting
change (``gms.fsm.LASTING``: a commit, a writer's grant over a committed
layout, an eviction, a pin; a restart keeps no session, lock or unfinished
build) goes out only once the frame with the last such change of its layout
was taken (:meth:`KeeperLink.durable`, the session awaits it; the stream is
in order, so everything before that frame is there too).  A keeper that
stops reading (stopped, swapped out, busy) holds up only those answers, for
as long as it reads nothing: a reader of another layout, or a writer
building, does not wait behind a neighbour's megabytes; nothing is dropped,
and nothing is answered that a crash could lose or roll back; when it reads
again it catches up.  ``gms status`` and the metrics show a keeper
behind (bytes waiting, for how long).  A keeper that goes away for good (its
channel closed) is gone: the server serves on without one until it has
another (``gms.server.restart.succession``: it reconnects to a keeper in another
container, or starts a new keeper of its own).
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable

import attrs
import trio

from ...fsm import LASTING
from ...handover import frames
from ...handover.image import STATE_VERSION, StateImage, encode_entries, encode_image
from ...handover.journal import PartWriter
from ...heap import give_back_free_memory
from ...peer import peer_of
from ...store import EventLog, LogEntry

# Restarts and take-overs are rare and each line matters: not under "gms.server",
# whose repeated lines are rate-limited (gms.server.edge.ratelimit).
log = logging.getLogger("gms.server.restart")

MIN_TAIL_BYTES = 4 << 20  # a new base once this many bytes of events were sent since the last one
SEND_BUFFER_BYTES = 4 << 20  # asked for; the kernel caps it (net.core.wmem_max)
BEHIND_WARNING_S = 1.0  # a keeper that read nothing for this long is said to be behind, once
DRAIN_S = 5.0  # at a server's end, the longest wait for its keeper to take what is queued
BACKLOG_BYTES = 8 << 20  # past this, or past ...
TAIL_BOUND_BYTES = 4 * MIN_TAIL_BYTES  # ... this much of events since the keeper's base, a request that added
SMALL_BYTES = 64 << 10  # ... more than this to the keeper's stream waits for the keeper to catch up
_COUNTED_BYTES = 16 << 10  # batches of events counted against their connection (smaller ones never wait)
TRIM_AFTER_BYTES = 64 << 20  # the heap's free pages given back after this many bytes of frames (gms.heap)
LISTENER = "listener"
PARTS = "parts"  # the feature a keeper names in its hand-back when it keeps its base in parts
_SEND_FLAGS = int(socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
_STEP_BYTES = 1 << 20  # a base's encoding yields to the loop after about this much
# What tells of no lasting change (a session, a lock, an allocation of a build, a
# metadata put) is handed on this much later, with whatever follows it: the answer
# goes out first, and one system call (one wake-up of the keeper) carries many
# requests' events.  A crash loses at most this much of them, which a restart
# keeps nothing of (no session, lock or unfinished build).  Past _SOON_FRAMES, at once.
SOON_S = 0.002
_SOON_FRAMES = 64


def memory_key(tier: str, allocation_id: str) -> str:
    return f"{tier}:{allocation_id}"


def split_key(key: str) -> tuple[str, str]:
    tier, _, allocation_id = key.partition(":")
    return tier, allocation_id


@attrs.frozen
class Handback:
    """What the keeper handed a new server.

    ``mode``: ``fresh`` (an empty node, on ``listener`` if the keeper holds one,
    else the server binds or takes over), ``resume`` (the last server died:
    ``base`` and ``tails`` are its journal, ``fds`` its memory), ``retired``
    (this keeper's server was taken over by another: serve nothing).
    ``base`` is an image (bytes) or, from a keeper that keeps parts, a dict of them."""

    mode: str
    listener: int | None = None
    base: bytes | dict | None = None
    tails: tuple[bytes, ...] = ()
    fds: dict = attrs.field(factory=dict)  # key -> fd
    old_pid: int = 0
    reason: str = ""
    provisional: int | None = None  # the journal is a take-over's, not committed: the old server's pid
    failed_resumes: int = 0  # servers that died resuming this journal before serving
    features: frozenset = frozenset()


def _keeper_pids(sock: socket.socket, body: dict) -> tuple[int, int]:
    """(keeper, service) pids as the keeper named them, where the kernel bears
    them out: the socket's peer is that keeper (or this process, which made the
    channel for a keeper it started).  A keeper seen from another pid namespace
    (another container) names pids that mean nothing here: (0, 0)."""
    keeper, service = (v if type(v) is int and v > 0 else 0 for v in (body.get("keeper_pid"), body.get("service_pid")))
    try:
        seen = peer_of(sock).pid
    except OSError:
        seen = 0
    return (keeper, service) if seen in (keeper, os.getpid()) and keeper else (0, 0)


class KeeperGone(Exception):
    """The keeper channel broke."""


class _Segment:
    """Bytes queued for the keeper, with the fds (ours: dups) that ride their first byte."""

    __slots__ = ("data", "fds")

    def __init__(self, data: memoryview, fds: list[int]) -> None:
        self.data = data
        self.fds = fds


class KeeperLink:
    """The channel to the keeper (replaced by another when a keeper is found again)."""

    def __init__(self, sock: socket.socket | None = None) -> None:
        self.sock: socket.socket | None = None
        self.alive = False
        self.lost = 0  # keepers lost since the start
        self.keeper_pid = self.service_pid = 0  # as the keeper named them at its hand-back
        self.stood_by = False  # this server was a spare: the node came long after it started
        self._keeper_keys: set[str] = set()
        self._parts: bool = False
        self._writer = PartWriter()
        self._image: Callable[[], StateImage] | None = None
        self._held_keys: Callable[[], list[str]] | None = None
        self._wants_ack: Callable[[], bool] = lambda: False
        self._on_released: Callable[[], None] = lambda: None
        self._attached = False
        self._based = False  # the keeper has a whole base (its first one was sent)
        self._tail_bytes = 0  # events since the base being made (or the last one) was taken
        self._tail_before = 0  # while a base is made: the events between the last one and it
        self._added: dict[int, int] = {}  # conn -> bytes its big batches of events added
        self._base_cost = 0  # bytes the last base sent
        self._since_trim = 0  # bytes of frames made since the heap's free pages were last given back
        self._tails_since = 0  # events frames queued since the base being made was taken
        self._rebasing = False
        self._soon = False  # frames wait for the run task's next hand-on (SOON_S)
        # Frames not handed on yet: (bytes, their fds, the layouts they change lastingly).
        self._queued: list[tuple[bytes, list[int], frozenset[str]]] = []
        # Layout ("": the node) -> where in the stream its last lasting change ends.
        self._marks: dict[str, int] = {}
        self._out: deque[_Segment] = deque()  # frames handed on, not yet taken by the kernel
        self.enqueued = 0  # bytes handed to _out since the start
        self.sent = 0  # of which the kernel took
        self.behind_since: float | None = None  # monotonic: when _out last became non-empty
        self._warned = False
        self._progress: trio.Event | None = None
        self._work: trio.Event | None = None
        self._fd_pressure = False
        if sock is not None:
            self.use(sock)

    def use(self, sock: socket.socket) -> None:
        """Talk to the keeper on ``sock`` from now on (nothing is attached yet)."""
        try:  # room for frames the keeper has not read yet (it reads in batches)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        except OSError:
            pass
        self.sock, self.alive, self._attached = sock, True, False

    @property
    def state(self) -> str:
        """``attached``, ``behind`` (frames wait for the keeper to read), ``gone``
        (no keeper now) or ``starting`` (not attached yet)."""
        if not self.alive:
            return "gone"
        if not self._attached or not self._based:
            return "starting"  # (a keeper found again: its first base on the way)
        return "behind" if self._out else "attached"

    def backlog_bytes(self) -> int:
        """Bytes not yet taken by the keeper's socket."""
        return self.position() - self.sent

    def behind_s(self) -> float:
        return 0.0 if self.behind_since is None else time.monotonic() - self.behind_since

    # -- the start ---------------------------------------------------------------

    def hello(self, device: str, *, timeout: float | None = 60.0) -> Handback:
        """Say who we are (and for which device: a keeper may keep for several);
        read the keeper's hand-back (blocking: before serving, or in a thread)."""
        sock = self.sock
        sock.settimeout(timeout)
        try:
            frames.send_frame(sock, "hello", {"pid": os.getpid(), "device": device, "version": STATE_VERSION})
            reader = frames.FrameReader()
            head = frames.recv_frame(sock, reader)
            if head.kind == "standby":  # a spare: the node comes when the server before it is gone
                log.info("pid %d standing by for the keeper's node (the server serving it is alive)", os.getpid())
                sock.settimeout(None)
                head = frames.recv_frame(sock, reader)
                sock.settimeout(timeout)
                self.stood_by = True
            if head.kind != "handback":
                head.close_fds()
                raise KeeperGone(f"the keeper answered {head.kind!r}, not a hand-back")
            fds: dict[str, int] = {}
            listener = None
            while True:
                frame = frames.recv_frame(sock, reader)
                if frame.kind == "end":
                    break
                if frame.kind != "fds" or len(frame.body.get("keys", ())) != len(frame.fds):
                    frame.close_fds()
                    raise KeeperGone(f"the keeper sent {frame.kind!r} inside a hand-back")
                for key, fd in zip(frame.body["keys"], frame.fds):
                    if key == LISTENER:
                        listener = fd
                    else:
                        fds[key] = fd
            if self.stood_by:  # a spare says it is alive and has the node (else the keeper starts another)
                frames.send_frame(sock, "taking", {})
        except (OSError, frames.FrameError) as exc:
            raise KeeperGone(f"the keeper channel broke during the hand-back: {exc}") from exc
        finally:
            sock.settimeout(None)  # blocking: sends pass MSG_DONTWAIT, reads too
        body = head.body
        features = frozenset(body.get("features", ()))
        self._parts = PARTS in features
        self.keeper_pid, self.service_pid = _keeper_pids(sock, body)
        self._keeper_keys = set(fds) | ({LISTENER} if listener is not None else set())
        return Handback(
            mode=body["mode"], listener=listener, base=body.get("base"), tails=tuple(body.get("tails", ())),
            fds=fds, old_pid=body.get("old_pid", 0), reason=body.get("reason", ""),
            provisional=body.get("provisional"), failed_resumes=body.get("failed_resumes", 0),
            features=features,
        )

    def attach(
        self,
        image: Callable[[], StateImage],
        held: Callable[[], list[tuple[str, int]]],
        *,
        provisional: int | None = None,
        wants_ack: Callable[[], bool] = lambda: False,
        on_released: Callable[[], None] = lambda: None,
        now: bool = True,
    ) -> None:
        """Serving from now on: send what the keeper lacks of ``held()`` ((key, fd)
        of every fd the state needs kept, the listener included), then a whole
        base (the parts of a base sent before are not the new keeper's).
        ``provisional``: the node is a take-over's from that pid, not committed
        yet (:meth:`confirm` once it is): should this server die first, the next
        one asks whether the old one still serves before it resumes anything.
        ``wants_ack()``: someone waits for memory (releases are then acknowledged
        once the keeper closed its fds: ``on_released()``).  ``now``: the base is
        made at once (before serving); else by :meth:`run`, a little at a time
        (a keeper found again while serving: until it has it, a crash loses
        the node, as it would have with none)."""
        self._image = image
        self._held_keys = lambda: [key for key, _ in held()]
        self._wants_ack, self._on_released = wants_ack, on_released
        keyed = held()
        self._queue_holds([(key, fd) for key, fd in keyed if key not in self._keeper_keys])
        self._attached, self._based = True, False
        self._writer.forget()
        if now:
            self._base_now([key for key, _ in keyed], provisional)
        else:
            self.flush()
            self._rebasing = True
            self._wake()

    def confirm(self) -> None:
        """The take-over committed: the node is this server's."""
        self._send("confirm")

    # -- as it happens --------------------------------------------------------------

    def held(self, tier: str, items: list[tuple[str, int]]) -> None:
        """Memory made: sent with the next frame, which comes before the event that
        records it (the ledger's write ends with :meth:`flush`)."""
        if self._attached:
            self._queue_holds([(memory_key(tier, i), fd) for i, fd in items])

    def released(self, tier: str, allocation_ids: list[str]) -> None:
        """Memory let go (after its event): sent now, with what is queued before it."""
        if self._attached:
            body = {"keys": [memory_key(tier, i) for i in allocation_ids]}
            if self._wants_ack():
                body["ack"] = True
            self._send("release", body)

    def logged(self, entries: list[LogEntry]) -> None:
        """Events stored: sent at the ledger's :meth:`flush`, or with an earlier frame."""
        if not self._attached:
            return
        blob = encode_entries(entries)
        lasting = frozenset(entry.event.layout for entry in entries if entry.event.KIND in LASTING)
        self._queue("events", {"entries": blob}, lasting=lasting)
        self._tail_bytes += len(blob)
        self._since_trim += len(blob)
        if len(blob) > _COUNTED_BYTES:
            added = self._added
            if len(added) > 1024:  # connections long gone: their next big request counts afresh
                added.clear()
            conn = entries[0].event.conn
            added[conn] = added.get(conn, 0) + len(blob)
        self._tails_since += 1
        if self._parts:
            self._writer.note(entries)
        if self._rebasing:
            return
        if self._parts:
            # What the keeper keeps beyond the state is the events since its base:
            # a few MiB, whatever the state's size (a base sends only what changed).
            if self._tail_bytes >= MIN_TAIL_BYTES:
                self._rebasing = True
                self._wake()  # the task makes it, a little at a time
        elif self._tail_bytes >= max(MIN_TAIL_BYTES, self._base_cost):  # an older keeper: whole images
            self._base_now(None)

    def ready(self, **info) -> None:
        self._send("ready", {"pid": os.getpid(), **info})

    def stopping(self, why: str) -> None:
        """A deliberate end (``shutdown``: every fd released already; ``taken-over``:
        another server holds it all now; ``refused``: this server will not serve
        the node, which the keeper keeps): the keeper does not start another
        server on it (but ``refused``: it does, later)."""
        self._send("stopping", {"why": why})

    # -- sending -------------------------------------------------------------------------

    def flush(self, soon: bool = False) -> None:
        """Hand every queued frame on, in order, and send what the socket takes
        now (as few system calls as their fds allow: at most 253 fds ride one).
        ``soon``: unless a queued frame tells of a lasting change (or many
        wait), within :data:`SOON_S` instead, by :meth:`run` (the ledger's
        flush at the end of every write: see :data:`SOON_S`)."""
        if not self._queued:
            return
        if soon and len(self._queued) < _SOON_FRAMES and not any(lasting for _, _, lasting in self._queued):
            if not self._soon:
                self._soon = True
                self._wake()
            return
        self._soon = False
        queued, self._queued = self._queued, []
        if not self.alive:
            for _, fds, _ in queued:
                _close(fds)
            return
        batch: list[bytes] = []
        fds: list[int] = []
        lasting: set[str] = set()
        for frame, frame_fds, layouts in queued:
            if batch and len(fds) + len(frame_fds) > frames.MAX_FDS:
                self._hand_on(b"".join(batch), fds, lasting)
                batch, fds, lasting = [], [], set()
            batch.append(frame)
            fds += frame_fds
            lasting |= layouts
        if batch:
            self._hand_on(b"".join(batch), fds, lasting)
        self._send_now()

    def _hand_on(self, data: bytes, fds: list[int], lasting: set[str]) -> None:
        if not self._out:
            self.behind_since = time.monotonic()
        self._out.append(_Segment(memoryview(data), fds))
        self.enqueued += len(data)
        for layout in lasting:
            self._marks[layout] = self.enqueued

    def _send_now(self) -> None:
        """Send what the kernel takes now, never waiting."""
        out, sock = self._out, self.sock
        sent = 0
        while out and self.alive:
            segment = out[0]
            try:
                n = sock.sendmsg([segment.data], frames.ancillary_for(segment.fds), _SEND_FLAGS)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.ETOOMANYREFS:
                    # Too many fds in flight for this user (the keeper has not read
                    # them yet): it reads within milliseconds.  Nothing was sent.
                    self._fd_pressure = True
                    break
                self._gone(exc)
                break
            sent += n
            _close(segment.fds)  # they rode the first byte
            segment.fds = []
            if n < len(segment.data):
                segment.data = segment.data[n:]
            else:
                out.popleft()
        if sent:
            self.sent += sent
            self._moved()
        if out and self.alive:
            self._wake()
        elif not out:
            if self._warned:
                log.warning("the keeper caught up after %.1f s", self.behind_s())
                self._warned = False
            self.behind_since = None

    def _moved(self) -> None:
        if self._progress is not None:
            self._progress.set()
            self._progress = None

    def _wake(self) -> None:
        if self._work is not None:
            self._work.set()
            self._work = None

    def added(self, conn: int) -> int:
        """Bytes of events the connection's requests added to the stream (counted
        for big batches only: those whose clients may be asked to wait)."""
        return self._added.get(conn, 0)

    def behind(self, layouts: Iterable[str] | None = None, conn: int | None = None, since: int = 0) -> bool:
        """Has the keeper not been given everything yet (``layouts``: every lasting
        change of these layouts, and of the node)?  ``conn``, ``since``: its
        :meth:`added` before the request being answered; a request that added
        more than :data:`SMALL_BYTES` also waits while the keeper is far behind
        (:meth:`_pressed`)."""
        if layouts is None:
            return bool(self._out) or bool(self._queued)
        return self.sent < self._target(layouts) or self._pressed(conn, since)

    def _pressed(self, conn: int | None, since: int) -> bool:
        """A request that added much while the keeper is far behind (more than
        :data:`BACKLOG_BYTES` not taken, or more than :data:`TAIL_BOUND_BYTES` of
        events since its base): its client waits, so what waits here and what the
        keeper keeps beyond the state stay bounded; clients that add little never
        wait for it."""
        if conn is None or not self.alive or self._added.get(conn, 0) - since <= SMALL_BYTES:
            return False
        return (
            self.position() - self.sent > BACKLOG_BYTES
            or self._tail_bytes + self._tail_before > TAIL_BOUND_BYTES
        )

    def position(self) -> int:
        """Bytes handed to the keeper's stream so far, queued ones included."""
        return self.enqueued + sum(len(frame) for frame, _, _ in self._queued)

    def _target(self, layouts: Iterable[str]) -> int:
        marks, sent = self._marks, self.sent
        target = 0
        for layout in (*layouts, ""):
            mark = marks.get(layout, 0)
            if mark > sent:
                target = max(target, mark)
            elif mark:
                del marks[layout]  # taken: forgotten
        return target

    async def durable(self, layouts: Iterable[str] | None = None, conn: int | None = None, since: int = 0) -> None:
        """Return once the keeper's socket holds every frame queued so far, or
        (``layouts``) up to the last lasting change of these layouts and of the
        node (or the keeper is gone): an answer sent after it tells of nothing
        a crash can lose or roll back.  (The stream is in order: what is before
        that change is there too.)  ``conn``, ``since``: as for :meth:`behind`."""
        self.flush()
        target = self.enqueued if layouts is None else self._target(tuple(layouts))
        while self.alive and (self.sent < target or self._pressed(conn, since)):
            if self._progress is None:
                self._progress = trio.Event()
            await self._progress.wait()

    async def run(self) -> None:
        """Send what waits as the keeper reads, and make the next base when the
        events since the last one call for it (a task of the server's, for ever)."""
        while True:
            if self._rebasing and self.alive and self._attached:
                try:
                    await self._rebase()
                finally:
                    self._rebasing = False
                continue
            if self._soon and self.alive:
                await trio.sleep(SOON_S)
                self.flush()
                continue
            if not self._out or not self.alive:
                self._work = trio.Event()
                await self._work.wait()
                continue
            if self._fd_pressure:
                self._fd_pressure = False
                await trio.sleep(0.001)
            else:
                with trio.move_on_after(BEHIND_WARNING_S) as waited:
                    await trio.lowlevel.wait_writable(self.sock)
                if waited.cancelled_caught and not self._warned:
                    self._warned = True
                    log.warning(
                        "the keeper has read nothing for %.1f s (%d bytes wait): answers to requests that "
                        "changed state wait for it", self.behind_s(), self.backlog_bytes(),
                    )
            self._send_now()

    def drain(self, timeout: float) -> bool:
        """Blocking (at the end, outside Trio): send everything queued within
        ``timeout``; False if the keeper did not take it all."""
        self.flush()
        deadline = time.monotonic() + timeout
        poller = select.poll()
        if self.sock is not None and self.alive:
            poller.register(self.sock.fileno(), select.POLLOUT)
        while self._out and self.alive:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            poller.poll(min(left, 0.05) * 1000)
            self._send_now()
        return not self._out

    # -- the keeper's side of the channel ---------------------------------------------

    async def watch(self) -> str:
        """Read what the keeper says (in Trio): ``released`` acknowledgements,
        then ``stop`` (stop cleanly) or ``gone`` when the channel ends.

        Reads wait in Trio and take what is there with ``MSG_DONTWAIT``: the
        socket stays blocking (a Trio socket made on a dup of it would set
        ``O_NONBLOCK`` on the shared file, and the hello of a later keeper
        is blocking)."""
        reader = frames.FrameReader()
        sock = self.sock
        try:
            while True:
                frame = reader.next_frame()
                if frame is not None:
                    frame.close_fds()
                    if frame.kind == "stop":
                        return "stop"
                    if frame.kind == "released":
                        self._on_released()
                    continue
                await trio.lowlevel.wait_readable(sock)
                try:
                    data, ancillary, flags, _ = sock.recvmsg(
                        frames.RECV_BYTES, frames.ANCILLARY_BYTES, socket.MSG_DONTWAIT
                    )
                except BlockingIOError:
                    continue
                fds = frames.received_fds(ancillary)
                frames.check_flags(flags, fds)
                if not data and not fds:
                    raise frames.ChannelClosed("the keeper closed the channel")
                reader.feed(data, fds)
        except (OSError, frames.FrameError) as exc:
            if self.sock is sock:
                self._gone(exc)
            return "gone"
        finally:
            reader.close()

    def close(self) -> None:
        self._gone(None)

    def _gone(self, why: BaseException | None) -> None:
        """The channel is done: drop what waits for it (a later keeper gets a whole base)."""
        if self.alive and why is not None:
            log.error("the keeper went away (%s): a crash now loses the node until there is another", why)
            self.lost += 1
        self.alive, self._attached = False, False
        while self._out:
            _close(self._out.popleft().fds)
        for _, fds, _ in self._queued:
            _close(fds)
        self._queued, self._marks = [], {}
        self._soon = False
        self.sent = self.enqueued
        self.behind_since, self._warned = None, False
        self._keeper_keys = set()
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self._moved()
        self._wake()

    # -- bases -----------------------------------------------------------------------------

    def _base_now(self, keys: list[str] | None, provisional: int | None = None) -> None:
        """A whole base at once (when attaching, or for a keeper that keeps images)."""
        image = self._image()
        body: dict = {}
        if self._parts:
            parts, names = self._writer.parts(image)
            for name, data in parts.items():
                self._queue("part", {"key": name, "data": data})
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
        self._send("base", body)
        self._base_cost, self._tail_bytes, self._tails_since = cost, 0, 0
        self._based = True

    async def _rebase(self) -> None:
        """The parts that changed since the last base, encoded between other work:
        the state is immutable, so the image taken first is the base, and the
        events sent meanwhile are its tail (``tails``: how many to keep)."""
        image = self._image()
        self._tails_since, self._tail_before, self._tail_bytes = 0, self._tail_bytes, 0
        try:
            steps = self._writer.steps(image)
            cost = 0
            for name, data in steps:
                if not self.alive:
                    self._writer.forget()
                    return
                if name is None:  # a good place to let others run
                    await trio.sleep(0)
                    continue
                self._queue("part", {"key": name, "data": data})
                cost += len(data)
                if cost >= _STEP_BYTES:
                    self.flush()
                    await trio.sleep(0)
            names = steps.keys
        except BaseException:
            self._writer.forget()
            raise
        if not self.alive:
            self._writer.forget()
            return
        self._send("base", {"parts": names, "tails": self._tails_since, "keys": self._held_keys()})
        self._base_cost, self._tail_before, self._based = cost, 0, True
        self._moved()  # a client held back by a long tail may go on
        self._since_trim += cost
        if self._since_trim >= TRIM_AFTER_BYTES:  # (a trim stalls the loop ~0.1 ms per MiB it returns)
            self._since_trim = 0
            give_back_free_memory()  # what the events and parts since the last trim left behind (gms.heap)

    # -- inside ------------------------------------------------------------------------

    def _queue(
        self, kind: str, body: dict | None = None, fds: list[int] | None = None, lasting: frozenset = frozenset()
    ) -> None:
        if self.alive:
            self._queued.append((frames.encode_frame(kind, body, len(fds or ())), fds or [], lasting))
        elif fds:
            _close(fds)

    def _queue_holds(self, keyed: list[tuple[str, int]]) -> None:
        """The fds are duplicated: the frame may wait here while the memory's own fd is closed."""
        for start in range(0, len(keyed), frames.MAX_FDS):  # a frame's fds ride one system call
            batch = keyed[start : start + frames.MAX_FDS]
            if self.alive:
                self._queue("hold", {"keys": [key for key, _ in batch]}, [os.dup(fd) for _, fd in batch])

    def _send(self, kind: str, body: dict | None = None) -> None:
        """Queue a frame and send everything queued."""
        self._queue(kind, body)
        self.flush()


def _close(fds: Iterable[int]) -> None:
    for fd in fds:
        os.close(fd)


class MirroredLog(EventLog):
    """An event log that sends what it appends to the keeper (when it has one).
    The link is given when the log is made: it sends nothing before the server
    has taken its node (``KeeperLink.attach``)."""

    def __init__(self, *, link: KeeperLink | None = None, **options) -> None:
        super().__init__(**options)
        self.link = link

    def store(self, folded) -> list[LogEntry]:
        entries = super().store(folded)
        if self.link is not None and entries:
            self.link.logged(entries)
        return entries

    def flush(self) -> None:
        if self.link is not None:
            self.link.flush(soon=True)

    def added(self, conn: int) -> int:
        return 0 if self.link is None else self.link.added(conn)

    def behind(self, layouts: Iterable[str] | None = None, conn: int | None = None, since: int = 0) -> bool:
        return self.link is not None and self.link.behind(layouts, conn, since)

    async def durable(self, layouts: Iterable[str] | None = None, conn: int | None = None, since: int = 0) -> None:
        if self.link is not None:
            await self.link.durable(layouts, conn, since)
