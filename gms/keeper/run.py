"""The keeper process: holds what must outlive a server, and starts the next one.

Two ways to run it:

* **spawn** (``gms serve``, the default): the keeper starts the server as its
  child, with one end of a socketpair (``--keeper-fd``), and starts the next
  one when it dies: at once if it had served (or left on a signal); a server
  that dies before it serves (a crash loop) waits for a backoff that doubles
  from half a second to 30 s.  SIGTERM/SIGINT ask the server to
  stop cleanly (it releases every layout) and then the keeper exits; SIGHUP
  restarts the server (the next one serves the node, reading the policy again).
* **listen** (``gms keeper --keeper-socket PATH``): servers in another
  container connect to it (Kubernetes: a pod's keeper and server containers
  share the folder); one store per device, one server per device at a time.

The conversation (``conversation.py``; ``gms.server.restart.mirror`` has the
server's side): the server says hello, the keeper hands back what it holds,
the server mirrors every change until it goes (EOF).  In spawn mode the next
server is started ahead of need and stands by (``spare.py``).  The keeper never parses a state: it needs no
core and no CUDA, so nothing a server does can crash it.  Under systemd it
also pushes everything into systemd's fd store (``gms.keeper.systemd``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import stat

import attrs
import trio

from ..handover import frames
from ..handover.words import Leaving, Say
from ..system import sdnotify
from ..system.paths import clear_stale_socket, make_socket_dir
from ..system.peer import UntrustedPeer, own_uids, peer_of, require_peer
from ..system.procs import stopped
from .conversation import Outcome, converse, describe, recv, send
from .spare import SPARE_AFTER_S, SPARE_WAIT_S, Spare, spawn
from .store import Store
from .systemd import SystemdMirror, restore

log = logging.getLogger("gms.keeper")

FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
UNRESUMABLE_BACKOFF_S = 5.0  # a server that could not serve the kept node: the next tries after this
HEALTHY_AFTER_S = 60.0
STOP_GRACE_S = 30.0
EXIT_FATAL = 70  # EX_SOFTWARE: the server failed (a broken invariant, a bug)
EXIT_CONFIG = 78
EXIT_REFUSED = 75  # EX_TEMPFAIL: a take-over refused; the old server serves on


# Deaths that say the server itself failed (what a journal that breaks it would
# cause), as opposed to being killed or stopped from outside.
_CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE}


# A server that said so on leaving left its node, and all it sent before, to the
# keeper on purpose: the next one starts at once, with no gap in the log.
LEFT_WHOLE = (Leaving.LEFT, Leaving.STALE)


def failed_by_itself(code: int | None) -> bool:
    """Did a server that exited with ``code`` fail on its own (a fatal error or a
    crash signal)?  A kill (SIGKILL, SIGTERM), a configuration it could not use,
    or an unknown end (a server in another container) is not its fault."""
    if code is None:
        return False
    if code < 0:
        return -code in _CRASH_SIGNALS
    return code == EXIT_FATAL


def settle(store: Store, outcome: Outcome, reason: str, code: int | None = None) -> None:
    """What the keeper keeps after a server went, by how it went.  It lets go of
    a node only when told to (a shutdown, a take-over): whatever else happened,
    the node waits for the next server."""
    why = outcome.why
    if why is Leaving.TAKEN_OVER:
        store.drop_node(keep_listener=False)
        store.retired = True
    elif why in (Leaving.SHUTDOWN, Leaving.REFUSED):
        store.drop_node(keep_listener=False)
    else:
        if not outcome.ready and store.base is not None and failed_by_itself(code):
            store.failed_resumes += 1
        if why is Leaving.LEFT:
            reason = f"it left its node to the keeper on a signal ({reason})"
        elif why is Leaving.UNRESUMABLE:
            reason = f"it could not serve the node ({reason})"
        elif why is Leaving.STALE:
            reason = f"its code was not gms's on disk now ({reason})"
        store.old_pid, store.reason = outcome.pid, reason
        # Its STOPPING came after everything it sent: nothing of its log was lost.
        store.whole = why in LEFT_WHOLE


class _Adopted:
    """A server this keeper did not start: it cannot wait for it, nor learn how it
    ended (its channel closing says it did).  Killed only if asked to stop and it
    does not."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    async def wait(self) -> None:
        """Until the process is gone (how it ended is not ours to know: None)."""
        while True:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                break
            except PermissionError:
                pass
            await trio.sleep(0.05)
        self.returncode = 0  # (gone; its code went to its parent)

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# -- systemd ---------------------------------------------------------------------------


