"""The server's side of its keeper: a thin Trio shell over the keeper stream.

What is sent, in what order, and what an answer waits for is the stream's
(``gms.server.restart.keeper_stream``, sans I/O: its docstring is the
protocol).  :class:`KeeperLink` owns the socket: it says hello and reads the
keeper's hand-back (:meth:`KeeperLink.hello`, blocking, before serving:
``gms.server.restart.handback``),
sends what the stream hands on as the kernel takes it (never blocking the
loop: :meth:`KeeperLink.run`, a task of the server's), makes a base when one
falls due, a little at a time, reads what the keeper says (``RELEASED``,
``STOP``: :meth:`KeeperLink.watch`), and is the ledger's ``Durability``
(``gms.server.service.durability``): every stored batch goes to the stream,
and an answer that tells of a lasting change awaits :meth:`KeeperLink.durable`.

**Nothing waits on the keeper but what must.**  A frame the kernel took is in
the keeper's queue and outlives this process, so an answer that tells a
client of a lasting change goes out only once the frame with the last such
change of its layout was taken.  A keeper that stops reading (stopped,
swapped out, busy) holds up only those answers, for as long as it reads
nothing; nothing is dropped; when it reads again it catches up.  ``gms
status`` and the metrics show a keeper behind.  A keeper that goes away for
good (its channel closed) is gone: the server serves on without one until it
has another (``gms.server.restart.succession``).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Iterable

import trio

from ...handover import frames
from ...handover.image import StateImage, encode_entries
from ...handover.journal import KeptBase
from ...handover.words import Leaving, Say
from ...store import LogEntry
from ...system.heap import give_back_free_memory
from .handback import LISTENER, Handback, KeeperGone, receive_handback
from .keeper_pump import KeeperPump
from .keeper_stream import (
    BACKLOG_BYTES,
    MIN_TAIL_BYTES,
    TAIL_BOUND_BYTES,
    TRIM_AFTER_BYTES,
    KeeperStream,
    LinkState,
    memory_key,
    split_key,
)

# Restarts and take-overs are rare and each line matters: not under "gms.server",
# whose repeated lines are rate-limited (gms.server.edge.ratelimit).
log = logging.getLogger("gms.server.restart")

DRAIN_S = 5.0  # at a server's end, the longest wait for its keeper to take what is queued
PARTS = "parts"  # the feature a keeper names in its hand-back when it keeps its base in parts
# What tells of no lasting change (a session, a lock, an allocation of a build, a
# metadata put) is handed on this much later, with whatever follows it: the answer
# goes out first, and one system call (one wake-up of the keeper) carries many
# requests' events.  A crash loses at most this much of them, which a restart
# keeps nothing of (no session, lock or unfinished build).
SOON_S = 0.002
# A node quiet this long with events since its keeper's base gets a new base (the
# parts that changed): a restart then folds no tail and resends nothing (issue 59:
# 200,000 entries behind a base taken mid-build cost a SIGKILL 0.3 s more).
QUIET_REBASE_S = 1.0

__all__ = [
    "BACKLOG_BYTES", "DRAIN_S", "LISTENER", "MIN_TAIL_BYTES", "SOON_S", "TAIL_BOUND_BYTES", "Handback",
    "KeeperGone", "KeeperLink", "memory_key", "split_key",
]


HISTORY_BATCH = 4096  # entries a history row holds


def history_rows(entries: Iterable[LogEntry]) -> list[list]:
    """``entries`` as a keeper keeps history: ``[first, last, count, blob]`` rows."""
    entries = list(entries)
    return [[batch[0].seq, batch[-1].seq, len(batch), encode_entries(batch)]
            for batch in (entries[i : i + HISTORY_BATCH] for i in range(0, len(entries), HISTORY_BATCH))]


class KeeperLink:
    """The channel to the keeper (its socket replaced when a keeper is found again)."""

    def __init__(self, sock: socket.socket | None = None) -> None:
        self.stream = stream = KeeperStream()
        # What the ledger and the memory tables ask on every request: the stream's own
        # methods, not a call through this shell each (gms.server.service.durability).
        self.held, self.added, self.behind = stream.held, stream.added, stream.behind
        self.lost = 0  # keepers lost since the start
        self.keeper_pid = self.service_pid = 0  # as the keeper named them at its hand-back
        self.stood_by = False  # this server was a spare: the node came long after it started
        self._on_released: Callable[[], None] = lambda: None
        self.pump = KeeperPump(stream, lost=self._gone)
        self._send_now, self._wake = self.pump.send_now, self.pump.wake
        if sock is not None:
            self.use(sock)

    def use(self, sock: socket.socket) -> None:
        """Talk to the keeper on ``sock`` from now on (nothing is attached yet)."""
        self.pump.use(sock)
        self.stream.opened()

    @property
    def sock(self) -> socket.socket | None:
        return self.pump.sock

    @property
    def alive(self) -> bool:
        return self.stream.open

    @property
    def state(self) -> LinkState:
        return self.stream.state

    def backlog_bytes(self) -> int:
        """Bytes not yet taken by the keeper's socket."""
        return self.stream.backlog_bytes()

    def behind_s(self) -> float:
        return self.pump.behind_s()

    # -- the start ---------------------------------------------------------------

    def hello(self, device: str, *, timeout: float | None = 60.0) -> Handback:
        """Say who we are (and for which device: a keeper may keep for several);
        read the keeper's hand-back (blocking: before serving, or in a thread)."""
        received = receive_handback(self.sock, device, timeout)
        self.stood_by = received.stood_by
        self.stream.opened(PARTS in received.handback.features, received.keys)
        self.keeper_pid, self.service_pid = received.keeper_pid, received.service_pid
        return received.handback

    def attach(
        self,
        image: Callable[[], StateImage],
        held: Callable[[], list[tuple[str, int]]],
        *,
        provisional: int | None = None,
        wants_ack: Callable[[], bool] = lambda: False,
        on_released: Callable[[], None] = lambda: None,
        now: bool = True,
        history: Iterable[LogEntry] = (),
        kept: KeptBase | None = None,
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
        the node, as it would have with none).  ``history``: the events the
        base already holds, for a keeper that has none of them (a node's first
        server): kept beside the base, shown by the next server.  ``kept``: the
        keeper's base this node was rebuilt from (a restart): the first base sends
        only the parts that differ from it."""
        self._on_released = on_released
        keyed = held()
        if now:
            # Blocking, before serving: the fds go a frame at a time, each frame's
            # copies closed once the keeper has them, so a node of N allocations
            # needs N fds here and one frame's more, not 2N (docs/operations.md).
            self.stream.attach(image, [], lambda: [key for key, _ in held()], wants_ack, kept=kept)
            missing = [(key, fd) for key, fd in keyed if key not in self.stream.keeper_keys]
            for start in range(0, len(missing), frames.MAX_FDS):
                self.stream.hold_batch(missing[start : start + frames.MAX_FDS], provisional if start == 0 else None)
                if not self.drain(DRAIN_S):
                    break  # the keeper does not read: the caller's drain says so
            self.stream.base_now([key for key, _ in keyed], provisional, history_rows(history))
            self._send_now()
        else:
            self.stream.attach(image, keyed, lambda: [key for key, _ in held()], wants_ack, provisional)
            self.flush()
            self.stream.rebase_due = True
            self._wake()

    def confirm(self) -> None:
        """The take-over committed: the node is this server's."""
        self.stream.send(Say.CONFIRM)
        self._send_now()

    # -- as it happens (and the ledger's Durability) --------------------------------

    def released(self, tier: str, allocation_ids: list[str]) -> None:
        """Memory let go (after its event): sent now, with what is queued before it."""
        self.stream.released(tier, allocation_ids)
        self._send_now()

    def logged(self, entries: list[LogEntry]) -> None:
        """Events stored: sent at the ledger's :meth:`flush`, or with an earlier frame."""
        if self.stream.logged(entries):
            self._send_now()  # (an older keeper's whole image, handed on)
        elif self.stream.rebase_due:
            self._wake()  # the task makes it, a little at a time

    def ready(self, **info) -> None:
        self.stream.send(Say.READY, {"pid": os.getpid(), **info})
        self._send_now()

    def stopping(self, why: Leaving) -> None:
        """A deliberate end (``SHUTDOWN``: every fd released already; ``TAKEN_OVER``:
        another server holds it all now; ``REFUSED``: this server will not serve
        the node, which the keeper keeps; ...: ``gms.handover.words.Leaving``)."""
        self.stream.stopping(why)
        self._send_now()

    def flush(self, soon: bool = False) -> None:
        """Hand every queued frame on and send what the socket takes now.  ``soon``:
        within :data:`SOON_S` by :meth:`run`, unless one tells of a lasting change."""
        done = self.stream.flush(soon)
        if done:
            self._wake()
        elif done is False:
            self._send_now()

    async def durable(self, layouts: Iterable[str] | None = None, conn: int | None = None, since: int = 0) -> None:
        """Return once the keeper's socket holds every frame queued so far, or
        (``layouts``) up to the last lasting change of these layouts and of the
        node (or the keeper is gone): an answer sent after it tells of nothing
        a crash can lose or roll back.  ``conn``, ``since``: as for :meth:`behind`."""
        self.flush()
        stream = self.stream
        target = stream.target(None if layouts is None else tuple(layouts))
        while stream.open and (stream.frames.sent < target or stream.pressed(conn, since)):
            await self.pump.progress()

    # -- the task ------------------------------------------------------------------------

    async def run(self) -> None:
        """Send what waits as the keeper reads, and make the next base when one
        falls due (a task of the server's, for ever)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._rebase_when_quiet)
            await self._send()

    async def _rebase_when_quiet(self) -> None:
        """Once a second, apart from the requests' path: events since the base and
        none in the last second bring a new base (a restart then folds no tail)."""
        stream = self.stream
        seen = 0
        while True:
            await trio.sleep(QUIET_REBASE_S)
            now = stream.events_since_base
            if now and now == seen and stream.rebases_when_quiet() and not stream.rebase_due:
                stream.rebase_due = True
                self._wake()
            seen = now

    async def _send(self) -> None:
        stream = self.stream
        while True:
            if stream.rebase_due and stream.open and stream.attached:
                await self._rebase()
                continue
            if stream.frames.soon and stream.open:
                await trio.sleep(SOON_S)
                self.flush()
                continue
            if not stream.frames.out or not stream.open:
                await self.pump.idle()
                continue
            if await self.pump.writable():
                self._send_now()

    async def _rebase(self) -> None:
        """The stream's next base, made between other work."""
        for hand_on in self.stream.rebase():
            if hand_on:
                self._send_now()
            await trio.sleep(0)
        self._send_now()
        self.pump.moved()  # a client held back by a long tail may go on
        if self.stream.since_trim >= TRIM_AFTER_BYTES:  # (a trim stalls the loop ~0.1 ms per MiB it returns)
            self.stream.since_trim = 0
            give_back_free_memory()  # what the events and parts since the last trim left behind (gms.system.heap)

    def drain(self, timeout: float) -> bool:
        """Blocking (at the end, outside Trio): send everything queued within
        ``timeout``; False if the keeper did not take it all."""
        self.flush()
        return self.pump.drain(timeout)

    # -- the keeper's side of the channel ---------------------------------------------

    async def watch(self) -> Say | None:
        """Read what the keeper says (in Trio): ``RELEASED`` acknowledgements,
        then ``STOP`` (stop cleanly), or None when the channel ends.

        Reads wait in Trio and take what is there with ``MSG_DONTWAIT``: the
        socket stays blocking (a Trio socket made on a dup of it would set
        ``O_NONBLOCK`` on the shared file, and the hello of a later keeper
        is blocking)."""
        sock = self.sock
        try:
            return await read_says(sock, lambda: self._on_released())
        except (OSError, frames.FrameError, trio.ClosedResourceError) as exc:
            if self.sock is sock:  # (ClosedResourceError: _gone closed it already)
                self._gone(exc)
            return None

    def close(self) -> None:
        self._gone(None)

    def _gone(self, why: BaseException | None) -> None:
        """The channel is done: drop what waits for it (a later keeper gets a whole base)."""
        if self.alive and why is not None:
            log.error("the keeper went away (%s): a crash now loses the node until there is another", why)
            self.lost += 1
        self.stream.gone()
        self.pump.closed()


async def read_says(sock: socket.socket, on_released: Callable[[], None]) -> Say | None:
    """What the keeper says until ``STOP`` (returned): each ``RELEASED`` calls
    ``on_released``.  Raises OSError, FrameError or ChannelClosed when the channel ends."""
    reader = frames.FrameReader()
    try:
        while True:
            frame = reader.next_frame()
            if frame is not None:
                frame.close_fds()
                if frame.kind == Say.STOP:
                    return Say.STOP
                if frame.kind == Say.RELEASED:
                    on_released()
                continue
            await trio.lowlevel.wait_readable(sock)
            try:
                data, ancillary, flags, _ = sock.recvmsg(frames.RECV_BYTES, frames.ANCILLARY_BYTES, socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            fds = frames.received_fds(ancillary)
            frames.check_flags(flags, fds)
            if not data and not fds:
                raise frames.ChannelClosed("the keeper closed the channel")
            reader.feed(data, fds)
    finally:
        reader.close()
