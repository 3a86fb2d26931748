"""One connection's task: read a request, decide, answer; unwind on any exit.

The trust boundary of the seed, in one place:

* a frame that cannot be read or decoded drops the connection
  (``CONNECTION_DROPPED``, then its lock is unwound);
* a decodable but invalid request gets an ``ErrorResponse``, the session goes on;
* a failed send unwinds like a drop; so does an admin's revoke;
* anything else (a broken invariant, a CUDA failure, a bug) is not caught
  here: it crashes the server's nursery and the server exits non-zero.

Who the peer is comes from the kernel (``SO_PEERCRED``) when the connection
is accepted; nothing the client sends can change it.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from typing import TypeVar

import trio

from ..cuda import OutOfMemory
from ..fsm import Grant, QuotaExceeded
from ..fsm.errors import HostBudgetExceeded, Rejection, StateViolation
from ..fsm.events import AllocationOomGaveUp, AllocationOomWait, ConnectionDropped, LockTimeout
from ..wire import FrameDecoder, ProtocolError, UnknownMessageType, decode, encode
from ..wire import messages as m
from ..wire.codec import HEADER
from .config import ServerConfig
from .core import Reply, ServiceCore
from .memory_signal import MemorySignal
from .metrics import Metrics
from .netio import PeerGone, SendFailed, peer_hung_up, send_frame, send_notice_nowait, wait_or_hangup
from .peer import peer_of

log = logging.getLogger("gms.server")

_RECV_BYTES = 16 * 1024
_FIRST_RETRY_S = 0.001  # out of memory: retry soon, then back off to the configured interval
T = TypeVar("T")


def is_cancellation(exc: BaseException) -> bool:
    """Cancelled, or a group (from an inner nursery) of nothing but Cancelled."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(trio.Cancelled)[1] is None
    return isinstance(exc, trio.Cancelled)


def error_reply(rejection: Rejection) -> Reply:
    if isinstance(rejection, QuotaExceeded):
        return Reply(
            m.ErrorResponse(
                rejection.message, rejection.code, rejection.scope,
                rejection.used, rejection.asked, rejection.quota,
            )
        )
    return Reply(m.ErrorResponse(rejection.message, rejection.code))


