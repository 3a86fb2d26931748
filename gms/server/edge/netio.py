"""Socket I/O for the Trio shell, and the one place OS errors are translated.

A :class:`Channel` is an accepted Unix socket: bytes in, frames (with fds)
out, the peer's credentials, and whether it hung up.  Every ``OSError`` of a
connection's socket becomes :class:`PeerGone` (reading) or
:class:`SendFailed` (writing) here and nowhere else, so the rest of the
shell reasons about peers, not errnos.
"""

from __future__ import annotations

import array
import fcntl
import select
import socket
import sys
import termios
from collections.abc import Awaitable, Callable

import trio

from ...system.peer import Peer, peer_of

_RECV_BYTES = 16 * 1024
_BIG_RECV_BYTES = 256 * 1024  # at most, for the rest of a frame known to be big
_YIELD_EVERY = 16


class PeerGone(Exception):
    """The client closed, crashed or reset the connection."""


class SendFailed(Exception):
    """A response could not be delivered: unwound like a drop."""


class Channel:
    """An accepted connection's socket, owned here (a plain non-blocking socket).

    Reads and writes are tried at once and wait (``trio.lowlevel.wait_readable``
    / ``wait_writable``) only when the kernel says they would block: Trio's own
    socket wrapper yields to the scheduler after every call that succeeded,
    which cost a round trip about 6 of its 25 µs (bench/rpc_profile.py).  A
    send is the exception: it yields once it is done, off the round trip (the
    answer is on its way).  Reading at once after an answer found the next
    request missing every time (a read that would block, an ``epoll_ctl``, a
    park and a wake-up: with 16 clients on 2 cores, 2.0 reads per export
    against 1.2 to 1.5 now, docs/performance.md section 10); after the other
    sessions' turns, the client has often sent it already.  To stay fair, a
    channel that never had to wait yields every ``_YIELD_EVERY`` reads, and
    every operation is a cancellation point, as Trio's are."""

    def __init__(self, sock: socket.socket, peer: Peer | None = None) -> None:
        sock.setblocking(False)
        self.sock = sock
        # Asked when it was accepted (OSError: the peer left before we asked; the caller drops it).
        self.peer: Peer = peer if peer is not None else peer_of(sock)
        self._buffer = bytearray(_RECV_BYTES)  # recv() would allocate one per call
        self._view = memoryview(self._buffer)
        self._sending = False
        self.sent = 0  # bytes sent, all told (a take-over tells a stuck send from a slow one by it)
        self._unyielded = 0

    async def _after_ready_call(self) -> None:
        self._unyielded += 1
        if self._unyielded >= _YIELD_EVERY:
            self._unyielded = 0
            await trio.lowlevel.cancel_shielded_checkpoint()

    async def receive(self, wanted: int = 0) -> memoryview:
        """The next bytes; empty when the peer closed (a reset counts as a close).
        ``wanted``: what the frame begun still lacks; past the usual buffer, one
        read takes up to 256 KiB of it (a 1 MiB frame had cost 64 reads, each a
        pass through the scheduler)."""
        view = self._view if wanted <= _RECV_BYTES else memoryview(bytearray(min(wanted, _BIG_RECV_BYTES)))
        return view[: await self.receive_into(view)]

    async def receive_into(self, space: memoryview) -> int:
        """Read into ``space`` (up to 256 KiB of it); 0 when the peer closed."""
        await trio.lowlevel.checkpoint_if_cancelled()
        space = space[:_BIG_RECV_BYTES]
        while True:
            try:
                n = self.sock.recv_into(space)
            except BlockingIOError:
                self._unyielded = 0
                await trio.lowlevel.wait_readable(self.sock)
                continue
            except OSError:
                return 0
            await self._after_ready_call()
            return n

    async def send(self, frame: bytes, fds: tuple[int, ...] = ()) -> None:
        """Send a whole frame; ``fds`` ride with its first byte (SCM_RIGHTS)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        view = memoryview(frame)
        self._sending = True
        try:
            while view:
                try:
                    if fds:
                        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                        sent = self.sock.sendmsg([view], ancillary)
                        fds = ()
                    else:
                        sent = self.sock.send(view)
                except BlockingIOError:
                    self._unyielded = 0
                    await trio.lowlevel.wait_writable(self.sock)
                    continue
                view = view[sent:]
                self.sent += sent
        except OSError as exc:
            raise SendFailed(str(exc) or type(exc).__name__) from exc
        finally:
            self._sending = False
        self.sent = 0  # bytes sent, all told (a take-over tells a stuck send from a slow one by it)
        self._unyielded = 0
        await trio.lowlevel.cancel_shielded_checkpoint()

    @property
    def sending(self) -> bool:
        """Is an answer being sent (and maybe waiting for the client to read)?"""
        return self._sending

    def send_nowait(self, frame: bytes) -> bool:
        """Best effort, never waits: write a small frame if the socket takes it now
        and no answer is half sent.  For notices just before a close
        (``SessionEnded``): a client whose receive buffer is full, or who is
        gone, simply does not get it."""
        if self._sending:
            return False
        try:
            return self.sock.send(frame) == len(frame)
        except OSError:
            return False

    def send_if_idle(self, frame: bytes) -> bool:
        """Send a small frame only if nothing waits to go out (no answer being
        sent, nothing the client has not read yet): then the kernel takes it
        whole, and a frame is never cut short.  False: not sent (no matter:
        for notices that say the same again later)."""
        if self._sending:
            return False
        try:
            queued = fcntl.ioctl(self.sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
            if int.from_bytes(queued, sys.byteorder) or self.sock.send(frame) != len(frame):
                return False
        except OSError:
            return False
        return True

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
        """Only once no task of the session waits on the socket (they have all ended)."""
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
