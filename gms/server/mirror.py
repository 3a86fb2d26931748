"""The server's side of its keeper: everything that must outlive the server, sent as it happens.

A server under a keeper (``gms/keeper``) starts by saying hello on the keeper
channel and reading what the keeper hands back (:meth:`KeeperLink.hello`):
the listening socket, and after a crash the last server's state and memory.
Once it serves it *attaches* (:meth:`KeeperLink.attach`): it sends the fds
the keeper lacks and a *base* (a state image, with the keys of every fd that
state holds; the keeper closes any other).  From then on, in the order they
happen on the event loop:

* ``hold``: memory made (an allocation; a host copy's chunks, named by their
  place in the copy: ``gms.server.host_memory.chunk_name``), its fd, before
  the event that records it (a server that dies between the two leaves an fd
  no event names: the next server closes it).  Memory that is no state (the
  host pool, chunks of a transfer in flight, the stock's spares) is never sent;
* ``events``: log entries as they are appended (``MirroredLog``), before the
  memory they released is let go and before any answer goes out;
* ``release``: memory let go, after its event;
* ``base``: a new image once the events sent since the last one outweigh it
  (so the keeper's journal stays within about twice the state, and encoding
  images costs at most a byte per byte of events);
* ``ready`` once serving, ``stopping`` before a deliberate exit.

Sends are synchronous and on the event loop: a frame the kernel took is in
the keeper's receive queue and outlives this process, so whatever a client
was answered survives a SIGKILL a microsecond later.  Frames are queued and
sent together, in one system call where their fds allow: holds and events
wait for the end of the ledger's write (:meth:`KeeperLink.flush`), which comes
before any answer; a release, and every other frame, sends what is queued at
once (an allocation and its free had cost four sends, now two).  A keeper that went away
costs the server nothing but its safety net: the link logs it once and is
dropped (:attr:`KeeperLink.alive`).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import time
from collections.abc import Callable, Iterable

import attrs

from ..handover import frames
from ..handover.image import STATE_VERSION, StateImage, encode_entries, encode_image
from ..store import EventLog, LogEntry

# Restarts and take-overs are rare and each line matters: not under "gms.server",
# whose repeated lines are rate-limited (gms.server.ratelimit).
log = logging.getLogger("gms.server.restart")

MIN_TAIL_BYTES = 1 << 20  # a new base no sooner than this many bytes of events
SEND_BUFFER_BYTES = 4 << 20  # asked for; the kernel caps it (net.core.wmem_max)
SEND_TIMEOUT_S = 2  # a keeper that reads nothing for this long is gone (a send may wait twice: the frame, its rest)
LISTENER = "listener"


def memory_key(tier: str, allocation_id: str) -> str:
    return f"{tier}:{allocation_id}"


def split_key(key: str) -> tuple[str, str]:
    tier, _, allocation_id = key.partition(":")
    return tier, allocation_id


@attrs.frozen
class Handback:
    """What the keeper handed a new server.

    ``mode``: ``fresh`` (an empty node, on ``listener`` if the keeper holds
    one, else the server binds or takes over), ``resume`` (the last server
    died: ``base`` and ``tails`` are its journal, ``fds`` its memory),
    ``retired`` (this keeper's server was taken over by another: serve nothing)."""

    mode: str
    listener: int | None = None
    base: bytes | None = None
    tails: tuple[bytes, ...] = ()
    fds: dict = attrs.field(factory=dict)  # key -> fd
    old_pid: int = 0
    reason: str = ""
    provisional: int | None = None  # the journal is a take-over's, not committed: the old server's pid
    failed_resumes: int = 0  # servers that died resuming this journal before serving


class KeeperGone(Exception):
    """The keeper channel broke."""


class KeeperLink:
    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        try:  # room for frames the keeper has not read yet (it reads in batches)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        except OSError:
            pass
        # A send waits for the keeper to read (an event reaches it before its
        # answer goes out), but not for ever: a keeper that reads nothing for
        # this long is taken for gone (the kernel's send timeout; reads are apart).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", SEND_TIMEOUT_S, 0))
        self.sock = sock
        self.alive = True
        self._keeper_keys: set[str] = set()
        self._attached = False
        self._image: Callable[[], StateImage] | None = None
        self._base_bytes = 0
        self._tail_bytes = 0
        self._queued: list[tuple[bytes, list[int]]] = []  # frames (with their fds) not sent yet

    # -- the start ---------------------------------------------------------------

    def hello(self, device: str, *, timeout: float | None = 60.0) -> Handback:
        """Say who we are (and for which device: a keeper may keep for several);
        read the keeper's hand-back (blocking: before serving)."""
        self.sock.settimeout(timeout)
        try:
            frames.send_frame(self.sock, "hello", {"pid": os.getpid(), "device": device, "version": STATE_VERSION})
            reader = frames.FrameReader()
            head = frames.recv_frame(self.sock, reader)
            if head.kind != "handback":
                raise KeeperGone(f"the keeper answered {head.kind!r}, not a hand-back")
            fds: dict[str, int] = {}
            listener = None
            while True:
                frame = frames.recv_frame(self.sock, reader)
                if frame.kind == "end":
                    break
                if frame.kind != "fds" or len(frame.body["keys"]) != len(frame.fds):
                    frame.close_fds()
                    raise KeeperGone(f"the keeper sent {frame.kind!r} inside a hand-back")
                for key, fd in zip(frame.body["keys"], frame.fds):
                    if key == LISTENER:
                        listener = fd
                    else:
                        fds[key] = fd
        except (OSError, frames.FrameError) as exc:
            raise KeeperGone(f"the keeper channel broke during the hand-back: {exc}") from exc
        finally:
            self.sock.settimeout(None)
        body = head.body
        self._keeper_keys = set(fds) | ({LISTENER} if listener is not None else set())
        return Handback(
            mode=body["mode"], listener=listener, base=body.get("base"), tails=tuple(body.get("tails", ())),
            fds=fds, old_pid=body.get("old_pid", 0), reason=body.get("reason", ""),
            provisional=body.get("provisional"), failed_resumes=body.get("failed_resumes", 0),
        )

    def attach(
        self, image: Callable[[], StateImage], held: Iterable[tuple[str, int]], *, provisional: int | None = None
    ) -> None:
        """Serving from now on: send what the keeper lacks of ``held`` ((key, fd)
        of every fd the state needs kept, the listener included), then a base;
        the keeper closes whatever else it holds.  ``provisional``: the node is
        a take-over's from that pid, not committed yet (:meth:`confirm` once it is):
        should this server die first, the next one asks whether the old one
        still serves before it resumes anything."""
        self._image = image
        held = list(held)
        self._queue_holds([(key, fd) for key, fd in held if key not in self._keeper_keys])
        self._attached = True
        self._send_base([key for key, _ in held], provisional)

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
            self._send("release", {"keys": [memory_key(tier, i) for i in allocation_ids]})

    def logged(self, entries: list[LogEntry]) -> None:
        """Events stored: sent at the ledger's :meth:`flush`, or with an earlier frame."""
        if not self._attached:
            return
        blob = encode_entries(entries)
        self._queue("events", {"entries": blob})
        self._tail_bytes += len(blob)
        if self._tail_bytes >= max(MIN_TAIL_BYTES, self._base_bytes):
            self._send_base(None)

    def ready(self, **info) -> None:
        self._send("ready", {"pid": os.getpid(), **info})

    def stopping(self, why: str) -> None:
        """A deliberate end (``shutdown``: every fd released already; ``taken-over``:
        another server holds it all now): the keeper does not start another."""
        self._send("stopping", {"why": why})

    def flush(self) -> None:
        """Send every queued frame, in order: as few system calls as their fds allow
        (at most 253 fds ride one)."""
        queued, self._queued = self._queued, []
        batch: list[bytes] = []
        fds: list[int] = []
        for frame, frame_fds in queued:
            if batch and len(fds) + len(frame_fds) > frames.MAX_FDS:
                self._sendmsg(b"".join(batch), fds)
                batch, fds = [], []
            batch.append(frame)
            fds += frame_fds
        if batch:
            self._sendmsg(b"".join(batch), fds)

    def close(self) -> None:
        self.alive = False
        self.sock.close()

    async def wait_for_stop(self) -> str:
        """Read what the keeper says (in Trio): ``stop`` (stop cleanly), or
        ``gone`` when the channel ends.

        Reads wait in Trio and take what is there with ``MSG_DONTWAIT``: the
        socket itself stays blocking for the sends.  (A Trio socket made on a
        dup of it had set ``O_NONBLOCK`` on the shared file: the first send
        that found the keeper's buffer full then failed with EAGAIN, and the
        server went on without a keeper for good.)"""
        import trio

        reader = frames.FrameReader()
        try:
            while True:
                frame = reader.next_frame()
                if frame is not None:
                    frame.close_fds()
                    if frame.kind == "stop":
                        return "stop"
                    continue
                await trio.lowlevel.wait_readable(self.sock)
                try:
                    data, ancillary, flags, _ = self.sock.recvmsg(
                        frames.RECV_BYTES, frames.ANCILLARY_BYTES, socket.MSG_DONTWAIT
                    )
                except BlockingIOError:
                    continue
                fds = frames.received_fds(ancillary)
                frames.check_flags(flags, fds)
                if not data and not fds:
                    raise frames.ChannelClosed("the keeper closed the channel")
                reader.feed(data, fds)
        except (OSError, frames.FrameError):
            self.alive = False
            return "gone"
        finally:
            reader.close()

    # -- inside ------------------------------------------------------------------------

    def _send_base(self, keys: list[str] | None, provisional: int | None = None) -> None:
        blob = encode_image(self._image())
        body = {"image": blob} if keys is None else {"image": blob, "keys": keys}
        if provisional is not None:
            body["provisional"] = provisional
        self._send("base", body)
        self._base_bytes, self._tail_bytes = len(blob), 0

    def _queue(self, kind: str, body: dict | None = None, fds: list[int] | None = None) -> None:
        if self.alive:
            self._queued.append((frames.encode_frame(kind, body, len(fds or ())), fds or []))

    def _queue_holds(self, keyed: list[tuple[str, int]]) -> None:
        for start in range(0, len(keyed), frames.MAX_FDS):  # a frame's fds ride one system call
            batch = keyed[start : start + frames.MAX_FDS]
            self._queue("hold", {"keys": [key for key, _ in batch]}, [fd for _, fd in batch])

    def _send(self, kind: str, body: dict | None = None) -> None:
        """Queue a frame and send everything queued."""
        self._queue(kind, body)
        self.flush()

    def _sendmsg(self, data: bytes, fds: list[int]) -> None:
        if not self.alive:
            return
        try:
            for attempt in range(1000):
                try:
                    sent = self.sock.sendmsg([data], frames.ancillary_for(fds))
                    if sent < len(data):
                        self.sock.sendall(memoryview(data)[sent:])
                    break
                except OSError as exc:
                    # Too many fds in flight for this user (the keeper has not read
                    # them yet): it reads within milliseconds.  Only frames with
                    # fds meet this, and the ones refused were not sent (their fds
                    # ride the first byte); holds sent again are harmless (the
                    # same key, the same memory).
                    if exc.errno != errno.ETOOMANYREFS or attempt == 999:
                        raise
                    time.sleep(0.001)
        except OSError as exc:
            log.error("the keeper went away (%s): serving on without one; a crash now loses the node", exc)
            self.alive = False


class MirroredLog(EventLog):
    """An event log that sends what it appends to the keeper (when it has one)."""

    link: KeeperLink | None = None

    def store(self, folded) -> list[LogEntry]:
        entries = super().store(folded)
        if self.link is not None and entries:
            self.link.logged(entries)
        return entries

    def flush(self) -> None:
        if self.link is not None:
            self.link.flush()
