"""Socket I/O for the Trio shell: framed sends with fds, and hang-up watching."""

from __future__ import annotations

import array
import select
import socket
from collections.abc import Awaitable, Callable

import trio


_HANGUP_POLL_S = 0.05  # how often a wait with a pipelined request unread checks for a hang-up


class PeerGone(Exception):
    """The client closed, crashed or reset the connection."""


class SendFailed(Exception):
    """A response could not be delivered: unwound like a drop."""


async def send_frame(sock: trio.socket.SocketType, frame: bytes, fds: tuple[int, ...] = ()) -> None:
    """Send a whole frame; ``fds`` ride with its first byte (SCM_RIGHTS)."""
    view = memoryview(frame)
    try:
        if fds:
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
            view = view[await sock.sendmsg([view], ancillary) :]
        while view:
            view = view[await sock.send(view) :]
    except OSError as exc:
        raise SendFailed(str(exc) or type(exc).__name__) from exc


def peer_hung_up(sock: trio.socket.SocketType) -> bool:
    """Has the peer closed (or half-closed, or reset) the connection?  The
    kernel says so (POLLHUP, POLLRDHUP) even with unread data queued, and
    asking reads nothing."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLHUP | select.POLLRDHUP | select.POLLERR)
    return bool(poller.poll(0))


async def wait_for_hangup(sock: trio.socket.SocketType) -> None:
    """Return once the peer has closed.

    Used while a session waits (for a lock, for memory) and reads nothing:
    a client that dies meanwhile must not be granted a lock it cannot use.
    """
    await trio.lowlevel.wait_readable(sock)
    try:
        data = await sock.recv(1, socket.MSG_PEEK)
    except OSError:
        return
    if not data:
        return
    # A pipelined request: it is read once the wait ends.  Readability says
    # nothing more until then, so poll for the hang-up behind it.
    while not peer_hung_up(sock):
        await trio.sleep(_HANGUP_POLL_S)


async def wait_or_hangup(wait: Callable[[], Awaitable[None]], sock: trio.socket.SocketType) -> bool:
    """Run ``wait()`` until it returns (False) or the peer hangs up (True)."""
    hung_up = False
    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            nonlocal hung_up
            await wait_for_hangup(sock)
            hung_up = True
            nursery.cancel_scope.cancel()

        nursery.start_soon(watch)
        await wait()
        nursery.cancel_scope.cancel()
    return hung_up
