"""One connection's task: the small Trio loop around two sans-IO objects,
:class:`ServerConnection` (the wire: framing, one request at a time) and
:class:`~gms.server.service.waits.Waits` (what the request being served
waits on: its lock, memory; what a take-over hands on).

Feed what the socket gives to the connection object, serve each request it
hands out by its route (``gms.server.service.routes``: one table; a
handshake's own steps are ``handshake``), send what it encodes; unwind on any
exit.  The core decides; this loop only reads, waits, sends and unwinds.
The trust boundary of the seed, in one place:

* a connection that sends no whole request within ``--handshake-timeout``
  of being accepted is closed (counted, not logged as an event: a flood of
  idle connections must not flood the history);
* a frame that cannot be read or decoded drops the connection
  (``CONNECTION_DROPPED``, then its lock is unwound);
* a decodable but invalid request gets an ``ErrorResponse``, the session goes on;
* a failed send unwinds like a drop; so does an admin's revoke;
* anything else (a broken invariant, a CUDA failure, a bug) is not caught
  here: it crashes the server's nursery and the server exits non-zero.

Who the peer is comes from the kernel (``SO_PEERCRED``) when the connection
is accepted; nothing the client sends can change it.  Every ``await`` here is
a point where the world may have changed: what was decided before it is
decided again after it (in the core), never trusted.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable

import trio

from ...fsm import Grant, GrantedLockType, Rejection
from ...fsm.events import ConnectionDropped, RestoreClaimed, RoConnect
from ...handover.words import Waiting
from ...wire import ProtocolError
from ...wire import messages as m
from ...wire.connection import (
    NEED_DATA,
    PEER_CLOSED,
    PRE_SESSION_MAX_FRAME_BYTES,
    ServerConnection,
)
from ..config import ServerConfig
from ..edge.inflight import answer_bytes
from ..edge.netio import Channel, PeerGone, SendFailed
from ..edge.reply import Reply, error_reply
from ..metrics import Metrics
from . import handshake
from .core import ServiceCore
from .quiesce import STUCK_S, Parked, Quiesce, only_parked
from .routes import DESCRIBES, ROUTES, TakeOverAsked, answer
from .waits import Waits

log = logging.getLogger("gms.server")



def is_cancellation(exc: BaseException) -> bool:
    """Cancelled, or a group (from an inner nursery) of nothing but Cancelled."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(trio.Cancelled)[1] is None
    return isinstance(exc, trio.Cancelled)


class FirstRequestLate(Exception):
    """No whole request arrived within the handshake deadline."""


