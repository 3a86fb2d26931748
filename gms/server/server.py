"""The listener: one Unix socket per GPU, one nursery, one task per connection.

``Server.serve`` binds (or takes the socket and the node from its keeper, or
from a server it takes over: ``gms.server.restart.startup``), reports itself
started, and accepts until cancelled; on the way out
every connection task is cancelled (each unwinds its lock), the memory is
released on its lanes and the socket file removed.  Two ways out leave
everything as it is instead: a take-over that committed (another server
holds the node now) and, under a keeper, a signal (the keeper holds the node
and starts the next server).  ``run_server`` is the process entry, stopped
by SIGTERM or SIGINT.
"""

from __future__ import annotations

import logging
import os
import signal
import socket

import trio

from ..cuda import MemoryBackend, open_backend, open_host_tier
from ..fsm import host_room
from ..handover.words import Leaving
from ..store import EventLog
from ..system.paths import clear_stale_socket, make_socket_dir
from ..system.peer import Peer
from .assembly import Node, assemble
from .config import DEFAULT_STOCK_BYTES, ServerConfig
from .edge import ratelimit
from .edge.admission import LISTEN_BACKLOG, Admission, FdBudget, Ticket, open_admission
from .edge.admission import serve as serve_admitted
from .edge.netio import Channel
from .metrics import Metrics
from .restart import succession
from .restart.freshness import StaleCode, Started
from .restart.mirror import DRAIN_S
from .restart.resume import TakeOverRefused, Unresumable
from .restart.startup import fresh_config, open_link, prepare
from .service import warm_start
from .service.core import ServiceCore
from .service.quiesce import Quiesce
from .service.session import Session, is_cancellation
from .tiers.lanes import Lane
from .tiers.memory import Memory
from .tiers.memory_signal import MemorySignal

logger = logging.getLogger("gms.server")


def bind_listener(path: str, mode: int) -> tuple[socket.socket, int]:
    """Bind with no window in which the socket is more open than ``mode``; the
    listener is non-blocking (admission's loop accepts on it directly)."""
    make_socket_dir(os.path.dirname(os.path.abspath(path)))
    clear_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        sock.bind(path)
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(old_umask)
    os.chmod(path, mode)
    sock.setblocking(False)
    sock.listen(LISTEN_BACKLOG)
    return sock, os.stat(path).st_ino


def _remove_if_ours(path: str, inode: int) -> None:
    try:
        if os.stat(path).st_ino == inode:
            os.unlink(path)
    except FileNotFoundError:
        pass


