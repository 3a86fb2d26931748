"""Socket I/O for the Trio shell, and the one place OS errors are translated.

A :class:`Channel` is an accepted Unix socket: bytes in, frames (with fds)
out, the peer's credentials, and whether it hung up.  Every ``OSError`` of a
connection's socket becomes :class:`PeerGone` (reading) or
:class:`SendFailed` (writing) here and nowhere else, so the rest of the
shell reasons about peers, not errnos.
"""

from __future__ import annotations

import array
import os
import select
import socket
from collections.abc import Awaitable, Callable

import trio

from .peer import Peer, peer_of

_RECV_BYTES = 16 * 1024


class PeerGone(Exception):
    """The client closed, crashed or reset the connection."""


class SendFailed(Exception):
    """A response could not be delivered: unwound like a drop."""


class Channel:
    def __init__(self, sock: trio.socket.SocketType, peer: Peer | None = None) -> None:
        self.sock = sock
        # Asked when it was accepted (OSError: the peer left before we asked; the caller drops it).
        self.peer: Peer = peer if peer is not None else peer_of(sock)
        self._buffer = bytearray(_RECV_BYTES)  # recv() would allocate one per call
        self._view = memoryview(self._buffer)
        self._sending = False

    async def receive(self) -> memoryview:
        """The next bytes; empty when the peer closed (a reset counts as a close)."""
        try:
            n = await self.sock.recv_into(self._buffer)
        except OSError:
            return self._view[:0]
        return self._view[:n]

    async def send(self, frame: bytes, fds: tuple[int, ...] = ()) -> None:
        """Send a whole frame; ``fds`` ride with its first byte (SCM_RIGHTS)."""
        view = memoryview(frame)
        self._sending = True
        try:
            if fds:
                ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                view = view[await self.sock.sendmsg([view], ancillary) :]
            while view:
                view = view[await self.sock.send(view) :]
        except OSError as exc:
            raise SendFailed(str(exc) or type(exc).__name__) from exc
        finally:
            self._sending = False

    def send_nowait(self, frame: bytes) -> bool:
        """Best effort, never waits: write a small frame if the socket takes it now
        and no answer is half sent.  For notices just before a close
        (``SessionEnded``): a client whose receive buffer is full, or who is
        gone, simply does not get it."""
        if self._sending:
            return False
        try:
            return os.write(self.sock.fileno(), frame) == len(frame)
        except OSError:
            return False

    def hung_up(self) -> bool:
        """Has the peer closed (or half-closed, or reset) the connection?  The
        kernel says so (POLLHUP, POLLRDHUP) even with unread data queued, and
        asking reads nothing."""
        poller = select.poll()
        try:
            poller.register(self.sock.fileno(), select.POLLHUP | select.POLLRDHUP | select.POLLERR)
        except (OSError, ValueError):  # closed already
            return True
        return bool(poller.poll(0))

    def close(self) -> None:
        self.sock.close()


async def wait_or_hangup(wait: Callable[[], Awaitable[None]], watch: Callable[[], Awaitable[None]]) -> bool:
    """Run ``wait()`` until it returns (False) or ``watch()`` does (True: the peer hung up)."""
    hung_up = False
    async with trio.open_nursery() as nursery:

        async def watcher() -> None:
            nonlocal hung_up
            await watch()
            hung_up = True
            nursery.cancel_scope.cancel()

        nursery.start_soon(watcher)
        await wait()
        nursery.cancel_scope.cancel()
    return hung_up
