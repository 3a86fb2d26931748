"""How a server takes over a node, hands it on, and goes on after a take-over that did not happen.

The parts of ``Server`` (``gms.server.server``) that only restarts and
take-overs need, as functions of the server: taking a handed node (resume,
say what was discarded, give the keeper what it must keep, commit a
take-over), starting sessions from their images (a handed connection, or
one of this server's own after a refused take-over; each counted in by
admission, never refused), watching the keeper, and the small things a
restart needs (a ready file, a metrics port the old server may still hold).
Accepting is admission's loop (``gms.server.edge.admission.serve``), which hands
each connection's socket to its session: a parked session's outlives its task.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import sys

import attrs
import trio

from ...fsm.events import StateDiscarded
from ...handover.image import StateImage
from ...handover.words import Leaving, Say
from ...system import files
from ...system.peer import peer_of
from ...wire.connection import PRE_SESSION_MAX_FRAME_BYTES, ServerConnection
from ..config import ServerConfig
from ..edge.netio import Channel
from ..metrics import Metrics
from ..service.core import ServiceCore
from ..service.lock_queues import Waiter
from ..service.session import granted_as
from .mirror import DRAIN_S, LISTENER, KeeperGone, memory_key
from .resume import Handed, TakeOverRefused, resume_core
from .startup import Start, connect_keeper, server_argv, spawn_keeper
from .takeover import abort, commit, node_image, session_image

# Restarts and take-overs are rare and each line matters: not under "gms.server",
# whose repeated lines are rate-limited (gms.server.edge.ratelimit).
log = logging.getLogger("gms.server.restart")

KEEPER_RETRY_S = 0.2  # a keeper gone: the first try for another after this, doubling up to ...
MAX_KEEPER_RETRY_S = 5.0  # ... this


async def take_the_node(server, core: ServiceCore, start: Start) -> None:
    """A handed node adopted and resumed (a take-over committed), or a
    discarded one said so; then the keeper is given what it must keep."""
    handed, offer = start.handed, start.offer
    if handed is not None:
        try:
            await resume_core(core, handed)
        except TakeOverRefused as refusal:
            if offer is None:
                raise  # a restart that cannot resume: the keeper starts the next one over
            abort(offer.sock, str(refusal))
            handed.close_conn_fds()
            refused(server)
            raise
    if start.discarded is not None:
        d = start.discarded
        core.ledger.record([StateDiscarded(0, d.reason, d.saved_to, d.old_pid, layout="")], by_server=True)
    link = server.link
    if link is not None:
        link.attach(
            lambda: keeper_image(server), lambda: held_fds(server), provisional=offer.old_pid if offer else None,
            wants_ack=server.signal.watched, on_released=server.signal.released,
            # The events the base holds that the keeper never had (this server's, logged
            # before it attached: a first SERVER_STARTED, a SERVER_RESUMED): its history.
            history=core.log.since(handed.kept_seq if handed is not None else 0),
            kept=handed.kept if handed is not None else None,
        )
        # Before serving (blocking is fine): a take-over commits only once its keeper
        # holds the node, so that nothing is lost should this server die right after.
        if not link.drain(server.config.handover_timeout) and offer is not None:
            abort(offer.sock, "this server's keeper did not take the node in time")
            handed.close_conn_fds()
            refused(server)
            raise TakeOverRefused("this server's keeper did not take the node in time")
    if offer is not None:
        try:
            commit(offer, server.config.handover_timeout)
        except TakeOverRefused:
            refused(server)
            raise
        if server.link is not None:
            server.link.confirm()
        log.info("took over from pid %d (state version %d)", offer.old_pid, offer.image.version)


def refused(server) -> None:
    """A take-over that did not happen: hold nothing of the old server's."""
    server.left_as = Leaving.REFUSED
    if server.link is not None:
        server.link.stopping(Leaving.REFUSED)
        server.link.drain(DRAIN_S)
        server.link = None


def keeper_image(server) -> StateImage:
    """The keeper's base: the node, without sessions (a crash closes them)."""
    return node_image(server, {}, sessions=False)


def held_fds(server) -> list[tuple[str, int]]:
    """(key, fd) of everything the keeper must keep: the socket, every allocation and host copy."""
    held = [(LISTENER, server.listener.fileno())]
    for tier, memory in server.core.ledger.tiers.items():
        held += [(memory_key(tier.value, i), fd) for i, fd in memory.held_fds()]
    return held


def handed_sockets(start: Start) -> int:
    """Clients' sockets a take-over handed over and no session holds yet (they are
    counted by their sessions' tickets when those start: succession.spawn)."""
    return 0 if start.handed is None else len(start.handed.conn_fds)


def resume_sessions(server) -> None:
    """A take-over that did not happen: every parked session goes on where it stopped."""
    paused = server.quiesce.paused_at
    parked = server.quiesce.resume()
    now = trio.current_time()
    images = [(session_image(session, now, paused), session.channel) for session in parked.values()]
    order = server.core.queues.order()
    for layout, conns in order:
        for conn in conns:
            server.core.queues.remove(layout, conn)
    spawn(server, images, order)


def spawn_handed(server, handed: Handed) -> None:
    """The handed connections' sessions go on here; a session whose socket did
    not come (or whose client left meanwhile) is a disconnect."""
    images = []
    imaged = {conn_image.conn for conn_image in handed.image.conns}
    for conn in sorted(set(server.core.state.sessions) - imaged):  # a session with no connection: gone
        server.core.disconnect(conn)
    for conn_image in handed.image.conns:
        fd = handed.conn_fds.pop(conn_image.conn, None)
        if fd is None:  # the old server had no socket for it: it is gone
            server.core.disconnect(conn_image.conn)
            continue
        try:
            channel = Channel(socket.socket(fileno=fd))
        except OSError as exc:  # the client left during the hand-over
            log.info("conn %d left during the take-over: %s", conn_image.conn, exc)
            server.core.disconnect(conn_image.conn)
            continue
        images.append((conn_image, channel))
    for fd in handed.conn_fds.values():
        os.close(fd)
    spawn(server, images, [(layout, list(conns)) for layout, conns in handed.image.queues])