def open_store() -> tuple[Store, SystemdMirror | None]:
    """A store, given back by systemd if it kept one, mirrored into its fd store if it runs us."""
    if not sdnotify.enabled():
        return Store(), None
    store, mirror = restore(sdnotify.listen_fds())
    mirror.attach(store)
    if store.fds or store.base is not None:
        log.info("systemd handed back %d fds and %s", len(store.fds),
                 "a journal" if store.base is not None else "no journal")
    return store, mirror


def _notify(state: str) -> None:
    try:
        sdnotify.notify(state)
    except OSError as exc:
        log.warning("sd_notify: %s", exc)


# -- spawn -----------------------------------------------------------------------------


@attrs.frozen
class Again:
    """Start the next server after ``delay`` seconds; ``backoff``: the one after that, if it fails too."""

    delay: float
    backoff: float


@attrs.frozen
class Done:
    """The keeper ends with ``code``."""

    code: int
    why: str


def after_server(
    outcome: Outcome, code: int | None, *, holds_node: bool, stalled: bool, backoff: float, ran_s: float,
) -> Again | Done:
    """What the keeper does once a server is gone (pure: the policy in one place).

    It ends when told to (a clean stop; a take-over, done or refused), and when
    a server could not start and there is no node to keep for one that could.
    Otherwise the next server starts: at once after a server that served (or
    left on a signal, or a spare that stepped aside or stalled), else after a
    back-off that doubles from FIRST_BACKOFF_S to MAX_BACKOFF_S (a crash loop),
    at least UNRESUMABLE_BACKOFF_S after one that could not serve the node (a
    changed option or policy may)."""
    why = outcome.why
    if why is Leaving.SHUTDOWN:
        return Done(code or 0, "the server stopped")
    if why is Leaving.TAKEN_OVER:
        return Done(0, "the server was taken over by another (its keeper holds the node now)")
    if why is Leaving.REFUSED or code == EXIT_REFUSED:
        return Done(EXIT_REFUSED, "the take-over did not happen; the old server serves on")
    if (code == EXIT_CONFIG or (code == 1 and not outcome.ready)) and not holds_node:
        # The same options would fail again (a socket another server holds, say).
        return Done(code, "the server could not start, and there is no node to keep")
    if why is Leaving.UNRESUMABLE or code == EXIT_CONFIG:
        backoff = max(backoff, UNRESUMABLE_BACKOFF_S)
    if outcome.ready or ran_s >= HEALTHY_AFTER_S:
        backoff = 0.0
    if why in LEFT_WHOLE or stalled:
        return Again(0.0, backoff)
    return Again(backoff, FIRST_BACKOFF_S if backoff == 0 else min(backoff * 2, MAX_BACKOFF_S))


