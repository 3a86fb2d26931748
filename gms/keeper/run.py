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

import trio

from .. import sdnotify
from ..handover import frames
from ..peer import UntrustedPeer, own_uids, peer_of, require_peer
from .conversation import Outcome, converse, describe, recv, send
from .spare import SPARE_AFTER_S, SPARE_WAIT_S, Spare, spawn, stopped
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
    if why == "taken-over":
        store.drop_node(keep_listener=False)
        store.retired = True
    elif why in ("shutdown", "refused"):
        store.drop_node(keep_listener=False)
    else:
        if not outcome.ready and store.base is not None and failed_by_itself(code):
            store.failed_resumes += 1
        if why == "left":
            reason = f"it left its node to the keeper on a signal ({reason})"
        elif why == "unresumable":
            reason = f"it could not serve the node ({reason})"
        store.old_pid, store.reason = outcome.pid, reason


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


async def keep_spawning(server_argv: list[str], adopted: socket.socket | None = None, *,
                        spare: bool = True, spare_after: float = SPARE_AFTER_S) -> int:
    """Start ``server_argv`` (plus ``--keeper-fd N``) again and again; returns the exit code.

    ``adopted``: the channel of a server already running, whose keeper died and
    which started this one in its place (``gms keeper --adopt-fd``): it is kept
    first, and the servers after it are this keeper's children.  ``spare``:
    ``spare_after`` seconds after a server served, the next one is started and
    stands by (:class:`Spare`); one that dies standing by is not replaced
    until a server serves again."""
    store, _ = open_store()
    stopping = trio.Event()
    backoff = 0.0
    notified_ready = False
    standing: Spare | None = None
    spare_asked = False  # a spare will be started (after spare_after)
    generation = 0  # servers started: a spare is made only while the one that served is still the one
    serving = None  # the server process the node is with now
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        try:
            async with trio.open_nursery() as nursery:

                async def on_signal() -> None:
                    async for signum in signals:
                        if signum == signal.SIGHUP:  # `systemctl reload`: the next server reads the policy again
                            if serving is not None and serving.returncode is None:
                                log.info("SIGHUP: restarting server pid %d (it leaves the node to this keeper)",
                                         serving.pid)
                                with contextlib.suppress(ProcessLookupError):
                                    os.kill(serving.pid, signal.SIGTERM)
                            continue
                        log.info("%s: stopping the server (it releases every layout), then the keeper",
                                 signal.Signals(signum).name)
                        _notify("STOPPING=1")
                        stopping.set()
                        return

                async def make_spare(served: int) -> None:
                    nonlocal standing, spare_asked
                    await trio.sleep(spare_after)
                    if served != generation or stopping.is_set():  # that server is gone already
                        spare_asked = False
                        return
                    proc, sock = await spawn(server_argv)
                    standing, spare_asked = (candidate := Spare(proc, sock)), False
                    await candidate.stand_by()  # returns if it dies standing by, is taken or discarded
                    if not candidate.taken:
                        if standing is candidate:
                            standing = None
                        candidate.discard()
                        await candidate.proc.wait()  # reaped (killed: at once)

                nursery.start_soon(on_signal)
                code = 0
                while True:
                    started = trio.current_time()
                    generation += 1
                    reader = hello = taken = None
                    served = trio.Event()
                    if standing is not None and stopped(standing.proc.pid):
                        log.warning("the spare server pid %d is stopped: starting another", standing.proc.pid)
                        standing.discard()
                        standing = None
                    if standing is not None:  # started ahead: once it said hello, the node is handed to it
                        with trio.move_on_after(SPARE_WAIT_S):
                            await standing.settled.wait()
                        if standing is not None and not standing.settled.is_set():
                            log.warning("the spare server pid %d did not say hello in %.0f s: starting another",
                                        standing.proc.pid, SPARE_WAIT_S)
                            standing.discard()
                            standing = None
                        if standing is not None and standing.hello is not None:
                            taken, standing = standing, None
                            taken.taken = True
                            taken.scope.cancel()
                            proc, sock, reader, hello = taken.proc, taken.sock, taken.reader, taken.hello
                            log.info("the spare server pid %d takes the node", proc.pid)
                    if hello is not None:
                        pass
                    elif adopted is not None:  # a server that runs already: not our child
                        here, adopted = adopted, None
                        proc = _Adopted(peer_of(here).pid)
                        sock = trio.socket.from_stdlib_socket(here)
                        log.info("keeping the node of server pid %d, whose keeper is gone", proc.pid)
                    else:
                        proc, sock = await spawn(server_argv)
                    serving = proc

                    def on_ready() -> None:
                        nonlocal notified_ready, spare_asked
                        served.set()
                        if not notified_ready:
                            notified_ready = True
                            _notify(f"READY=1\nSTATUS=serving (server pid {proc.pid})")
                        else:
                            _notify(f"STATUS=serving (server pid {proc.pid})")
                        if spare and standing is None and not spare_asked:
                            spare_asked = True
                            nursery.start_soon(make_spare, generation)

                    async with trio.open_nursery() as inner:

                        async def ask_to_stop() -> None:
                            await stopping.wait()
                            try:
                                await send(sock, "stop")
                            except OSError:
                                pass
                            with trio.move_on_after(STOP_GRACE_S):
                                await proc.wait()
                            if proc.returncode is None:
                                log.error("the server ignored the stop; killing it")
                                proc.kill()

                        inner.start_soon(ask_to_stop)
                        if taken is not None:
                            inner.start_soon(taken.watch_taking, served)
                        outcome = await converse(sock, store, proc.pid, on_ready, reader=reader, hello=hello,
                                                 on_taking=taken.took.set if taken is not None else lambda: None)
                        code = await proc.wait()
                        inner.cancel_scope.cancel()
                    sock.close()
                    reason = describe(code)
                    settle(store, outcome, reason, code)
                    if stopping.is_set() or outcome.why == "shutdown":
                        store.close()
                        nursery.cancel_scope.cancel()
                        return 0 if stopping.is_set() else code
                    if outcome.why == "taken-over":
                        log.info("the server was taken over by another (its keeper holds the node now): done")
                        store.close()
                        nursery.cancel_scope.cancel()
                        return 0
                    if outcome.why == "refused" or code == EXIT_REFUSED:
                        log.error("the take-over did not happen; the old server serves on")
                        store.close()
                        nursery.cancel_scope.cancel()
                        return EXIT_REFUSED
                    if (code == EXIT_CONFIG or (code == 1 and not outcome.ready)) and not store.holds_node():
                        # The same options would fail again (a socket another server holds, say),
                        # and there is no node to keep for a server that could.
                        log.error("the server could not start (%s); not starting another", reason)
                        store.close()
                        nursery.cancel_scope.cancel()
                        return code
                    if outcome.why == "unresumable" or code == EXIT_CONFIG:
                        backoff = max(backoff, UNRESUMABLE_BACKOFF_S)  # a changed option or policy may serve it
                    if outcome.ready or trio.current_time() - started >= HEALTHY_AFTER_S:
                        backoff = 0.0  # it served: the next one starts at once (a crash loop backs off)
                    # Left on a signal, or a spare that stepped aside (its code was not the code in
                    # force) or did not take the node promptly: the next one starts at once.
                    at_once = outcome.why in ("left", "stale") or (taken is not None and taken.stalled)
                    delay = 0.0 if at_once else backoff
                    log.error(
                        "server pid %d ended (%s)%s; starting the next one %s with the node (%d fds kept)",
                        outcome.pid, reason, f", {outcome.why}" if outcome.why else "",
                        "now" if delay == 0 else f"in {delay:.1f} s", len(store.fds),
                    )
                    _notify(f"STATUS=restarting the server ({reason})")
                    if not at_once:
                        backoff = FIRST_BACKOFF_S if backoff == 0 else min(backoff * 2, MAX_BACKOFF_S)
                    with trio.move_on_after(delay):
                        await stopping.wait()
                    if stopping.is_set():
                        store.close()
                        nursery.cancel_scope.cancel()
                        return 0
        finally:
            if standing is not None:  # (killed: reaped at once)
                standing.discard()
                with trio.CancelScope(shield=True), trio.move_on_after(5):
                    await standing.proc.wait()


# -- listen ----------------------------------------------------------------------------


def bind_keeper_socket(path: str) -> socket.socket:
    """The keeper's own socket: mode 0600, a dead keeper's file replaced, a live one refused."""
    from ..server.server import clear_stale_socket, make_socket_dir

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
                    if hello is None or hello.kind != "hello":
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
                                 outcome.why or "no word: its state is kept for the next one")

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
                            await send(sock, "stop")
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