def spawn(server, images, order) -> None:
    """Sessions going on from images: the lock queues rebuilt in their order
    (all at once, then granted: a partial queue could grant out of turn)."""
    sessions = {}
    tickets = {}
    for image, channel in images:
        p = image.protocol
        protocol = ServerConnection.thaw(server.config.max_frame_bytes, attrs.asdict(p), PRE_SESSION_MAX_FRAME_BYTES)
        left = None if image.first_request_left_ms is None else image.first_request_left_ms / 1000
        session = server.new_session(channel, conn=image.conn, protocol=protocol, first_request_left=left)
        # Counted in, never judged: these clients were served a moment ago (admission.enter).
        tickets[image.conn] = server.admission.enter(channel.peer)
        pending = image.pending
        if pending is not None:
            granted = None
            if pending.granted:
                layout = server.core.state.sessions[image.conn].layout
                granted = granted_as(image.conn, layout, pending.granted, pending.restore)
            left = math.inf if pending.timeout_left_ms is None else pending.timeout_left_ms / 1000
            session.go_on(pending.kind, requested=pending.requested, timeout_left=left, granted=granted)
        sessions[image.conn] = session
    for layout, conns in order:
        for conn in conns:
            session = sessions.get(conn)
            if session is None or session.waits.lock is None:
                continue
            waiter = Waiter(session.waits.lock.requested, session.on_grant, session.alive, session.turned_away)
            server.core.queues.add(layout, conn, waiter)
    for layout, _ in order:
        server.core.ledger.grant(layout)
    for conn, session in sessions.items():
        server.start_session(session, tickets[conn])


async def watch_keeper(server) -> None:
    """The keeper asks for a clean stop (``stop``), or goes away.  Then the
    server serves on and finds another: it connects again to a keeper in
    another container (``--keeper-socket``: the container restarted), or
    starts one of its own in the place of the one that started it (killed,
    say), which keeps the node and starts the next server when this one
    ends.  Until the new keeper has the node a crash loses it: ``gms status``
    and the metrics say so (``keeper: gone``)."""
    link = server.link
    while True:
        said = await link.watch()
        if said is Say.STOP:
            log.info("the keeper asks this server to stop")
            server.stop()
            return
        log.error("the keeper is gone: finding another (until then a crash loses the node)")
        await find_keeper(server)


async def find_keeper(server, first_delay: float = KEEPER_RETRY_S) -> None:
    """A keeper again, and the node given to it (its base made in the background)."""
    link, config = server.link, server.config
    delay = first_delay
    while True:
        try:
            if config.keeper_socket is not None:
                sock = await trio.to_thread.run_sync(connect_keeper, config.keeper_socket)
            else:
                sock = spawn_keeper(server_argv(sys.argv[1:]))
            link.use(sock)
            handback = await trio.to_thread.run_sync(link.hello, server.core.device.uuid)
        except (OSError, KeeperGone) as exc:  # (UntrustedPeer is an OSError: said, and tried again)
            link.close()
            log.warning("no keeper yet (%s): trying again in %.1f s", exc, delay)
            await trio.sleep(delay)
            delay = min(delay * 2, MAX_KEEPER_RETRY_S)
            continue
        # Whatever it kept is not this node's to resume (this server serves it): its fds go.
        for fd in [*handback.fds.values(), *([handback.listener] if handback.listener is not None else [])]:
            os.close(fd)
        link.attach(
            lambda: keeper_image(server), lambda: held_fds(server),
            wants_ack=server.signal.watched, on_released=server.signal.released, now=False,
        )
        link.ready()
        log.warning("a keeper holds the node again (pid %d)", peer_of(link.sock).pid)
        return


async def serve_retired(server, task_status) -> None:
    """This keeper's node was taken over by another server's: serve nothing (a
    container restarted in an old pod waits there for the pod to go)."""
    log.info("this keeper's server was taken over by another: serving nothing until stopped")
    task_status.started(server)
    await trio.sleep_forever()


def inode(path: str) -> int | None:
    """The socket file's inode (a handed socket: it is removed at the end only if still ours)."""
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def ready_file(path: str | None, ready: bool) -> None:
    """Created once serving (a probe tells this server's serving from another's), removed at the end.
    A file that cannot be written (a full disk, say) is said, never fatal: the node matters more."""
    if path is None:
        return
    folder, name = os.path.split(os.path.abspath(path))
    try:
        if ready:
            with files.write_new(folder, name, 0o644) as out:  # (no link followed: gms.system.files)
                out.write(f"{os.getpid()}\n")
        else:
            files.remove(folder, name)
    except OSError as exc:
        log.error("the ready file %s could not be %s: %s", path, "written" if ready else "removed", exc)


async def serve_metrics(metrics: Metrics, config: ServerConfig) -> int:
    """After a take-over the old server may hold the port a moment longer: retry."""
    for attempt in range(50):
        try:
            return metrics.serve(config.metrics_port, config.metrics_host)
        except OSError as exc:
            if attempt == 49:
                raise
            log.info("metrics port busy (%s): retrying", exc)
            await trio.sleep(0.1)
    raise AssertionError("unreachable")
