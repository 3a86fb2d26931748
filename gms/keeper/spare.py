"""The keeper's spare: the next server, started ahead of need while one serves.

Starting a server process is most of a restart (an interpreter, gms's
modules, the backend); a spare has done all of it and said hello, and waits
(``standby``) holding nothing of the node, until the keeper hands it the
node of a server that died (docs/operations.md, "The spare").
"""

from __future__ import annotations

import logging
import socket

import attrs
import trio

from ..handover import frames
from ..handover.words import Say
from ..system.launch import child_env
from ..system.procs import stopped
from .conversation import describe, recv, send

log = logging.getLogger("gms.keeper")

SPARE_AFTER_S = 2.0  # a spare starts this long after its server served (not beside that server's start)
SPARE_WAIT_S = 10.0  # a server gone while its spare was still starting: how long the spare may still take
SPARE_TAKE_S = 3.0  # a spare handed the node says it has it (``taking``) within this long
STOPPED_S = 0.5  # a spare stopped this long (SIGSTOP, a debugger) before it serves is replaced
WATCH_S = 0.05


async def spawn(server_argv: list[str]):
    """A server process with one end of a socketpair (``--keeper-fd``); (process, our end)."""
    here, there = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    argv = [*server_argv, "--keeper-fd", str(there.fileno())]
    try:
        proc = await trio.lowlevel.open_process(argv, pass_fds=(there.fileno(),), env=child_env())
    except BaseException:
        here.close()
        raise
    finally:
        there.close()
    return proc, trio.socket.from_stdlib_socket(here)


@attrs.define(eq=False)
class Spare:
    """The next server, started ahead of need while one serves: its interpreter
    up, its modules imported, its backend open (no CUDA context: the server
    makes none to adopt), its hello said; told ``standby``, it waits for the
    node.  A SIGKILLed server is followed by one that only has to be handed
    the node (docs/operations.md, "Restarts")."""

    proc: object
    sock: trio.socket.SocketType
    reader: frames.FrameReader = attrs.Factory(frames.FrameReader)
    hello: frames.Frame | None = None
    settled: trio.Event = attrs.Factory(trio.Event)  # its hello came, or it went
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    taken: bool = False  # it is the server now
    took: trio.Event = attrs.Factory(trio.Event)  # handed the node, it said ``taking``
    stalled: bool = False  # handed the node, it did not take it promptly: killed

    async def stand_by(self) -> None:
        """Read its hello, answer ``standby``; return if it dies while it waits."""
        with self.scope:
            try:
                hello = await recv(self.sock, self.reader)
                if hello.kind != Say.HELLO:
                    raise frames.FrameError(f"a spare began with {hello.kind!r}, not hello")
                await send(self.sock, Say.STANDBY)
                self.hello = hello
            except (OSError, frames.FrameError) as exc:
                log.warning("the spare server pid %d went before it could stand by: %s", self.proc.pid, exc)
            finally:
                self.settled.set()
            await self.proc.wait()
            self.hello = None
            log.warning("the spare server pid %d ended while standing by (%s)", self.proc.pid,
                        describe(self.proc.returncode))

    async def watch_taking(self, served: trio.Event) -> None:
        """Handed the node, it must say so within SPARE_TAKE_S and never stand
        stopped for STOPPED_S until it serves (``served``); else it is killed
        (``stalled``) and the keeper starts a server from cold at once.  A spare
        is handed the node the moment its server dies: nothing is served until
        it serves, so one that is not running must not keep it."""
        start = trio.current_time()
        since = None  # when it was last seen stopped, if it still is
        while not served.is_set():
            now = trio.current_time()
            since = (since or now) if stopped(self.proc.pid) else None
            if not self.took.is_set() and now - start > SPARE_TAKE_S:
                why = f"did not take the node within {SPARE_TAKE_S:g} s"
            elif since is not None and now - since >= STOPPED_S:
                why = f"stood stopped for {STOPPED_S:g} s"
            else:
                await trio.sleep(WATCH_S)
                continue
            log.warning("the spare server pid %d %s: killing it, and starting a server from cold",
                        self.proc.pid, why)
            self.stalled = True
            self.proc.kill()
            return

    def discard(self) -> None:
        """Not wanted (the keeper stops, or it died): nothing of the node is in it."""
        self.scope.cancel()
        if self.proc.returncode is None:
            self.proc.kill()
        self.sock.close()
        self.reader.close()
