"""One connection's task: the small Trio loop around :class:`ServerConnection`.

Feed what the socket gives to the connection object, serve each request it
hands out (the core decides), send what it encodes; unwind on any exit.
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

import logging
import math
import os

import trio

from ..fsm import Grant, Rejection
from ..fsm.events import ConnectionDropped, LockTimeout
from ..wire import ProtocolError, UnknownMessageType
from ..wire import messages as m
from ..wire.connection import NEED_DATA, PEER_CLOSED, PRE_SESSION_MAX_FRAME_BYTES, Refused, ServerConnection
from .admission import FdsExhausted
from .config import ServerConfig
from .core import ServiceCore
from .inflight import answer_bytes
from .metrics import Metrics
from .netio import Channel, PeerGone, SendFailed, wait_or_hangup
from .placement import OutOfMemoryTimeout
from .reply import Reply, error_reply

log = logging.getLogger("gms.server")


def is_cancellation(exc: BaseException) -> bool:
    """Cancelled, or a group (from an inner nursery) of nothing but Cancelled."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(trio.Cancelled)[1] is None
    return isinstance(exc, trio.Cancelled)


class FirstRequestLate(Exception):
    """No whole request arrived within the handshake deadline."""


class Session:
    def __init__(self, core: ServiceCore, config: ServerConfig, channel: Channel, metrics: Metrics) -> None:
        self.core = core
        self.config = config
        self.channel = channel
        self.metrics = metrics
        self.peer = channel.peer
        self.conn = core.new_conn()
        self.protocol = ServerConnection(config.max_frame_bytes, PRE_SESSION_MAX_FRAME_BYTES)
        self._first_by = trio.current_time() + config.handshake_timeout  # the first request's deadline
        self._slot = core.inflight.slot(self.peer.uid)  # big frames: a few per uid at once
        self._scope = trio.CancelScope()
        self._revoked = False

    def _revoke(self) -> None:
        """An admin took the lock: say so (best effort: the client then knows not to
        ride through, as it would a server that went away), then end the task."""
        self._revoked = True
        self.channel.send_nowait(self.protocol.notice(m.SessionEnded("revoked")))
        self._scope.cancel()

    async def run(self) -> None:
        unwind = True
        self.core.on_revoke(self.conn, self._revoke)
        try:
            with self._scope:
                await self._serve()
            if self._revoked:
                log.info("conn %d (pid %d): lock revoked by an admin", self.conn, self.peer.pid)
        except (ProtocolError, PeerGone, SendFailed) as exc:
            self._dropped(exc)
        except FirstRequestLate:
            self.metrics.refused.labels("handshake_timeout").inc()
            log.info("a connection sent no request within %.1f s of connecting: closed", self.config.handshake_timeout)
        except BaseException as exc:
            # Server shutdown cancels us: unwind below.  Anything else is fatal:
            # leave the state as it is for the post-mortem.
            unwind = is_cancellation(exc)
            raise
        finally:
            if unwind:
                self.core.disconnect(self.conn)
            self.channel.close()
            self._slot.close()

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
        while not protocol.closing:
            request = protocol.next_request()
            self._slot.settle(protocol.buffered)
            if request is NEED_DATA:
                protocol.receive_data(await self._receive())
                continue
            if request is PEER_CLOSED:
                return
            reply = await self._answer(request)
            try:
                if protocol.closing:
                    return  # revoked while it was served: the notice went in its place
                await self._slot.before_send(answer_bytes(reply.message))
                await self.channel.send(protocol.send(reply.message, close=reply.close_after), reply.fds)
                self._slot.settle(protocol.buffered)
            finally:
                for fd in reply.fds:  # the client has its own copies now, or never will
                    os.close(fd)
                if reply.fds and self.core.fds is not None:
                    self.core.fds.returned(len(reply.fds))

    async def _receive(self) -> memoryview:
        """The next bytes; before the first whole request, only until its deadline;
        past a small frame's worth held, only with one of the uid's slots."""
        await self._slot.before_read(self.protocol.buffered)
        if self.protocol.requests:
            return await self.channel.receive()
        with trio.move_on_at(self._first_by):
            return await self.channel.receive()
        raise FirstRequestLate

    async def _until_gone(self) -> None:
        """Return once the client hangs up (or pipelines past the read-ahead limit).

        Used while a request waits (for a lock, for memory) and the loop reads
        nothing: a client that died while queued must never be granted, and
        its hang-up is seen even behind a request it pipelined, which the
        connection object keeps.  Reading also drops any fds sent with it, so a
        client cannot keep its own socket alive in our receive queue."""
        protocol = self.protocol
        while not protocol.eof and not protocol.overflowed:
            protocol.receive_data(await self._receive())

    async def _answer(self, request: object) -> Reply:
        if isinstance(request, Refused):
            return Reply(request.reply())
        if isinstance(request, UnknownMessageType):
            return Reply(m.ErrorResponse(str(request), "UNKNOWN_MESSAGE"))
        try:
            if isinstance(request, m.PROBES):
                return Reply(await self.core.probes.answer(request, self.peer))
            if isinstance(request, m.ADMIN):
                return self.core.admin(self.conn, request, self.peer)
            if isinstance(request, m.HandshakeRequest):
                return await self._handshake(request)
            if isinstance(request, m.AllocateRequest):
                return await self._allocate(request)
            if isinstance(request, m.ExportHostCopiesRequest):
                return await self.core.host_tier.export_copies(self.conn, request.allocation_ids)
            if isinstance(request, m.ExportHostChunksRequest):
                return self.core.host_tier.export_chunks(self.conn, request.allocation_ids, request.start)
            if isinstance(request, m.CommitRequest) and self.core.transfers is not None:
                return await self.core.transfers.commit(self.conn, request)  # the copier fills host copies
            if isinstance(request, m.RestoreDoneRequest):
                return Reply(m.RestoreDoneResponse(self.core.finish_restore(self.conn)))
            return self.core.requests.handle(self.conn, request)
        except Rejection as rejection:
            return error_reply(rejection)

    async def _handshake(self, request: m.HandshakeRequest) -> Reply:
        requested = self.core.open_session(self.conn, request, self.peer)
        grant: Grant | None = None
        done = trio.Event()

        def on_grant(g: Grant) -> None:
            nonlocal grant
            grant = g
            done.set()

        asked_at = trio.current_time()
        self.core.request_lock(self.conn, requested, on_grant, lambda: not self.channel.hung_up())
        if grant is None:
            hung_up = False
            timeout = math.inf if request.timeout_ms is None else request.timeout_ms / 1000
            with trio.move_on_after(timeout):
                hung_up = await wait_or_hangup(done.wait, self._until_gone)
            if grant is None:
                self.core.cancel_lock_request(self.conn)
                if hung_up:
                    raise PeerGone("hung up while waiting for the lock")
                self.core.ledger.record(
                    [LockTimeout(self.conn, requested.value, request.timeout_ms or 0, layout=request.layout)]
                )
                return Reply(self._handshake_response(None))
        self.metrics.lock_waited(requested.value, trio.current_time() - asked_at)
        restored = False  # by the copier: then the reader is granted a plain RO
        if grant.restore:
            layout = self.core.state.layout(request.layout)
            try:
                await self.core.placement.with_memory(
                    self.conn, lambda: self.core.placement.restore(self.conn), layout.held_bytes, "restore",
                    self._until_gone,
                )
            except (OutOfMemoryTimeout, FdsExhausted) as exc:
                return error_reply(exc, close_after=True)  # give the restore up: the next reader takes it
            if self.core.transfers is not None:
                restored = await self.core.transfers.restore(self.conn, self._until_gone)
        return Reply(self._handshake_response(grant, restored))

    def _handshake_response(self, grant: Grant | None, restored: bool = False) -> m.HandshakeResponse:
        state = self.core.state
        session = state.sessions.get(self.conn)
        layout = state.layout(session.layout) if session else None
        device = self.core.device
        return m.HandshakeResponse(
            success=grant is not None,
            committed=bool(layout and layout.committed),
            granted_lock_type=None if grant is None else grant.granted.value,
            backend=device.backend,
            device=device.device,
            device_uuid=device.uuid,
            memory_layout_hash=(layout.layout_hash if layout else None) or "",
            layout=layout.name if layout else "",
            tenant=session.tenant if session else "",
            restore=grant is not None and grant.restore and not restored,
            max_frame_bytes=self.config.max_frame_bytes,
        )

    async def _allocate(self, request: m.AllocateRequest) -> Reply:
        placement = self.core.placement
        with self.metrics.allocate_seconds.time():
            response = await placement.with_memory(
                self.conn, lambda: placement.allocate(self.conn, request.size, request.tag),
                request.size, request.tag, self._until_gone,
            )
        return Reply(response)