class Session:
    def __init__(
        self,
        core: ServiceCore,
        config: ServerConfig,
        channel: Channel,
        metrics: Metrics,
        quiesce: Quiesce | None = None,
        *,
        conn: int | None = None,
        protocol: ServerConnection | None = None,
        on_take_over: Callable[[Channel, ServerConnection, m.TakeOverRequest], None] | None = None,
        first_request_left: float | None = None,
    ) -> None:
        """``conn`` and ``protocol``: a connection handed over (or handed back),
        going on where it stopped (see :meth:`go_on`); ``first_request_left``:
        what was left of its first request's deadline (None: all of it)."""
        self.core = core
        self.config = config
        self.channel = channel
        self.metrics = metrics
        self.quiesce = quiesce if quiesce is not None else Quiesce()
        self.peer = channel.peer
        self.conn = core.new_conn() if conn is None else conn
        if protocol is None:
            protocol = ServerConnection(config.max_frame_bytes, PRE_SESSION_MAX_FRAME_BYTES)
        self.protocol = protocol
        left = config.handshake_timeout if first_request_left is None else first_request_left
        self.first_by = trio.current_time() + left  # the first request's deadline
        # Big frames: a few per uid at once.  Not handed over: a session that goes on
        # elsewhere takes a slot there again when it needs one.
        self._slot = core.inflight.slot(self.peer.uid)
        # The session's one scope (a scope made and entered is among the dearest
        # steps of a connection in Trio): an admin's revoke cancels it whenever
        # it comes, a take-over's pause only while the session waits for its
        # next request, and its deadline is the first request's until that came.
        self._scope = trio.CancelScope()
        self._revoked = False
        self._stuck = False  # dropped at a quiet point: its client read nothing of its answer
        self.on_take_over = on_take_over
        # What it waits on, as data (what a quiet point hands over): gms.server.service.waits.
        self.waits = Waits()
        self.grant_event: trio.Event | None = None  # made when a handshake has to wait
        self.quiesce.started(self)  # counted from here, before its task runs: a quiet point waits for it

    def _revoke(self) -> None:
        """An admin took the lock: say so (best effort: the client then knows not to
        ride through, as it would a server that went away), then end the task."""
        self._revoked = True
        self.channel.send_nowait(self.protocol.notice(m.SessionEnded("revoked")))
        self._scope.cancel()

    def drop_stuck(self) -> None:
        """A take-over's quiet point found this session still sending its answer
        (its client reads slowly or not at all): end it, as a failed send would."""
        self._stuck = True
        self._scope.cancel()

    def go_on(
        self, kind: Waiting, *, requested: str = "", timeout_left: float = math.inf, granted: Grant | None = None
    ) -> None:
        """Before :meth:`run`: this connection was handed over waiting on the
        request it is serving (LOCK: for ``requested``, ``timeout_left``
        seconds more; RESTORE or ALLOCATE: for memory): finish that first.
        ``granted``: the lock was granted while the server paused."""
        self.waits.go_on(kind, self.protocol.serving, requested=requested, timeout_left=timeout_left,
                         granted=granted, now=trio.current_time())

    @contextlib.contextmanager
    def waiting_for(self, what: Waiting):
        """Mark a memory wait; a take-over stopping it leaves the mark for the hand-over."""
        self.waits.wait_memory(what)
        try:
            yield
        except BaseException as exc:
            self.waits.memory_ended(parked=only_parked(exc))
            raise
        self.waits.memory_ended()

    async def run(self) -> None:
        unwind = close = True
        self.core.on_revoke(self.conn, self._revoke)
        try:
            if not self.protocol.requests:
                self._scope.deadline = self.first_by  # lifted once the first request is whole
            with self._scope:
                if self.waits.pending is not None:
                    await self._finish_pending()
                await self._serve()
            if self._stuck:
                raise SendFailed(f"its client did not take its answer within {STUCK_S:g} s of a take-over's pause")
            if self._revoked:
                log.info("conn %d (pid %d): lock revoked by an admin", self.conn, self.peer.pid)
            elif self._scope.cancelled_caught:
                raise self._stopped()  # while it waited for a request
        except (ProtocolError, PeerGone, SendFailed) as exc:
            self._dropped(exc)
        except TakeOverAsked as asked:  # the connection is the take-over's now (no session: a one-shot)
            close = False
            self.quiesce.ended(self)
            self.on_take_over(self.channel, self.protocol, asked.request)
        except FirstRequestLate:
            self.metrics.refused.labels("handshake_timeout").inc()
            log.info("a connection sent no request within %.1f s of connecting: closed", self.config.handshake_timeout)
        except BaseException as exc:
            if only_parked(exc):  # a take-over: the connection goes on, here or elsewhere
                unwind = close = False
                self.quiesce.park(self.conn, self)
                return
            # Server shutdown cancels us: unwind below.  Anything else is fatal:
            # leave the state as it is for the post-mortem.
            unwind = is_cancellation(exc)
            raise
        finally:
            if unwind:
                self.core.disconnect(self.conn)
            if close:
                self.channel.close()
                self.quiesce.ended(self)
            self._slot.close()

    def _stopped(self) -> Exception:
        """Why the session's scope was cancelled while it waited for a request,
        an admin's revoke aside: a take-over's pause, or the first request's
        deadline (the scope's own, while no request had come)."""
        return Parked() if self.quiesce.requested else FirstRequestLate()

    def _dropped(self, exc: Exception) -> None:
        if isinstance(exc, PeerGone) and not self.protocol.overflowed:
            return  # an ordinary hang-up: the unwind says all
        if isinstance(exc, PeerGone):
            exc = self.protocol.overflow_error()
        reason = f"send failed: {exc}" if isinstance(exc, SendFailed) else str(exc)
        log.info("conn %d dropped: %s", self.conn, reason)
        self.core.ledger.record([ConnectionDropped(self.conn, reason, layout=self._layout_name())])

    def _layout_name(self) -> str:
        session = self.core.state.sessions.get(self.conn)
        return session.layout if session is not None else ""

    # -- the loop ---------------------------------------------------------------

    async def _serve(self) -> None:
        protocol = self.protocol
        quiesce = self.quiesce
        scope = self._scope
        while not protocol.closing:
            quiesce.check()  # a take-over: stop before the next request, not inside it
            request = protocol.next_request()
            self._slot.settle(protocol.buffered)
            if request is NEED_DATA:
                quiesce.reading(scope)
                try:
                    await self._read()
                finally:
                    quiesce.read(scope)
                if scope.cancel_called and not self._revoked:
                    raise self._stopped()  # as the read ended: before anything else is done
                continue
            if request is PEER_CLOSED:
                return
            if protocol.requests == 1:
                scope.deadline = math.inf  # the first request came in time
            since = self.core.durability.added(self.conn)
            reply = await answer(self, request)
            if type(request) in DESCRIBES:  # it only describes: nothing to wait for
                await self._send(reply)
            else:
                await self._send(reply, (self._layout_name() or getattr(request, "layout", ""),), since)

    async def _send(self, reply: Reply, durable: tuple[str, ...] = ("",), since: int = 0) -> None:
        """The answer tells of the state of ``durable``'s layouts (and the node's):
        it waits until the keeper has their last lasting change, and (``since``:
        what this connection had added to the keeper's stream before the
        request) while what the request added waits behind a keeper far behind
        (at once, unless the keeper is behind: ``gms.server.restart.mirror``)."""
        protocol = self.protocol
        try:
            if protocol.closing:
                return  # revoked while it was served: the notice went in its place
            durability = self.core.durability
            if durability.behind(durable, self.conn, since):
                await durability.durable(durable, self.conn, since)
            await self._slot.before_send(answer_bytes(reply.message))
            await self.channel.send(protocol.send(reply.message, close=reply.close_after), reply.fds)
            self._slot.settle(protocol.buffered)
        finally:
            for fd in reply.fds:  # the client has its own copies now, or never will
                os.close(fd)
            if reply.fds and self.core.fds is not None:
                self.core.fds.returned(len(reply.fds))

    async def _finish_pending(self) -> None:
        kind = self.waits.take_pending()
        request = self.protocol.serving
        since = self.core.durability.added(self.conn)
        try:
            if kind is Waiting.LOCK:
                reply = await handshake.wait_for_lock(self)
            elif kind is Waiting.RESTORE:
                reply = await handshake.after_grant(self, request, self.waits.grant)
            else:
                reply = await ROUTES[m.AllocateRequest].answer(self, request)
        except Rejection as rejection:
            reply = error_reply(rejection)
        await self._send(reply, (self._layout_name(),), since)

    async def _read(self) -> None:
        await self._slot.read(self.protocol, self.channel)  # (before the first request: its deadline)

    async def until_gone(self) -> None:
        """Return once the client hangs up (or pipelines past the read-ahead limit).

        Used while a request waits (for a lock, for memory) and the loop reads
        nothing: a client that died while queued must never be granted, and
        its hang-up is seen even behind a request it pipelined, which the
        connection object keeps.  Reading also drops any fds sent with it, so a
        client cannot keep its own socket alive in our receive queue."""
        protocol = self.protocol
        while not protocol.eof and not protocol.overflowed:
            await self._read()

    def expect_grant(self) -> trio.Event:
        """What a handshake that has to wait for its lock waits on (set by :meth:`on_grant`)."""
        self.grant_event = trio.Event()
        return self.grant_event

    def on_grant(self, grant: Grant) -> None:
        """The ledger granted this session's lock (maybe while a take-over paused it)."""
        self.waits.granted(grant)
        if self.grant_event is not None:
            self.grant_event.set()

    def turned_away(self) -> None:
        """Nothing will grant this session's lock (``gms.fsm.turned_away``): its handshake is answered."""
        self.waits.turn_away()
        if self.grant_event is not None:
            self.grant_event.set()

    def alive(self) -> bool:
        return not self.channel.hung_up()


def granted_as(conn: int, layout: str, granted: str, restore: bool) -> Grant:
    """A grant described by a hand-over (the event was recorded by the server before)."""
    event = RestoreClaimed(conn, layout=layout) if restore else RoConnect(conn, layout=layout)
    return Grant(conn, GrantedLockType(granted), event)

