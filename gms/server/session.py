"""One connection's task: read a request, decide, answer; unwind on any exit.

The trust boundary of the seed, in one place:

* a frame that cannot be read or decoded drops the connection
  (``CONNECTION_DROPPED``, then its lock is unwound);
* a decodable but invalid request gets an ``ErrorResponse``, the session goes on;
* a failed send unwinds like a drop;
* anything else (a broken invariant, a CUDA failure, a bug) is not caught
  here: it crashes the server's nursery and the server exits non-zero.
"""

from __future__ import annotations

import logging
import math
import os

import trio

from ..cuda import OutOfMemory
from ..fsm import RequestedLockType
from ..fsm.errors import InvalidArgument, Rejection, StateViolation
from ..fsm.events import AllocationOomGaveUp, AllocationOomWait, ConnectionDropped, LockTimeout
from ..wire import FrameDecoder, ProtocolError, UnknownMessageType, decode, encode
from ..wire import messages as m
from .config import ServerConfig
from .core import Reply, ServiceCore
from .netio import PeerGone, SendFailed, send_frame, wait_for_hangup, wait_or_hangup

log = logging.getLogger("gms.server")

_RECV_BYTES = 16 * 1024


def is_cancellation(exc: BaseException) -> bool:
    """Cancelled, or a group (from an inner nursery) of nothing but Cancelled."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(trio.Cancelled)[1] is None
    return isinstance(exc, trio.Cancelled)


class Session:
    def __init__(
        self,
        core: ServiceCore,
        config: ServerConfig,
        sock: trio.socket.SocketType,
        device_uuid: str,
    ) -> None:
        self.core = core
        self.config = config
        self.sock = sock
        self.device_uuid = device_uuid
        self.conn = core.new_conn()
        self.handshaken = False
        self._decoder = FrameDecoder(config.max_frame_bytes)
        self._buffer = bytearray(_RECV_BYTES)  # recv() would allocate one per call

    async def run(self) -> None:
        unwind = True
        try:
            await self._serve()
        except ProtocolError as exc:
            log.warning("conn %d dropped: %s", self.conn, exc)
            self.core.record([ConnectionDropped(self.conn, str(exc))])
        except SendFailed as exc:
            log.info("conn %d: send failed: %s", self.conn, exc)
            self.core.record([ConnectionDropped(self.conn, f"send failed: {exc}")])
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

    async def _send(self, reply: Reply) -> None:
        try:
            await send_frame(self.sock, encode(reply.message), reply.fds)
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
            if first and isinstance(request, m.PROBES):
                # A probe answers and closes; it never touches the lock FSM.
                await self._send(self.core.handle(self.conn, request))
                return
            first = False
            try:
                if isinstance(request, m.HandshakeRequest):
                    reply = await self._handshake(request)
                elif isinstance(request, m.AllocateRequest):
                    reply = await self._allocate(request)
                else:
                    reply = self.core.handle(self.conn, request)
            except Rejection as rejection:
                reply = Reply(m.ErrorResponse(rejection.message, rejection.code))
            await self._send(reply)
            if reply.close_after:
                return

    async def _handshake(self, request: m.HandshakeRequest) -> Reply:
        if self.handshaken:
            raise StateViolation("this connection has already handshaken")
        try:
            requested = RequestedLockType(request.lock_type)
        except ValueError:
            raise InvalidArgument(f"unknown lock type {request.lock_type!r}") from None
        if request.timeout_ms is not None and request.timeout_ms < 0:
            raise InvalidArgument("timeout_ms must be >= 0")
        self.handshaken = True

        granted = None
        done = trio.Event()

        def on_grant(lock) -> None:
            nonlocal granted
            granted = lock
            done.set()

        self.core.request_lock(self.conn, requested, on_grant)
        if granted is None:
            hung_up = False
            timeout = math.inf if request.timeout_ms is None else request.timeout_ms / 1000
            with trio.move_on_after(timeout):
                hung_up = await wait_or_hangup(done.wait, self.sock)
            if granted is None:
                self.core.cancel_lock_request(self.conn)
                if hung_up:
                    raise PeerGone("hung up while waiting for the lock")
                self.core.record([LockTimeout(self.conn, requested.value, request.timeout_ms or 0)])
                return Reply(self._handshake_response(None), close_after=True)
        return Reply(self._handshake_response(granted))

    def _handshake_response(self, granted) -> m.HandshakeResponse:
        state = self.core.state
        return m.HandshakeResponse(
            success=granted is not None,
            committed=state.committed,
            granted_lock_type=None if granted is None else granted.value,
            backend=self.core.backend.name,
            device=self.core.backend.device,
            device_uuid=self.device_uuid,
            memory_layout_hash=state.layout_hash or "",
        )

    async def _allocate(self, request: m.AllocateRequest) -> Reply:
        """Out-of-memory is transient: retry until memory frees, time runs out,
        or the writer hangs up (then stop at once)."""
        interval = self.config.alloc_retry_interval
        timeout = self.config.alloc_retry_timeout
        started = None
        while True:
            try:
                return Reply(self.core.allocate(self.conn, request.size, request.tag))
            except OutOfMemory:
                pass
            now = trio.current_time()
            if started is None:
                started = now
                self.core.record([AllocationOomWait(self.conn, request.size, request.tag)])
            waited = now - started
            if timeout is not None and waited >= timeout:
                self.core.record(
                    [AllocationOomGaveUp(self.conn, request.size, request.tag, "timeout", int(waited * 1000))]
                )
                return Reply(
                    m.ErrorResponse(
                        f"out of memory: no {request.size} bytes after waiting {waited:.1f} s",
                        "OUT_OF_MEMORY",
                    )
                )
            pause = interval if timeout is None else min(interval, timeout - waited)
            with trio.move_on_after(pause):
                await wait_for_hangup(self.sock)
                waited = trio.current_time() - started
                self.core.record(
                    [AllocationOomGaveUp(self.conn, request.size, request.tag, "disconnect", int(waited * 1000))]
                )
                raise PeerGone("hung up while waiting for memory")
