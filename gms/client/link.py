"""A client's connection to its server, and its life: the handshake (a lock,
heartbeats while it waits, a restore if this reader is asked to), a deadline on
every reply, and what a connection the server ended leaves: a reader rides
through (its lock taken back from whatever server answers on the socket, on the
very layout it mapped: ``expect_hash``), a writer's build is gone (BuildLostError),
a revoked session stays ended (LockRevokedError).  The manager
(``gms.client.manager``) calls it under its lock; it never touches a mapping
but to find each one's allocation again after a ride through.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import attrs

from ..cuda import open_mapper
from ..errors import (
    BuildLostError,
    GMSConnectionError,
    GMSError,
    GMSUsageError,
    LockTimeoutError,
    ResponseTimeoutError,
    ServerGoneError,
    SessionEndedError,
    SnapshotNotServedError,
    StaleMemoryLayoutError,
)
from ..fsm import GrantedLockType, RequestedLockType
from ..wire import messages as m
from ..wire.messages import MAX_FDS_PER_MESSAGE
from . import tiering
from .resources import HandleInfo, Mapping, Resources, handle_info
from .transport import RpcTransport, _close_all

log = logging.getLogger("gms.client")

HEARTBEAT_MS = 1000  # asked of a server while a handshake waits for its lock
# A live server answers a handshake, or says it waits (a heartbeat), within a
# heartbeat: ten of them without a word is a server that accepted and hangs.
FIRST_WORD_S = 10 * HEARTBEAT_MS / 1000
# Requests that may wait for memory on the server (its --alloc-retry-timeout
# decides how long): bounded by ``memory_timeout_s``, not ``call_timeout_s``.
_MEMORY_WAITS = (m.AllocateRequest, m.ExportHostCopiesRequest)
_FIRST_PAUSE_S = 0.01  # riding through: the first retry, doubling up to _MAX_PAUSE_S
_MAX_PAUSE_S = 0.5
_RIDE_REPLY_MARGIN_S = 1.0  # past the reconnect deadline, for the handshake's answer
_DEFAULT = object()


@attrs.frozen
class _Lost:
    """A connection the server ended: the lock it held, and how it ended
    (ServerGoneError: the server went away; SessionEndedError: on purpose)."""

    lock: GrantedLockType
    error: GMSConnectionError


class ServerLink:
    """The connection of one manager: its transport (in ``res``, which the manager's
    finalizer releases), the lock granted, the connection the server ended (``lost``)."""

    def __init__(self, res: Resources, socket_path: str, *, device: int, layout: str,
                 call_timeout_s: float | None, memory_timeout_s: float | None, reconnect_timeout_s: float) -> None:
        self.res = res
        self.socket_path = socket_path
        self.device = device
        self.layout = layout
        self.call_timeout_s = call_timeout_s
        self.memory_timeout_s = memory_timeout_s
        self.reconnect_timeout_s = reconnect_timeout_s
        self.reconnects = 0  # rides through a server restart so far
        self.granted: GrantedLockType | None = None
        self.lost: _Lost | None = None  # the connection the server ended, until connect/abort/close
        self.backend: str | None = None
        self.server_hash = ""  # the committed hash the last handshake saw

    @property
    def connected(self) -> bool:
        """The kernel is asked: a server that died (or revoked the lock) while the
        manager was idle shows at once."""
        transport = self.res.transport
        return transport is not None and not transport.hung_up()

    def connect(self, lock: RequestedLockType, timeout_ms: int | None, limit_bytes: int | None) -> None:
        """A new connection, on the manager's word: what the server ended before is forgotten."""
        self.lost = None
        reply = None
        if timeout_ms is not None and self.call_timeout_s is not None:
            reply = timeout_ms / 1000 + self.call_timeout_s
        self.open(lock, timeout_ms, reply, limit_bytes=limit_bytes)

    def open(
        self,
        lock: RequestedLockType,
        timeout_ms: int | None,
        reply_timeout: float | None,
        *,
        limit_bytes: int | None = None,
        expect_hash: str = "",
    ) -> None:
        connect_timeout = 10.0 if reply_timeout is None else min(10.0, reply_timeout)
        transport = RpcTransport(self.socket_path, connect_timeout=connect_timeout, timeout=self.call_timeout_s)
        try:
            # A lock may take as long as it takes; a server that says nothing for
            # call_timeout_s (one that accepted and hangs, or a squatter) does not.
            idle = self.call_timeout_s
            heartbeat = None if idle is None else max(100, min(HEARTBEAT_MS, int(idle * 1000 / 4)))
            request = m.HandshakeRequest(lock.value, timeout_ms, self.layout, limit_bytes, expect_hash, heartbeat)
            response, _ = transport.call(request, m.HandshakeResponse, reply_timeout, idle=idle,
                                         first_word=FIRST_WORD_S)
            if not response.success:
                asked = f"{lock.value} lock on layout {self.layout!r} at {self.socket_path}"
                if response.unserved:
                    raise SnapshotNotServedError(
                        f"{asked} not granted: nothing comes from disk (its last snapshot was not served, "
                        f"{response.unserved}) and no writer builds it", response.unserved)
                raise LockTimeoutError(f"{asked} not granted in {timeout_ms} ms")
            if response.max_frame_bytes > 0:
                transport.max_request_bytes = response.max_frame_bytes
            self._attach_mapper(response)
            if response.restore:
                tiering.restore(transport.call, self.res.mapper)
        except BaseException:
            transport.close()
            raise
        self.res.transport = transport
        self.granted = GrantedLockType(response.granted_lock_type)
        self.server_hash = response.memory_layout_hash

    def _attach_mapper(self, response: m.HandshakeResponse) -> None:
        if self.backend is None:
            self.res.mapper = open_mapper(response.backend, self.device)
            self.backend = response.backend
        elif self.backend != response.backend:
            raise GMSUsageError(
                f"server now runs the {response.backend} backend; this manager maps {self.backend}"
            )
        mine = getattr(self.res.mapper, "device_uuid", None)
        if response.device_uuid and mine and mine != response.device_uuid:
            raise GMSUsageError(
                f"the server manages {response.device_uuid}, but device {self.device} "
                f"of this process is {mine}"
            )


    def drop(self) -> None:
        """Forget the connection, closing it: the manager's own doing."""
        transport, self.res.transport = self.res.transport, None
        if transport is not None:
            transport.close()
        self.granted = None

    def _lose(self, error: GMSConnectionError) -> None:
        """The server ended the connection: forget it, remember why and what lock it held."""
        granted = self.granted
        self.drop()
        if granted is not None:
            self.lost = _Lost(granted, error)

    def settle(self) -> None:
        """Notice a connection the server ended while the manager was idle."""
        transport = self.res.transport
        if transport is not None and transport.hung_up():
            self._lose(transport.ended())

    def resume(self, action: str, timeout_s: float | None = None) -> None:
        """No connection: ride a reader through its server's restart, or raise
        why there is none."""
        lost = self.lost
        if lost is None:
            raise GMSUsageError(f"{action} needs a connection: call connect() first")
        error = lost.error
        if isinstance(error, SessionEndedError):
            raise type(error)(error.reason, f"{error} (earlier; connect() again)")
        if lost.lock is GrantedLockType.RW:
            raise BuildLostError(
                f"the gms server at {self.socket_path} went away while this writer built layout "
                f"{self.layout!r}: the build is gone ({error}); connect(RW) to build again"
            ) from error
        budget = self.reconnect_timeout_s if timeout_s is None else timeout_s
        if budget <= 0:
            raise ServerGoneError(f"{error} (riding through is off: reconnect_timeout_s=0)") from error
        self._ride_through(budget)

    def _ride_through(self, budget: float) -> None:
        """Take the reader's lock back from whatever server answers on the socket,
        on the very layout it held (``expect_hash``), retrying with backoff
        until ``budget`` seconds pass.  The mappings are never touched: their
        memory lives as long as they are mapped, whatever the server does."""
        expect = self.server_hash
        started = time.monotonic()
        deadline = started + budget
        pause = _FIRST_PAUSE_S
        last: Exception = self.lost.error
        log.warning(
            "gms server at %s went away (%s): taking the RO lock on %r (hash %s) back, for up to %.1f s",
            self.socket_path, last, self.layout, expect[:12], budget,
        )
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ServerGoneError(
                    f"the gms server at {self.socket_path} went away and no server gave the RO lock on "
                    f"layout {self.layout!r} back within {budget} s (last: {last})"
                ) from last
            try:
                self.open(
                    RequestedLockType.RO, max(1, int(left * 1000)), left + _RIDE_REPLY_MARGIN_S,
                    expect_hash=expect,
                )
                self._rebind_mappings()
                break
            except (LockTimeoutError, ResponseTimeoutError):
                self.drop()
                raise  # a server is there but did not grant in time: the next call tries again
            except GMSConnectionError as exc:
                self.drop()
                if isinstance(exc, SessionEndedError):
                    self.lost = None
                    raise
                last = exc  # no server yet, or it went away again
            except BaseException:
                self.drop()
                self.lost = None  # stale, refused, or a bug: nothing left to take back
                raise
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, _MAX_PAUSE_S)
        self.lost = None
        self.reconnects += 1
        log.warning(
            "rode through to the gms server at %s in %.2f s: RO on %r, same layout",
            self.socket_path, time.monotonic() - started, self.layout,
        )

    def _rebind_mappings(self) -> None:
        """A server that rebuilt the same layout (same hash) may have given its
        allocations new ids: find each mapping's by slot, size and tag."""
        if self.res.mappings:
            response, _ = self.res.transport.call(m.ListAllocationsRequest(), m.ListAllocationsResponse)
            self.match_by_shape(list(self.res.mappings.values()), [handle_info(a) for a in response.allocations])

    @staticmethod
    def match_by_shape(mappings: list[Mapping], allocations: list[HandleInfo]) -> None:
        by_shape = {(a.layout_slot, a.size, a.tag): a for a in allocations}
        for mapping in mappings:
            found = by_shape.get((mapping.layout_slot, mapping.alloc_size, mapping.tag))
            if found is None or found.aligned_size != mapping.size:
                raise StaleMemoryLayoutError(
                    f"no allocation of slot {mapping.layout_slot}, {mapping.alloc_size} bytes, "
                    f"tag {mapping.tag!r} in the committed layout"
                )
        for mapping in mappings:
            mapping.allocation_id = by_shape[(mapping.layout_slot, mapping.alloc_size, mapping.tag)].allocation_id

    def transport(self, action: str) -> RpcTransport:
        if self.res.transport is None:
            self.resume(action)
        return self.res.transport

    def call(self, request: object, expect: type, timeout=_DEFAULT):
        if timeout is _DEFAULT:
            timeout = self.memory_timeout_s if isinstance(request, _MEMORY_WAITS) else self.call_timeout_s
        action = type(request).__name__
        transport = self.transport(action)
        try:
            return transport.call(request, expect, timeout)
        except GMSError as exc:
            self._after_failure(transport, exc)
            lost = self.lost
            if not (isinstance(exc, ServerGoneError) and lost is not None):
                raise
            if lost.lock is GrantedLockType.RW and isinstance(request, m.CommitRequest):
                self.lost = None
                raise BuildLostError(
                    f"the gms server at {self.socket_path} went away during commit: whether layout "
                    f"{self.layout!r} was published is unknown (gms status shows it)"
                ) from exc
        # The server went away under this manager: ride through (a reader) or
        # raise why not, then ask once more.
        transport = self.transport(action)
        try:
            return transport.call(request, expect, timeout)
        except GMSError as exc:
            self._after_failure(transport, exc)
            raise

    def _after_failure(self, transport: RpcTransport, exc: GMSError) -> None:
        """A call that failed may have closed its transport: say whose doing it was."""
        if not transport.closed or self.res.transport is not transport:
            return
        if isinstance(exc, ServerGoneError | SessionEndedError):
            self._lose(exc)
        else:
            self.drop()  # a deadline passed, or an unreadable frame: ours to end

    def require(self, lock: GrantedLockType, action: str) -> None:
        self.transport(action)
        if lock is GrantedLockType.RW and self.granted is not GrantedLockType.RW:
            raise GMSUsageError(f"{action} needs the RW lock; this manager holds {self.granted.value}")

    def export_many(self, allocation_ids: Sequence[str]) -> list[tuple[HandleInfo, int]]:
        """Many exports in few round trips (at most 253 fds each); the caller closes the fds."""
        out: list[tuple[HandleInfo, int]] = []
        try:
            for start in range(0, len(allocation_ids), MAX_FDS_PER_MESSAGE):
                batch = list(allocation_ids[start : start + MAX_FDS_PER_MESSAGE])
                response, fds = self.call(m.ExportAllocationsRequest(batch), m.ExportAllocationsResponse)
                if len(fds) != len(response.allocations):
                    _close_all(fds)
                    raise GMSError(f"expected {len(response.allocations)} fds, got {len(fds)}")
                out.extend(zip((handle_info(a) for a in response.allocations), fds))
        except BaseException:
            _close_all([fd for _, fd in out])
            raise
        return out
