"""Socket I/O for the Trio shell: framed sends with fds, and hang-up watching."""

from __future__ import annotations

import array
import os
import select
import socket
from collections.abc import Awaitable, Callable

import trio


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


def send_notice_nowait(sock: trio.socket.SocketType, frame: bytes) -> bool:
    """Best effort, never waits: write a small frame if the socket takes it now.
    For notices sent just before a close (``SessionEnded``); a client whose
    receive buffer is full, or who is gone, simply does not get it."""
    try:
        return os.write(sock.fileno(), frame) == len(frame)
    except OSError:
        return False


def peer_hung_up(sock: trio.socket.SocketType) -> bool:
    """Has the peer closed (or half-closed, or reset) the connection?  The
    kernel says so (POLLHUP, POLLRDHUP) even with unread data queued, and
    asking reads nothing."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLHUP | select.POLLRDHUP | select.POLLERR)
    return bool(poller.poll(0))


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