class SpawningKeeper:
    """``gms serve``'s keeper: it starts ``server_argv`` (plus ``--keeper-fd N``)
    again and again, each server handed the node the last one left.

    ``adopted``: the channel of a server already running, whose keeper died and
    which started this one in its place (``gms keeper --adopt-fd``): it is kept
    first, and the servers after it are this keeper's children.  ``spare``:
    ``spare_after`` seconds after a server served, the next one is started and
    stands by (:class:`Spare`); one that dies standing by is not replaced
    until a server serves again."""

    def __init__(self, server_argv: list[str], adopted: socket.socket | None, spare: bool, spare_after: float) -> None:
        self.server_argv = server_argv
        self.adopted = adopted
        self.spare, self.spare_after = spare, spare_after
        self.store, _ = open_store()
        self.stopping = trio.Event()
        self.standing: Spare | None = None  # the spare standing by
        self.spare_asked = False  # a spare will be started (after spare_after)
        self.generation = 0  # servers started: a spare is made only while the one that served is still the one
        self.serving = None  # the server process the node is with now
        self.notified_ready = False
        self.backoff = 0.0
        self._nursery: trio.Nursery | None = None

    async def run(self) -> int:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            try:
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    nursery.start_soon(self._on_signals, signals)
                    code = await self._keep()
                    nursery.cancel_scope.cancel()
                    return code
            finally:
                self.store.close()
                if self.standing is not None:  # (killed: reaped at once)
                    self.standing.discard()
                    with trio.CancelScope(shield=True), trio.move_on_after(5):
                        await self.standing.proc.wait()

    async def _keep(self) -> int:
        while True:
            started = trio.current_time()
            outcome, code, taken = await self._one_server()
            reason = describe(code)
            settle(self.store, outcome, reason, code)
            if self.stopping.is_set():
                return 0
            then = after_server(
                outcome, code, holds_node=self.store.holds_node(), stalled=taken is not None and taken.stalled,
                backoff=self.backoff, ran_s=trio.current_time() - started,
            )
            if isinstance(then, Done):
                (log.info if then.code == 0 else log.error)("%s (%s): done", then.why, reason)
                return then.code
            self.backoff = then.backoff
            (log.info if self.store.whole else log.error)(  # a restart asked for is no error
                "server pid %d ended (%s)%s; starting the next one %s with the node (%d fds kept)",
                outcome.pid, reason, f", {outcome.why.value}" if outcome.why else "",
                "now" if then.delay == 0 else f"in {then.delay:.1f} s", len(self.store.fds),
            )
            _notify(f"STATUS=restarting the server ({reason})")
            with trio.move_on_after(then.delay):
                await self.stopping.wait()
            if self.stopping.is_set():
                return 0

    async def _one_server(self) -> tuple[Outcome, int | None, Spare | None]:
        """The next server (the spare standing by, the adopted one, or a new one),
        from its hello to its end: (how it ended, its exit code, the spare taken)."""
        self.generation += 1
        served = trio.Event()
        standing = self._take_spare()
        if standing is not None:  # started ahead: once it said hello, the node is handed to it
            await self._settle_spare(standing)
        taken = self._take_spare(ready=True)
        reader = hello = None
        if taken is not None:
            proc, sock, reader, hello = taken.proc, taken.sock, taken.reader, taken.hello
            log.info("the spare server pid %d takes the node", proc.pid)
        elif self.adopted is not None:  # a server that runs already: not our child
            here, self.adopted = self.adopted, None
            proc, sock = _Adopted(peer_of(here).pid), trio.socket.from_stdlib_socket(here)
            log.info("keeping the node of server pid %d, whose keeper is gone", proc.pid)
        else:
            proc, sock = await spawn(self.server_argv)
        self.serving = proc
        async with trio.open_nursery() as inner:
            inner.start_soon(self._ask_to_stop, sock, proc)
            if taken is not None:
                inner.start_soon(taken.watch_taking, served)
            outcome = await converse(
                sock, self.store, proc.pid, lambda: self._on_ready(proc, served), reader=reader, hello=hello,
                on_taking=taken.took.set if taken is not None else lambda: None,
            )
            code = await proc.wait()
            inner.cancel_scope.cancel()
        sock.close()
        return outcome, code, taken

    def _take_spare(self, ready: bool = False) -> Spare | None:
        """The spare standing by, if there is one to hand the node to (``ready``:
        its hello said); a stopped one is discarded at once."""
        standing = self.standing
        if standing is not None and stopped(standing.proc.pid):
            log.warning("the spare server pid %d is stopped: starting another", standing.proc.pid)
            standing.discard()
            self.standing = standing = None
        if standing is None or not ready:
            return standing
        self.standing = None
        if standing.hello is None:
            return None
        standing.taken = True
        standing.scope.cancel()
        return standing

    async def _settle_spare(self, standing: Spare) -> None:
        """A spare still starting: wait for its hello a while (a server gone early)."""
        with trio.move_on_after(SPARE_WAIT_S):
            await standing.settled.wait()
        if self.standing is standing and not standing.settled.is_set():
            log.warning("the spare server pid %d did not say hello in %.0f s: starting another",
                        standing.proc.pid, SPARE_WAIT_S)
            standing.discard()
            self.standing = None

    def _on_ready(self, proc, served: trio.Event) -> None:
        served.set()
        if not self.notified_ready:
            self.notified_ready = True
            _notify(f"READY=1\nSTATUS=serving (server pid {proc.pid})")
        else:
            _notify(f"STATUS=serving (server pid {proc.pid})")
        if self.spare and self.standing is None and not self.spare_asked:
            self.spare_asked = True
            self._nursery.start_soon(self._make_spare, self.generation)

    async def _make_spare(self, served: int) -> None:
        await trio.sleep(self.spare_after)
        if served != self.generation or self.stopping.is_set():  # that server is gone already
            self.spare_asked = False
            return
        proc, sock = await spawn(self.server_argv)
        self.standing, self.spare_asked = (candidate := Spare(proc, sock)), False
        await candidate.stand_by()  # returns if it dies standing by, is taken or discarded
        if not candidate.taken:
            if self.standing is candidate:
                self.standing = None
            candidate.discard()
            await candidate.proc.wait()  # reaped (killed: at once)

    async def _ask_to_stop(self, sock, proc) -> None:
        await self.stopping.wait()
        try:
            await send(sock, Say.STOP)
        except OSError:
            pass
        with trio.move_on_after(STOP_GRACE_S):
            await proc.wait()
        if proc.returncode is None:
            log.error("the server ignored the stop; killing it")
            proc.kill()

    async def _on_signals(self, signals) -> None:
        async for signum in signals:
            if signum == signal.SIGHUP:  # `systemctl reload`: the next server reads the policy again
                serving = self.serving
                if serving is not None and serving.returncode is None:
                    log.info("SIGHUP: restarting server pid %d (it leaves the node to this keeper)", serving.pid)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(serving.pid, signal.SIGTERM)
                continue
            log.info("%s: stopping the server (it releases every layout), then the keeper",
                     signal.Signals(signum).name)
            _notify("STOPPING=1")
            self.stopping.set()
            return