class Session:
    def __init__(
        self,
        core: ServiceCore,
        config: ServerConfig,
        sock: trio.socket.SocketType,
        device_uuid: str,
        memory: MemorySignal,
        metrics: Metrics,
    ) -> None:
        self.core = core
        self.config = config
        self.sock = sock
        self.device_uuid = device_uuid
        self.memory = memory
        self.metrics = metrics
        self.peer = peer_of(sock)
        self.conn = core.new_conn()
        self.handshaken = False
        self._decoder = FrameDecoder(config.max_frame_bytes)
        self._read_ahead_limit = config.max_frame_bytes + HEADER.size  # one whole frame
        self._overflowed = False
        self._buffer = bytearray(_RECV_BYTES)  # recv() would allocate one per call
        self._scope = trio.CancelScope()
        self._revoked = False
        self._sending = False  # a frame is partly sent: nothing may be written between

    def _revoke(self) -> None:
        self._revoked = True
        # Tell the client the end is deliberate, so it does not reconnect as it
        # would after a server restart (docs/protocol.md, SessionEnded).  Never
        # in the middle of a response: that would corrupt the frame it follows.
        if not self._sending:
            send_notice_nowait(self.sock, encode(m.SessionEnded("revoked")))
        self._scope.cancel()

    async def run(self) -> None:
        unwind = True
        self.core.on_revoke(self.conn, self._revoke)
        try:
            with self._scope:
                await self._serve()
            if self._revoked:
                log.info("conn %d (pid %d): lock revoked by an admin", self.conn, self.peer.pid)
        except ProtocolError as exc:
            log.warning("conn %d dropped: %s", self.conn, exc)
            self.core.record([ConnectionDropped(self.conn, str(exc), layout=self._layout())])
        except SendFailed as exc:
            log.info("conn %d: send failed: %s", self.conn, exc)
            self.core.record([ConnectionDropped(self.conn, f"send failed: {exc}", layout=self._layout())])
        except PeerGone:
            pass
        except BaseException as exc:
            # Server shutdown cancels us: unwind below.  Anything else is fatal:
            # leave the state as it is for the post-mortem.
            unwind = is_cancellation(exc)
            raise
        finally:
            if unwind:
                self.core.disconnect(self.conn)
            self.sock.close()

    def _layout(self) -> str:
        session = self.core.state.sessions.get(self.conn)
        return session.layout if session is not None else ""

    # -- framing ------------------------------------------------------------

    async def _receive(self) -> object:
        while True:
            body = self._decoder.next_frame()
            if body is not None:
                return decode(body)
            try:
                n = await self.sock.recv_into(self._buffer)
            except OSError as exc:
                raise PeerGone(str(exc)) from exc
            if not n:
                if self._decoder.pending:
                    raise ProtocolError(f"connection closed inside a frame ({self._decoder.pending} bytes)")
                raise PeerGone("closed")
            self._decoder.feed(memoryview(self._buffer)[:n])

    async def _until_hangup(self) -> None:
        """Return once the client hangs up; used while the session waits (for a
        lock, for memory) and answers nothing.

        A client that died while queued must never be granted: its hang-up is
        seen even behind a request it pipelined, because that request is read
        ahead into the decoder.  Reading also drops any fds sent with it, so a
        client cannot keep its own socket alive, in flight in our receive
        queue, after its death.  More than one frame of read-ahead is a
        protocol violation (noted; the caller drops the connection)."""
        while self._decoder.pending <= self._read_ahead_limit:
            try:
                n = await self.sock.recv_into(self._buffer)
            except OSError:
                return
            if not n:
                return
            self._decoder.feed(memoryview(self._buffer)[:n])
        self._overflowed = True

    def _gone(self, waiting_for: str) -> Exception:
        if self._overflowed:
            return ProtocolError(f"more than a frame pipelined while waiting for {waiting_for}")
        return PeerGone(f"hung up while waiting for {waiting_for}")

    async def _send(self, reply: Reply) -> None:
        self._sending = True
        try:
            await send_frame(self.sock, encode(reply.message), reply.fds)
            self._sending = False
        finally:
            for fd in reply.fds:  # the client has its own copies now, or never will
                os.close(fd)

    # -- requests -----------------------------------------------------------

    async def _serve(self) -> None:
        first = True
        while True:
            try:
                request = await self._receive()
            except UnknownMessageType as exc:
                first = False
                await self._send(Reply(m.ErrorResponse(str(exc), "UNKNOWN_MESSAGE")))
                continue
            if first and isinstance(request, m.ONE_SHOT):
                # Probes and admin verbs answer and close; they never take a lock.
                await self._send(self._one_shot(request))
                return
            first = False
            try:
                reply = await self._dispatch(request)
            except Rejection as rejection:
                reply = error_reply(rejection)
            await self._send(reply)
            if reply.close_after:
                return

    def _one_shot(self, request: object) -> Reply:
        try:
            if isinstance(request, m.PROBES):
                return self.core.probe(self.conn, request, self.peer)
            return self.core.admin(self.conn, request, self.peer)
        except Rejection as rejection:
            return error_reply(rejection)

    async def _dispatch(self, request: object) -> Reply:
        if isinstance(request, m.HandshakeRequest):
            return await self._handshake(request)
        if isinstance(request, m.AllocateRequest):
            return await self._allocate(request)
        if isinstance(request, m.ExportHostCopiesRequest):
            return await self._host_copies(request)
        if isinstance(request, m.RestoreDoneRequest):
            return Reply(m.RestoreDoneResponse(self.core.finish_restore(self.conn)))
        if isinstance(request, m.ONE_SHOT):
            raise StateViolation(f"{type(request).__name__} must be the first and only request of a connection")
        return self.core.handle(self.conn, request)

    async def _handshake(self, request: m.HandshakeRequest) -> Reply:
        if self.handshaken:
            raise StateViolation("this connection has already handshaken")
        requested = self.core.open_session(self.conn, request, self.peer)
        self.handshaken = True

        grant: Grant | None = None
        done = trio.Event()

        def on_grant(g: Grant) -> None:
            nonlocal grant
            grant = g
            done.set()

        asked_at = trio.current_time()
        self.core.request_lock(self.conn, requested, on_grant, lambda: not peer_hung_up(self.sock))
        if grant is None:
            hung_up = False
            timeout = math.inf if request.timeout_ms is None else request.timeout_ms / 1000
            with trio.move_on_after(timeout):
                hung_up = await wait_or_hangup(done.wait, self._until_hangup)
            if grant is None:
                self.core.cancel_lock_request(self.conn)
                if hung_up:
                    raise self._gone("the lock")
                self.core.record(
                    [LockTimeout(self.conn, requested.value, request.timeout_ms or 0, layout=request.layout)]
                )
                return Reply(self._handshake_response(None), close_after=True)
        self.metrics.lock_wait_seconds.labels(requested.value).observe(trio.current_time() - asked_at)
        if grant.restore:
            layout = self.core.state.layout(request.layout)
            try:
                await self._with_memory(lambda: self.core.load_restore(self.conn), layout.held_bytes, "restore")
            except OutOfMemoryTimeout as exc:
                # Give the restore up (the next reader takes it over): close.
                return Reply(error_reply(exc).message, close_after=True)
        return Reply(self._handshake_response(grant))

    def _handshake_response(self, grant: Grant | None) -> m.HandshakeResponse:
        session = self.core.state.sessions.get(self.conn)
        layout = self.core.state.layout(session.layout) if session else None
        return m.HandshakeResponse(
            success=grant is not None,
            committed=bool(layout and layout.committed),
            granted_lock_type=None if grant is None else grant.granted.value,
            backend=self.core.gpu.name,
            device=self.core.gpu.device,
            device_uuid=self.device_uuid,
            memory_layout_hash=(layout.layout_hash if layout else None) or "",
            layout=layout.name if layout else "",
            tenant=session.tenant if session else "",
            restore=grant is not None and grant.restore,
            max_frame_bytes=self.config.max_frame_bytes,
        )

    # -- memory ------------------------------------------------------------------

    async def _with_memory(self, attempt: Callable[[], T], size: int, tag: str) -> T:
        """Run ``attempt`` until it finds memory.  Out-of-memory is transient:
        retry when the server frees memory, and on a timer that starts at a
        millisecond and backs off to ``--alloc-retry-interval`` (other processes
        free memory the server cannot see).  OutOfMemoryTimeout once
        ``--alloc-retry-timeout`` passes; PeerGone if the client hangs up meanwhile."""
        interval = self.config.alloc_retry_interval
        timeout = self.config.alloc_retry_timeout
        started = None
        pause = _FIRST_RETRY_S
        while True:
            released = self.memory.next_release()
            try:
                return attempt()
            except OutOfMemory:
                pass
            now = trio.current_time()
            if started is None:
                started = now
                self.core.record([AllocationOomWait(self.conn, size, tag, layout=self._layout())])
            waited = now - started
            if timeout is not None and waited >= timeout:
                self.core.record(
                    [AllocationOomGaveUp(self.conn, size, tag, "timeout", int(waited * 1000), layout=self._layout())]
                )
                raise OutOfMemoryTimeout(f"out of memory: no {size} bytes after waiting {waited:.1f} s")
            wait = pause if timeout is None else min(pause, timeout - waited)
            pause = min(pause * 2, interval)
            with trio.move_on_after(wait):
                hung_up = await wait_or_hangup(released.wait, self._until_hangup)
                if hung_up:
                    waited = trio.current_time() - started
                    self.core.record(
                        [AllocationOomGaveUp(self.conn, size, tag, "disconnect", int(waited * 1000), layout=self._layout())]
                    )
                    raise self._gone("memory")

    async def _allocate(self, request: m.AllocateRequest) -> Reply:
        with self.metrics.allocate_seconds.time():
            response = await self._with_memory(
                lambda: self.core.allocate(self.conn, request.size, request.tag), request.size, request.tag
            )
        return Reply(response)

    async def _host_copies(self, request: m.ExportHostCopiesRequest) -> Reply:
        """Make the missing host copies (pinning gigabytes of host memory takes
        seconds on CUDA: off the event loop), then export them all."""
        new = self.core.host_copies_to_create(self.conn, request.allocation_ids)
        created = []
        try:
            for allocation in new:
                if getattr(self.core.host, "create_in_thread", False):
                    await trio.to_thread.run_sync(self.core.create_host_copy, allocation)
                else:
                    self.core.create_host_copy(allocation)
                created.append(allocation)
        except OutOfMemory as exc:
            for allocation in created:
                self.core.host.release(allocation.allocation_id)
            raise HostBudgetExceeded(f"host memory exhausted: {exc}") from None
        except BaseException:
            for allocation in created:
                self.core.host.release(allocation.allocation_id)
            raise
        self.core.record_host_copies(self.conn, created)
        return self.core.export_host_copies(self.conn, request.allocation_ids)


class OutOfMemoryTimeout(Rejection):
    code = "OUT_OF_MEMORY"