class Server:
    """One GPU's server.  The backends are opened here; the lanes, the memory
    tables and the core are made when serving starts (they live in Trio)."""

    def __init__(
        self,
        config: ServerConfig,
        backend: MemoryBackend | None = None,
        host_tier: MemoryBackend | None = None,
    ) -> None:
        self.config = config
        self.started = Started()  # its code as it started (a spare looks again when handed a node)
        self.backend = backend or open_backend(config.backend, config.device, config.host_capacity)
        if host_tier is None and config.host_tier:
            host_tier = open_host_tier(config.backend, config.device)
        self.host_tier = host_tier
        self.metrics = Metrics()
        self.metrics_port: int | None = None
        self.core: ServiceCore | None = None
        self.admission: Admission | None = None
        self.log_limit: ratelimit.RateLimit | None = None
        self.quiesce = Quiesce()
        self.handing_over = False  # a take-over is under way (gms.server.restart.takeover)
        self.signal = MemorySignal()  # memory released: told by the ledger, and by the keeper's acks
        self.listener = None
        self.link = None
        # The fd budget, given to the memory tables as they are made; bound at admission.
        self.fds = FdBudget.for_config(config, memory=self._memory_fds)
        # How serving ended without releasing anything (TAKEN_OVER: another server
        # holds the node; LEFT: a signal, the keeper holds it; ...); None: a clean stop.
        self.left_as: Leaving | None = None
        self._nursery: trio.Nursery | None = None
        self._accepting: trio.CancelScope | None = None
        self._accept_again = trio.Event()

    def _memory_fds(self) -> int:
        """Fds the memory tables hold (each allocation, each host chunk)."""
        return 0 if self.core is None else sum(tier.fd_count() for tier in self.core.ledger.tiers.values())

    def _node(self):
        """The node's state as the log has it (what the host pool sizes itself by)."""
        return self.core.state

    def _host_room(self) -> int | None:
        return None if self.core is None else host_room(self.core.state)

    def _gpu_memory(self) -> Memory:
        stock = self.config.alloc_stock_bytes
        if stock is None:
            stock = DEFAULT_STOCK_BYTES if self.backend.name == "cuda" else 0
        return Memory(self.backend, Lane("gpu"), stock, observer=self.link, fds=self.fds)

    async def _open_core(self, gpu: Memory, log: EventLog | None = None) -> ServiceCore:
        node = Node(gpu, self.host_tier, self.signal, self.fds, self.link, on_event=self.metrics.observe,
                    state=self._node, host_room=self._host_room)
        self.core = await assemble(self.config, node, log)
        self.metrics.watch(self.core)
        return self.core

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        path = self.config.socket_path
        core = gpu = None
        try:
            self.link = open_link(self.config)
            gpu = self._gpu_memory()  # told of every fd it makes or lets go: the keeper link, if any
            try:
                # Blocking: nothing is served yet.  The device asked on its lane, like every backend call.
                start = prepare(self.config, self.link, await gpu.device_info())
                if self.link is not None and self.link.stood_by:  # a spare: what is in force now
                    self.config = fresh_config(self.config, self.started)
            except TakeOverRefused:
                self._refused()
                raise
            except Unresumable as why:
                logger.error("%s", why)
                self.link.stopping(Leaving.UNRESUMABLE)
                self.link.drain(DRAIN_S)
                raise
            except StaleCode as why:
                logger.warning("this spare's code is not gms's on disk now (%s): the keeper starts a server "
                               "with the code in force", why)
                self.link.stopping(Leaving.STALE)
                self.link.drain(DRAIN_S)
                raise
            if start.retired:
                gpu.lane.stop()
                self._close_backends()
                return await succession.serve_retired(self, task_status)
            if start.listener is None:
                listener, inode = bind_listener(path, self.config.socket_mode)
            else:
                listener, inode = start.listener, succession.inode(path)
                listener.setblocking(False)
                listener.listen(LISTEN_BACKLOG)  # this version's, whoever made the socket (queued ones stay)
        except BaseException:
            if gpu is not None:
                gpu.lane.stop()
            self._close_backends()
            raise
        self.listener = listener
        self.log_limit = ratelimit.install()  # repeated warnings: one summary line per interval
        crashed = False
        try:
            core = await self._open_core(gpu, start.handed.log if start.handed else None)
            try:
                await succession.take_the_node(self, core, start)
            except Unresumable:
                self.left_as = Leaving.UNRESUMABLE
                raise
            recovered = 0
            if core.snapshots is not None:  # a node that starts with nothing finds its snapshots again
                if start.handed is None:
                    recovered = await core.snapshots.folder.recover()
                else:
                    await core.snapshots.folder.sweep()
            # Counted once the node is taken: adopted memory is counted by its tables,
            # the handed clients' sockets by their sessions' tickets (succession.spawn).
            self.admission = open_admission(self.fds, self.config, core.server_uid,
                                            uncounted=succession.handed_sockets(start))
            if self.config.metrics_port is not None:
                self.metrics_port = await succession.serve_metrics(self.metrics, self.config)
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for tier in core.ledger.tiers.values():
                    nursery.start_soon(tier.watch)  # a failed release stops the server
                for task in core.background():  # the copier, the host pool: never fatal
                    nursery.start_soon(task)
                nursery.start_soon(ratelimit.flush_every, self.log_limit)
                if self.link is not None:
                    nursery.start_soon(self.link.run)
                    nursery.start_soon(succession.watch_keeper, self)
                if start.handed is not None and start.handed.mode == "take-over":
                    succession.spawn_handed(self, start.handed)
                if recovered and core.copier is not None:
                    # A node that comes back with snapshots serves restores next, and each waits
                    # for the copier: ready once it is (its start was a quarter of a 1 GiB restore
                    # on 2 cores; docs/performance.md).  Clients that connect meanwhile queue.
                    await core.copier.usable()
                if recovered and self.config.restore_at_start:  # before anyone is served: gms.server.service.warm_start
                    await warm_start.restore_recovered(core)
                logger.info(
                    "serving device %d on %s (backend %s, policy %s)",
                    self.config.device, path, self.backend.name, self.config.policy.source,
                )
                succession.ready_file(self.config.ready_file, True)
                if self.link is not None:
                    self.link.ready()
                task_status.started(self)
                await self._accept_until_cancelled(listener)
        except BaseException as exc:
            crashed = not is_cancellation(exc)
            raise
        finally:
            succession.ready_file(self.config.ready_file, False)
            self.metrics.close()
            link = self.link
            if self.left_as is None and crashed and link is not None and link.alive:
                # A crash under a keeper: it holds the node and starts the next server,
                # which resumes it.  Nothing is released, the socket stays (the keeper's).
                logger.error("the server failed: its keeper keeps the node for the next one")
                self.left_as = Leaving.CRASHED
            if self.left_as is None:
                listener.close()
                _remove_if_ours(path, inode)
                if core is not None:
                    with trio.CancelScope(shield=True):
                        await core.aclose()
                if link is not None:
                    link.stopping(Leaving.SHUTDOWN)
            else:
                listener.close()  # another process holds the socket: nothing is released
                if core is not None:
                    for tier in core.ledger.tiers.values():
                        tier.stop()
                if link is not None and self.left_as is not Leaving.CRASHED:  # (a take-over told it already)
                    link.stopping(self.left_as)
            if link is not None:
                link.drain(DRAIN_S)
            self._close_backends()
            ratelimit.uninstall(self.log_limit)

    def _refused(self) -> None:
        succession.refused(self)

    async def _accept_until_cancelled(self, listener) -> None:
        """Accept (each connection judged by admission as it comes) until cancelled;
        stopped by a take-over's pause (the socket stays open: its backlog is the
        next server's) and started again if it aborts."""
        while True:
            self._accepting = trio.CancelScope()
            with self._accepting:
                await serve_admitted(self.admission, listener, self._admitted, self.metrics.refused_one)
            self._accept_again = trio.Event()
            await self._accept_again.wait()

    def stop_accepting(self) -> None:
        """New connections wait in the socket's backlog (for whoever serves next)."""
        if self._accepting is not None:
            self._accepting.cancel()

    def resume_serving(self) -> None:
        """A take-over that did not happen: every parked session goes on, and accepting."""
        succession.resume_sessions(self)
        self._accept_again.set()

    def handed_over(self) -> None:
        """Another server holds the node now: stop, letting go of nothing."""
        self.left_as = Leaving.TAKEN_OVER
        self.stop()

    def stop(self) -> None:
        """Stop serving (the way out then decides what is released: ``left_as``)."""
        self._nursery.cancel_scope.cancel()

    def _close_backends(self) -> None:
        for backend in (self.backend, self.host_tier):
            if backend is not None:
                backend.close()

    def _admitted(self, sock: socket.socket, peer: Peer, ticket: Ticket) -> None:
        """A connection admission let in: its session is made now (a take-over's
        quiet point counts it from here: one whose task had not started yet was
        left out of a hand-over, and its client reset), its task starts soon."""
        self.start_session(self.new_session(Channel(sock, peer)), ticket)

    def new_session(self, channel: Channel, **going_on) -> Session:
        """A session of this server on ``channel`` (``going_on``: a handed one's
        conn, protocol and first-request deadline: ``Session``'s own)."""
        return Session(
            self.core, self.config, channel, self.metrics, self.quiesce, on_take_over=self._taken_over_by,
            **going_on,
        )

    def start_session(self, session: Session, ticket: Ticket) -> None:
        self._nursery.start_soon(self.run_session, session, ticket)

    async def run_session(self, session: Session, ticket: Ticket) -> None:
        """A session's task; its admission ticket goes when the task ends (a parked
        session's too: it is admitted again wherever it goes on)."""
        try:
            await session.run()
        finally:
            self.admission.leave(ticket)

    def _taken_over_by(self, channel: Channel, protocol, request) -> None:
        """A connection asked for this server's place: the conversation is the take-over's."""
        from .restart.takeover import hand_over

        self._nursery.start_soon(hand_over, self, channel, protocol, request)


async def run_server(config: ServerConfig) -> None:
    """Serve until SIGTERM or SIGINT; then stop cleanly, or under a keeper leave
    the node to it (it starts the next server with everything)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a snapshot past RLIMIT_FSIZE fails its save (EFBIG), no more
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def serve(task_status=trio.TASK_STATUS_IGNORED) -> None:
                # It may end on its own: its keeper asked, or another server took over.
                await Server(config).serve(task_status=task_status)
                nursery.cancel_scope.cancel()

            server = await nursery.start(serve)

            async def stop_on_signal() -> None:
                async for signum in signals:
                    name = signal.Signals(signum).name
                    if server.link is not None and server.link.alive and server.core is not None:
                        logger.info("%s: leaving the node to the keeper", name)
                        server.left_as = Leaving.LEFT
                    else:
                        logger.info("%s: shutting down", name)
                    server.stop()
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(stop_on_signal)