async def keep_spawning(server_argv: list[str], adopted: socket.socket | None = None, *,
                        spare: bool = True, spare_after: float = SPARE_AFTER_S) -> int:
    """Start ``server_argv`` again and again (:class:`SpawningKeeper`); returns the exit code."""
    return await SpawningKeeper(server_argv, adopted, spare, spare_after).run()


# -- listen ----------------------------------------------------------------------------


def bind_keeper_socket(path: str) -> socket.socket:
    """The keeper's own socket: mode 0600, a dead keeper's file replaced, a live one refused."""
    make_socket_dir(os.path.dirname(os.path.abspath(path)))
    clear_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    sock.listen(64)
    return sock


async def keep_listening(path: str) -> int:
    """Serve servers that connect to ``path``; one store per device they name."""
    stores: dict[str, Store] = {}
    locks: dict[str, trio.Lock] = {}
    conversations: dict[str, trio.socket.SocketType] = {}
    listener = trio.socket.from_stdlib_socket(bind_keeper_socket(path))
    inode = os.stat(path).st_ino
    log.info("keeping for servers that connect to %s", path)
    _notify("READY=1\nSTATUS=waiting for servers")
    try:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:

                async def one(sock: trio.socket.SocketType) -> None:
                    try:  # it will hand this server every fd it keeps: only one of ours
                        peer = require_peer(sock, own_uids(), "a server connecting")
                    except UntrustedPeer as refused:
                        log.warning("refusing %s", refused)
                        sock.close()
                        return
                    except OSError:
                        sock.close()
                        return
                    reader = frames.FrameReader()
                    try:
                        with trio.fail_after(30):
                            hello = await recv(sock, reader)
                    except (OSError, frames.FrameError, trio.TooSlowError):
                        hello = None
                    if hello is None or hello.kind != Say.HELLO:
                        reader.close()
                        sock.close()
                        return
                    device = str(hello.body.get("device", ""))
                    lock = locks.setdefault(device, trio.Lock())
                    async with lock:
                        store = stores.setdefault(device, Store())
                        conversations[device] = sock
                        outcome = await converse(sock, store, peer.pid, reader=reader, hello=hello)
                        conversations.pop(device, None)
                        sock.close()
                        settle(store, outcome, "its connection to the keeper closed")
                        log.info("server pid %d of device %s went (%s)", outcome.pid, device or "?",
                                 outcome.why.value if outcome.why else "no word: its state is kept for the next one")

                async def accept() -> None:
                    while True:
                        sock, _ = await listener.accept()
                        nursery.start_soon(one, sock)

                nursery.start_soon(accept)
                async for signum in signals:
                    log.info("%s: asking %d servers to stop, then stopping", signal.Signals(signum).name,
                             len(conversations))
                    for sock in list(conversations.values()):
                        try:
                            await send(sock, Say.STOP)
                        except OSError:
                            pass
                    with trio.move_on_after(STOP_GRACE_S):
                        while conversations:
                            await trio.sleep(0.05)
                    nursery.cancel_scope.cancel()
                    break
    finally:
        listener.close()
        try:
            if os.stat(path).st_ino == inode and stat.S_ISSOCK(os.stat(path).st_mode):
                os.unlink(path)
        except FileNotFoundError:
            pass
        for store in stores.values():
            store.close()
    return 0
