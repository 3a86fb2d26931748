"""The service core: decide -> append -> fold -> effects, for one server.

Synchronous and free of I/O other than the memory adapter: the Trio shell
(``gms.server.session``) owns sockets, waiting and time, and calls in here.
Every state change goes through :meth:`ServiceCore.record`, which appends to
the event log (the log folds) and then hands the memory each event released
to the backend.  Lock waiters are kept here in arrival order, each with a
callback the shell uses to wake its task; :func:`gms.fsm.schedule` decides who
is granted whenever a lock is released.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterable

import attrs

from ..cuda import MemoryBackend, align_up
from ..fsm import (
    GrantedLockType,
    Limits,
    RequestedLockType,
    decide_allocate,
    decide_commit,
    decide_disconnect,
    decide_free,
    decide_metadata_delete,
    decide_metadata_put,
    decide_metadata_put_many,
    queries,
    released_allocations,
    schedule,
    validate_allocate,
)
from ..fsm.errors import LimitExceeded, Rejection
from ..fsm.events import Event, RoDisconnect, RwAbort, RwCommit
from ..fsm.state import Allocation, State
from ..store import EventLog, LogEntry
from ..wire import messages as m
from ..wire.messages import MAX_FDS_PER_MESSAGE

GrantCallback = Callable[[GrantedLockType], None]


class UnknownRequest(Rejection):
    code = "UNKNOWN_MESSAGE"
_RELEASES_LOCK = (RwCommit, RwAbort, RoDisconnect)
_SCAN_CACHE_PREFIXES = 16  # distinct prefixes remembered; models have one or a few


@attrs.frozen
class Reply:
    message: object
    fds: tuple[int, ...] = ()
    close_after: bool = False


def _info(a: Allocation, cls: type = m.AllocationInfo):
    return cls(a.allocation_id, a.size, a.aligned_size, a.tag, a.layout_slot)


def history_entry(entry: LogEntry) -> dict:
    """One event as the history probe shows it."""
    event = entry.event
    row = {"seq": entry.seq, "kind": event.KIND, "time": entry.wall_ns / 1e9, "mono_ns": entry.mono_ns}
    row.update(attrs.asdict(event))
    return row


class ServiceCore:
    def __init__(
        self,
        backend: MemoryBackend,
        *,
        tag: str = "weights",
        limits: Limits = Limits(),
        log: EventLog | None = None,
        history_max_events: int = 10_000,
        history_max_bytes: int = 8 << 20,
    ) -> None:
        self.backend = backend
        self.tag = tag
        self.limits = limits
        self.log = log if log is not None else EventLog()
        self.history_max_events = history_max_events
        self.history_max_bytes = history_max_bytes
        self.allocations_cleared = 0
        self.started = time.monotonic()
        self._next_conn = 1
        self._scans: dict[str, tuple[object, m.MetadataScanResponse]] = {}
        self._waiting: dict[int, tuple[RequestedLockType, GrantCallback]] = {}
        self._handlers: dict[type, Callable[[int, object], Reply]] = {
            m.ExportAllocationRequest: self._export,
            m.ExportAllocationsRequest: self._export_many,
            m.GetAllocationRequest: self._get_allocation,
            m.ListAllocationsRequest: self._list_allocations,
            m.FreeAllocationRequest: self._free,
            m.CommitRequest: self._commit,
            m.MetadataPutRequest: self._metadata_put,
            m.MetadataPutManyRequest: self._metadata_put_many,
            m.MetadataGetRequest: self._metadata_get,
            m.MetadataDeleteRequest: self._metadata_delete,
            m.MetadataListRequest: self._metadata_list,
            m.MetadataScanRequest: self._metadata_scan,
            m.GetStateHashRequest: self._state_hash,
            m.GetRuntimeStateRequest: lambda conn, req: Reply(self.runtime_state()),
            m.GetEventHistoryRequest: lambda conn, req: Reply(self.history(req.since_seq, req.limit)),
        }

    @property
    def state(self) -> State:
        return self.log.state

    def new_conn(self) -> int:
        conn = self._next_conn
        self._next_conn += 1
        return conn

    # -- the one write path ---------------------------------------------------

    def record(self, events: Iterable[Event]) -> None:
        """Append each event (the log folds it), then apply what it released."""
        released_lock = False
        for event in events:
            before = self.log.state
            self.log.append(event)  # an InvariantViolation here stops the server
            for allocation in released_allocations(before, event):
                self.backend.release(allocation.allocation_id)
                self.allocations_cleared += 1
            released_lock = released_lock or isinstance(event, _RELEASES_LOCK)
        if released_lock:
            self._grant_waiters()

    # -- locks ------------------------------------------------------------------

    def request_lock(self, conn: int, requested: RequestedLockType, on_grant: GrantCallback) -> None:
        """Queue a handshake; ``on_grant`` runs (maybe at once) when it is granted."""
        self._waiting[conn] = (requested, on_grant)
        self._grant_waiters()

    def cancel_lock_request(self, conn: int) -> None:
        if self._waiting.pop(conn, None) is not None:
            self._grant_waiters()  # a writer leaving the queue may unblock readers

    def _grant_waiters(self) -> None:
        waiting = [(conn, requested) for conn, (requested, _) in self._waiting.items()]
        for grant in schedule(self.state, waiting):
            self.record([grant.event])
            _, on_grant = self._waiting.pop(grant.conn)
            on_grant(grant.granted)

    def waiting_counts(self) -> tuple[int, int]:
        """(writers, others) waiting for a lock."""
        writers = sum(1 for r, _ in self._waiting.values() if r is RequestedLockType.RW)
        return writers, len(self._waiting) - writers

    def disconnect(self, conn: int) -> None:
        """Whatever ended the connection, release what it held or waited for."""
        self.cancel_lock_request(conn)
        self.record(decide_disconnect(self.state, conn))

    # -- allocation (the shell owns the out-of-memory wait) -----------------------

    def allocate(self, conn: int, size: int, tag: str) -> m.AllocateResponse:
        """Raises Rejection, or OutOfMemory for the shell to retry."""
        validate_allocate(self.state, conn, size, tag, self.limits)
        aligned = align_up(size, self.backend.granularity)
        allocation_id = uuid.uuid4().hex
        self.backend.create(allocation_id, aligned)
        try:
            events = decide_allocate(self.state, conn, allocation_id, size, aligned, tag, self.limits)
        except BaseException:
            self.backend.release(allocation_id)
            raise
        self.record(events)
        (created,) = events
        return m.AllocateResponse(allocation_id, size, aligned, created.layout_slot)

    # -- everything else: one synchronous handler per request --------------------

    def handle(self, conn: int, request: object) -> Reply:
        """Raises Rejection for an invalid request (the shell answers an error)."""
        handler = self._handlers.get(type(request))
        if handler is None:
            raise UnknownRequest(f"{type(request).__name__} is not a request this server takes")
        return handler(conn, request)

    def _export(self, conn: int, req: m.ExportAllocationRequest) -> Reply:
        allocation = queries.get_allocation(self.state, conn, req.allocation_id)
        fd = self.backend.export(allocation.allocation_id)
        return Reply(_info(allocation, m.ExportAllocationResponse), fds=(fd,))

    def _export_many(self, conn: int, req: m.ExportAllocationsRequest) -> Reply:
        if len(req.allocation_ids) > MAX_FDS_PER_MESSAGE:
            raise LimitExceeded(f"at most {MAX_FDS_PER_MESSAGE} allocations per export")
        found = [queries.get_allocation(self.state, conn, i) for i in req.allocation_ids]
        fds: list[int] = []
        try:
            for allocation in found:
                fds.append(self.backend.export(allocation.allocation_id))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return Reply(m.ExportAllocationsResponse([_info(a) for a in found]), fds=tuple(fds))

    def _get_allocation(self, conn: int, req: m.GetAllocationRequest) -> Reply:
        allocation = queries.get_allocation(self.state, conn, req.allocation_id)
        return Reply(_info(allocation, m.GetAllocationResponse))

    def _list_allocations(self, conn: int, req: m.ListAllocationsRequest) -> Reply:
        found = queries.list_allocations(self.state, conn, req.tag)
        return Reply(m.ListAllocationsResponse([_info(a) for a in found]))

    def _free(self, conn: int, req: m.FreeAllocationRequest) -> Reply:
        self.record(decide_free(self.state, conn, req.allocation_id))
        return Reply(m.FreeAllocationResponse(True))

    def _commit(self, conn: int, req: m.CommitRequest) -> Reply:
        (commit,) = decide_commit(self.state, conn)
        # The lock is released (and waiters granted: a writer clears the hash
        # at once) before the response goes out, so the hash comes from the event.
        self.record([commit])
        return Reply(m.CommitResponse(True, commit.layout_hash), close_after=True)

    def _metadata_put(self, conn: int, req: m.MetadataPutRequest) -> Reply:
        self.record(
            decide_metadata_put(
                self.state, conn, req.key, req.allocation_id, req.offset_bytes, req.value, self.limits
            )
        )
        return Reply(m.MetadataPutResponse(True))

    def _metadata_put_many(self, conn: int, req: m.MetadataPutManyRequest) -> Reply:
        entries = [(e.key, e.allocation_id, e.offset_bytes, e.value) for e in req.entries]
        events = decide_metadata_put_many(self.state, conn, entries, self.limits)
        self.record(events)
        return Reply(m.MetadataPutManyResponse(True, len(events)))

    def _metadata_get(self, conn: int, req: m.MetadataGetRequest) -> Reply:
        entry = queries.get_metadata(self.state, conn, req.key)
        if entry is None:
            return Reply(m.MetadataGetResponse(False))
        return Reply(m.MetadataGetResponse(True, entry.allocation_id, entry.offset_bytes, entry.value))

    def _metadata_delete(self, conn: int, req: m.MetadataDeleteRequest) -> Reply:
        events = decide_metadata_delete(self.state, conn, req.key)
        self.record(events)
        return Reply(m.MetadataDeleteResponse(bool(events)))

    def _metadata_list(self, conn: int, req: m.MetadataListRequest) -> Reply:
        return Reply(m.MetadataListResponse(queries.list_metadata(self.state, conn, req.prefix)))

    def _metadata_scan(self, conn: int, req: m.MetadataScanRequest) -> Reply:
        state = self.state
        queries.require_view(state, conn, "metadata_scan")
        cached = self._scans.get(req.prefix)
        # A committed layout's metadata never changes, so every reader of a
        # model shares one answer; any change makes a new map, which misses.
        if cached is not None and cached[0] is state.metadata:
            return Reply(cached[1])
        entries = queries.scan_metadata(state, conn, req.prefix)
        response = m.MetadataScanResponse(
            [e.key for e in entries],
            [e.allocation_id for e in entries],
            [e.offset_bytes for e in entries],
            [e.value for e in entries],
        )
        if len(self._scans) >= _SCAN_CACHE_PREFIXES:
            self._scans.clear()
        self._scans[req.prefix] = (state.metadata, response)
        return Reply(response)

    def _state_hash(self, conn: int, req: m.GetStateHashRequest) -> Reply:
        return Reply(m.GetStateHashResponse(self.state.layout_hash or ""))

    # -- probes -------------------------------------------------------------------

    def runtime_state(self) -> m.GetRuntimeStateResponse:
        state = self.state
        writers, others = self.waiting_counts()
        handles, handle_bytes = self.backend.live_handles()
        info = self.backend.device_info()
        return m.GetRuntimeStateResponse(
            state=state.lock_state.value,
            has_rw_session=state.writer is not None,
            ro_session_count=len(state.readers),
            waiting_writers=writers,
            committed=state.committed,
            allocation_count=len(state.allocations),
            total_bytes=state.total_bytes,
            memory_layout_hash=state.layout_hash or "",
            backend=self.backend.name,
            device=self.backend.device,
            waiting_readers=others,
            allocations_cleared=self.allocations_cleared,
            device_name=info.name,
            device_uuid=info.uuid,
            device_total_bytes=info.total_bytes,
            device_free_bytes=info.free_bytes,
            server_handle_count=handles,
            server_handle_bytes=handle_bytes,
            last_event_seq=self.log.last_seq,
            uptime_s=time.monotonic() - self.started,
            pid=os.getpid(),
            tag=self.tag,
        )

    def history(self, since_seq: int | None, limit: int | None) -> m.GetEventHistoryResponse:
        """Events after ``since_seq``, capped by count and (roughly) by bytes."""
        cap = self.history_max_events if limit is None else max(0, min(limit, self.history_max_events))
        rows: list[dict] = []
        budget = self.history_max_bytes
        for entry in self.log.since(since_seq or 0, cap):
            row = history_entry(entry)
            budget -= 96 + sum(len(v) for v in row.values() if isinstance(v, str | bytes))
            if rows and budget < 0:
                break
            rows.append(row)
        return m.GetEventHistoryResponse(rows, self.log.first_seq, self.log.last_seq)
