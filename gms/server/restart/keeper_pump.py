"""Bytes onto the keeper's socket as the kernel takes them, never blocking the loop.

The keeper stream (``gms.server.restart.keeper_stream``, sans I/O) says what to
send; the pump sends it with ``MSG_DONTWAIT``, says when something moved (an
answer waiting for durability may go), wakes the link's task when bytes wait,
and knows how long the keeper has read nothing.  The link
(``gms.server.restart.mirror``) decides what and when; the pump only moves.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import select
import socket
import time
from collections.abc import Callable

import trio

from ...handover import frames
from .keeper_stream import KeeperStream

log = logging.getLogger("gms.server.restart")

SEND_BUFFER_BYTES = 4 << 20  # asked for; the kernel caps it (net.core.wmem_max)
BEHIND_WARNING_S = 1.0  # a keeper that read nothing for this long is said to be behind, once
_SEND_FLAGS = int(socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)


class KeeperPump:
    def __init__(self, stream: KeeperStream, lost: Callable[[BaseException], None]) -> None:
        """``lost(exc)``: the socket failed for good (the link lets the keeper go)."""
        self.stream = stream
        self.sock: socket.socket | None = None
        self._lost = lost
        self.behind_since: float | None = None  # monotonic: when the out queue last became non-empty
        self._warned = False
        self._fd_pressure = False  # too many fds in flight for this user: try again a moment later
        self._progress: trio.Event | None = None
        self._work: trio.Event | None = None

    def use(self, sock: socket.socket) -> None:
        try:  # room for frames the keeper has not read yet (it reads in batches)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        except OSError:
            pass
        self.sock = sock

    def behind_s(self) -> float:
        return 0.0 if self.behind_since is None else time.monotonic() - self.behind_since

    def send_now(self) -> None:
        """Send what the kernel takes now, never waiting."""
        stream, sock = self.stream, self.sock
        if stream.frames.out and self.behind_since is None:
            self.behind_since = time.monotonic()
        moved = False
        while (segment := stream.next_segment()) is not None:
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
                self._lost(exc)
                break
            stream.took(n)
            moved = True
        if moved:
            self.moved()
        if stream.frames.out and stream.open:
            self.wake()
        elif not stream.frames.out:
            if self._warned:
                log.warning("the keeper caught up after %.1f s", self.behind_s())
                self._warned = False
            self.behind_since = None

    def moved(self) -> None:
        """Bytes went (or the keeper did): whoever waits for progress looks again."""
        if self._progress is not None:
            self._progress.set()
            self._progress = None

    async def progress(self) -> None:
        if self._progress is None:
            self._progress = trio.Event()
        await self._progress.wait()

    def wake(self) -> None:
        """Work for the link's task (bytes wait, a base fell due)."""
        if self._work is not None:
            self._work.set()
            self._work = None

    async def idle(self) -> None:
        self._work = trio.Event()
        await self._work.wait()

    async def writable(self) -> bool:
        """Until the socket takes more (a moment, under fd pressure); says so once
        when the keeper has read nothing for :data:`BEHIND_WARNING_S`.  False: the
        keeper went away meanwhile."""
        if self._fd_pressure:
            self._fd_pressure = False
            await trio.sleep(0.001)
            return True
        with trio.move_on_after(BEHIND_WARNING_S) as waited:
            try:
                await trio.lowlevel.wait_writable(self.sock)
            except trio.ClosedResourceError:  # (closed)
                return False
        if waited.cancelled_caught and not self._warned:
            self._warned = True
            log.warning(
                "the keeper has read nothing for %.1f s (%d bytes wait): answers to requests that "
                "changed state wait for it", self.behind_s(), self.stream.backlog_bytes(),
            )
        return True

    def drain(self, timeout: float) -> bool:
        """Blocking (at the end, outside Trio): send everything queued within
        ``timeout``; False if the keeper did not take it all."""
        deadline = time.monotonic() + timeout
        poller = select.poll()
        if self.sock is not None and self.stream.open:
            poller.register(self.sock.fileno(), select.POLLOUT)
        while self.stream.frames.out and self.stream.open:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            poller.poll(min(left, 0.05) * 1000)
            self.send_now()
        return not self.stream.frames.out

    def closed(self) -> None:
        """The channel is done: the socket closed, whoever waits told."""
        self.behind_since, self._warned = None, False
        if self.sock is not None:
            # Tasks parked on the socket (watch, the link's task) are told before its fd
            # number is freed: else the next connection accepted under that number finds
            # Trio still waiting on it for them (BusyResourceError, and the server stopped).
            with contextlib.suppress(RuntimeError):  # (outside Trio, at the end: nobody waits)
                trio.lowlevel.notify_closing(self.sock)
            self.sock.close()
            self.sock = None
        self.moved()
        self.wake()
