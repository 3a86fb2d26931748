"""The keeper's side of one server's conversation: its hello, the hand-back of
what the keeper holds, then every frame the server mirrors, until EOF; and
how a server's end is told (``describe``).  The keeper never parses a state.
"""

from __future__ import annotations

import logging
import os
import signal

import attrs
import trio

from ..handover import frames
from ..handover.words import Leaving, Say
from .store import Store

log = logging.getLogger("gms.keeper")

BATCH_S = 0.005  # a keeper reads its server's frames at most this often (unless they pile up)
SUPERVISOR_ENV = "GMS_SUPERVISOR_PID"  # set by ``gms serve --devices`` for its children


def service_pid() -> int:
    """The process whose SIGTERM stops this service cleanly (``gms stop``): the
    ``gms serve --devices`` supervisor that started this keeper, else the keeper.
    The supervisor's word is taken only from the process that is our parent."""
    parent = os.getppid()
    return parent if os.environ.get(SUPERVISOR_ENV) == str(parent) else os.getpid()


@attrs.define
class Outcome:
    """How one server's conversation ended."""

    why: Leaving | None = None  # what the server said before it went
    ready: bool = False
    pid: int = 0


async def send(sock: trio.socket.SocketType, kind: str, body: dict | None = None, fds=()) -> None:
    data = memoryview(frames.encode_frame(kind, body, len(fds)))
    sent = await sock.sendmsg([data], frames.ancillary_for(fds))
    while sent < len(data):
        sent += await sock.send(data[sent:])


async def recv(sock: trio.socket.SocketType, reader: frames.FrameReader, lazy: bool = False) -> frames.Frame:
    """The next frame.  ``lazy``: after a read that did not fill the buffer, let
    the server's frames gather a moment before reading again.  What the kernel
    took is safe in this socket's queue whoever dies, so a keeper that wakes once
    per batch instead of once per event costs the server nothing but a little
    of the socket's buffer (on a small machine, a wake-up per event cost a
    request tens of microseconds)."""
    while True:
        frame = reader.next_frame()
        if frame is not None:
            return frame
        space = reader.space()  # the scratch buffer, or the rest of a big frame: no copy of its own
        n, ancillary, flags, _ = await sock.recvmsg_into([space], frames.ANCILLARY_BYTES)
        fds = frames.received_fds(ancillary)
        frames.check_flags(flags, fds)
        big = reader.in_big_frame  # (before it is whole: a big frame is read on at once)
        reader.wrote(n, fds)
        if lazy and not big and 0 < n < len(space) and not fds:
            await trio.sleep(BATCH_S)


async def hand_back(sock: trio.socket.SocketType, store: Store, hello: frames.Frame) -> None:
    body, keyed = store.handback()
    body.update(keeper_pid=os.getpid(), service_pid=service_pid())  # what `gms status` names
    await send(sock, Say.HANDBACK, body)
    for start in range(0, len(keyed), frames.MAX_FDS):
        batch = keyed[start : start + frames.MAX_FDS]
        await send(sock, Say.FDS, {"keys": [k for k, _ in batch]}, [fd for _, fd in batch])
    await send(sock, Say.END)


async def converse(
    sock: trio.socket.SocketType, store: Store, pid: int, on_ready=lambda: None,
    reader: frames.FrameReader | None = None, hello: frames.Frame | None = None, on_taking=lambda: None,
) -> Outcome:
    """One server, hello to EOF (``hello``: read already, with ``reader``).
    ``on_taking``: a spare said it has the hand-back."""
    outcome = Outcome(pid=pid)
    reader = reader or frames.FrameReader()
    try:
        if hello is None:
            hello = await recv(sock, reader)
        if hello.kind != Say.HELLO:
            raise frames.FrameError(f"a server began with {hello.kind!r}, not hello")
        outcome.pid = hello.body.get("pid", pid)
        await hand_back(sock, store, hello)
        while True:
            frame = await recv(sock, reader, lazy=True)
            said = store.apply(frame)
            if said is Say.RELEASED:  # its fds are closed: a session waiting for memory may try again
                await send(sock, Say.RELEASED)
            elif said is Say.READY:  # (again after a stopping: a take-over that did not happen)
                outcome.ready, outcome.why = True, None
                on_ready()
            elif said is Say.TAKING:
                on_taking()
            elif said is Say.STOPPING:
                outcome.why = Leaving.read(frame.body.get("why", ""))
    except frames.ChannelClosed:
        pass
    except (OSError, frames.FrameError, ValueError) as exc:
        log.warning("the conversation with server pid %d broke: %s", outcome.pid, exc)
    finally:
        reader.close()
    return outcome


def describe(code: int | None) -> str:
    if code is None:
        return "its connection to the keeper closed"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
