"""The service core: decide -> append -> fold -> effects, for one node (one GPU).

Synchronous and free of I/O other than the memory adapters: the Trio shell
(``gms.server.session``) owns sockets, waiting and time, and calls in here.
Every state change goes through :meth:`ServiceCore.record`, which appends to
the event log (the log folds) and then hands the memory each event released
to its tier's adapter.  Lock waiters are kept here, one queue per layout in
arrival order, each with a callback the shell uses to wake its task;
:func:`gms.fsm.schedule` decides who is granted whenever a layout changes.
"""

from __future__ import annotations

import errno
import os
import time
import uuid
from collections.abc import Callable, Iterable

import attrs

from ..cuda import MemoryBackend, OutOfMemory, align_up
from ..fsm import (
    Grant,
    Limits,
    MemoryTier,
    NodeState,
    RequestedLockType,
    admit_allocation,
    admit_host_copy,
    admit_restore,
    decide_allocate,
    decide_commit,
    decide_disconnect,
    decide_evict,
    decide_free,
    decide_host_copy,
    decide_metadata_delete,
    decide_metadata_put,
    decide_metadata_put_many,
    decide_pin,
    decide_restore_finished,
    decide_restore_loading,
    decide_session,
    eviction_candidates,
    holders,
    plan_evictions,
    queries,
    released_memory,
    schedule,
    validate_allocate,
    validate_layout_name,
)
from ..fsm.decide import lookup_allocation, require_writer
from ..fsm.errors import (
    InvalidArgument,
    LimitExceeded,
    NotConnected,
    PermissionDenied,
    Rejection,
    StateViolation,
)
from ..fsm.events import Event, LayoutRevoked, ServerStarted, SessionRefused
from ..fsm.state import Allocation, LayoutState, Tier
from ..policy import OPEN_POLICY, Policy, TenantPolicy
from ..status import layout_rows, tenant_rows
from ..store import EventLog, LogEntry
from ..wire import messages as m
from ..wire.messages import MAX_FDS_PER_MESSAGE
from .peer import Peer

GrantCallback = Callable[[Grant], None]
_SCAN_CACHE_ENTRIES = 64  # (layout, prefix) pairs remembered; models have one or a few


@attrs.frozen
class Waiter:
    """A queued handshake: what it asked for, how to wake its task, and whether
    its client is still there (the shell asks the kernel; a dead client is
    never granted a lock, least of all one that clears a committed layout)."""

    requested: RequestedLockType
    on_grant: GrantCallback
    alive: Callable[[], bool] = lambda: True


class UnknownRequest(Rejection):
    code = "UNKNOWN_MESSAGE"


class ResourceExhausted(Rejection):
    """The server could not open another fd (its table or the system's is full)."""

    code = "RESOURCE_EXHAUSTED"


_FD_EXHAUSTED = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)


def export_fd(tier: MemoryBackend, allocation_id: str) -> int:
    """A new fd for an allocation.  Running out of fds (a flood of connections
    can fill the table) refuses this request; it must never stop the server."""
    try:
        return tier.export(allocation_id)
    except OSError as exc:
        if exc.errno in _FD_EXHAUSTED:
            raise ResourceExhausted(
                f"the server cannot open another file descriptor ({exc.strerror}); try again later"
            ) from None
        raise


@attrs.frozen
class Reply:
    message: object
    fds: tuple[int, ...] = ()
    close_after: bool = False


def _info(a: Allocation, cls: type = m.AllocationInfo, aligned: int | None = None):
    return cls(a.allocation_id, a.size, a.aligned_size if aligned is None else aligned, a.tag, a.layout_slot)


def history_entry(entry: LogEntry) -> dict:
    """One event as the history probe shows it."""
    event = entry.event
    row = {"seq": entry.seq, "kind": event.KIND, "time": entry.wall_ns / 1e9, "mono_ns": entry.mono_ns}
    row.update(attrs.asdict(event))
    return row


class ServiceCore:
    def __init__(
        self,
        gpu: MemoryBackend,
        host: MemoryBackend | None = None,
        *,
        policy: Policy = OPEN_POLICY,
        limits: Limits = Limits(),
        log: EventLog | None = None,
        budget_bytes: int | None = None,
        host_budget_bytes: int | None = None,
        history_max_events: int = 10_000,
        history_max_bytes: int = 8 << 20,
        server_uid: int | None = None,
    ) -> None:
        self.gpu = gpu
        self.host = host
        self.policy = policy
        self.limits = limits
        self.log = log if log is not None else EventLog()
        self.history_max_events = history_max_events
        self.history_max_bytes = history_max_bytes
        self.server_uid = os.getuid() if server_uid is None else server_uid
        self.allocations_cleared = 0
        self.started = time.monotonic()
        self._next_conn = 1
        self._scans: dict[tuple[str, str], tuple[object, m.MetadataScanResponse]] = {}
        self._waiting: dict[str, dict[int, Waiter]] = {}
        self._waiting_view: dict[str, tuple[int, int]] = {}  # replaced, never mutated: for threads
        self._revoke_hooks: dict[int, Callable[[], None]] = {}
        # Set by the shell: called whenever server-owned memory was released.
        self.on_memory_released: Callable[[], None] = lambda: None
        # Set by the shell (metrics): called with every appended event.
        self.on_event: Callable[[Event], None] = lambda event: None
        info = gpu.device_info()
        self.record([
            ServerStarted(
                0, info.total_bytes, budget_bytes, host_budget_bytes if host is not None else 0,
                policy.quotas(), gpu.name, gpu.device, info.uuid, layout="",
            )
        ])
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
        }

    @property
    def state(self) -> NodeState:
        return self.log.state

    def new_conn(self) -> int:
        conn = self._next_conn
        self._next_conn += 1
        return conn

    # -- the one write path ---------------------------------------------------

    def record(self, events: Iterable[Event]) -> None:
        """Append each event (the log folds it), apply what it released, then
        grant whoever the changed layouts can take now."""
        touched: list[str] = []
        released = False
        for event in events:
            released = self._append(event) or released
            if event.layout and event.layout not in touched:
                touched.append(event.layout)
        for layout in touched:
            self._grant_waiters(layout)
        if released:
            self.on_memory_released()

    def _append(self, event: Event) -> bool:
        before = self.log.state
        self.log.append(event)  # an InvariantViolation here stops the server
        self.on_event(event)
        releases = released_memory(before, event)
        for release in releases:
            if release.tier is MemoryTier.GPU:
                self.gpu.release(release.allocation_id)
                self.allocations_cleared += 1
            else:
                self.host.release(release.allocation_id)
        return bool(releases)

    # -- sessions and locks -------------------------------------------------------

    def tenant_of(self, peer: Peer) -> TenantPolicy | None:
        return self.policy.tenant_for(peer.uid, peer.gid)

    def open_session(self, conn: int, request: m.HandshakeRequest, peer: Peer) -> RequestedLockType:
        """Record the session (or the refusal); returns the lock to wait for."""
        try:
            requested = RequestedLockType(request.lock_type)
        except ValueError:
            raise InvalidArgument(f"unknown lock type {request.lock_type!r}") from None
        if request.timeout_ms is not None and request.timeout_ms < 0:
            raise InvalidArgument("timeout_ms must be >= 0")
        tenant = self.tenant_of(peer)
        try:
            if tenant is None:
                raise PermissionDenied(
                    f"uid {peer.uid} (gid {peer.gid}) is no tenant of this server's policy "
                    f"({self.policy.source})"
                )
            layout = validate_layout_name(request.layout)
            events = decide_session(
                self.state, conn, layout, requested,
                tenant=tenant.name,
                may_read=tenant.may_read(layout),
                may_write=tenant.may_write(layout),
                uid=peer.uid, gid=peer.gid, pid=peer.pid,
                limit_bytes=request.limit_bytes,
                limits=self.limits,
                expect_hash=request.expect_hash,
            )
        except PermissionDenied as refused:
            self.record([SessionRefused(conn, peer.uid, peer.gid, peer.pid, refused.message, layout="")])
            raise
        self.record(events)
        (opened,) = events
        return RequestedLockType(opened.lock_type)

    def request_lock(
        self,
        conn: int,
        requested: RequestedLockType,
        on_grant: GrantCallback,
        alive: Callable[[], bool] = lambda: True,
    ) -> None:
        """Queue a handshake; ``on_grant`` runs (maybe at once) when it is granted.
        ``alive`` is asked before a grant: False drops the waiter instead."""
        layout = self._session(conn).layout
        self._waiting.setdefault(layout, {})[conn] = Waiter(requested, on_grant, alive)
        self._grant_waiters(layout)  # refreshes the waiting view

    def cancel_lock_request(self, conn: int) -> None:
        session = self.state.sessions.get(conn)
        if session is None:
            return
        queue = self._waiting.get(session.layout, {})
        if queue.pop(conn, None) is not None:
            if not queue:
                del self._waiting[session.layout]
            self._refresh_waiting(session.layout)
            self._grant_waiters(session.layout)  # a writer leaving the queue may unblock readers

    def _grant_waiters(self, layout: str) -> None:
        queue = self._waiting.get(layout)
        if not queue:
            return
        # A client that died while queued may not have been noticed by its task
        # yet (its hang-up is read after this release, or hides behind a
        # request it pipelined): the kernel knows, so ask before granting.
        # Its task sees the hang-up and unwinds the session.
        for conn in [conn for conn, waiter in queue.items() if not waiter.alive()]:
            del queue[conn]
        waiting = [(conn, waiter.requested) for conn, waiter in queue.items()]
        for grant in schedule(self.state.layout(layout), waiting):
            self._append(grant.event)  # a grant releases nothing
            queue.pop(grant.conn).on_grant(grant)
        if not queue:
            del self._waiting[layout]
        self._refresh_waiting(layout)

    def _refresh_waiting(self, layout: str) -> None:
        view = dict(self._waiting_view)
        counts = self.waiting_counts(layout)
        if counts == (0, 0):
            view.pop(layout, None)
        else:
            view[layout] = counts
        self._waiting_view = view

    def waiting_snapshot(self) -> dict[str, tuple[int, int]]:
        """(writers, others) waiting per layout; safe to read from another thread."""
        return self._waiting_view

    def waiting_counts(self, layout: str | None = None) -> tuple[int, int]:
        """(writers, others) waiting for a lock on ``layout`` (None: every layout)."""
        queues = [self._waiting.get(layout, {})] if layout is not None else list(self._waiting.values())
        writers = others = 0
        for queue in queues:
            for waiter in queue.values():
                if waiter.requested is RequestedLockType.RW:
                    writers += 1
                else:
                    others += 1
        return writers, others

    def _busy(self) -> set[str]:
        """Layouts someone waits for: never evicted under them."""
        return set(self._waiting)

    def on_revoke(self, conn: int, hook: Callable[[], None]) -> None:
        """``hook`` ends the connection's task when an admin revokes its lock."""
        self._revoke_hooks[conn] = hook

    def disconnect(self, conn: int) -> None:
        """Whatever ended the connection, release what it held or waited for."""
        self._revoke_hooks.pop(conn, None)
        self.cancel_lock_request(conn)
        self.record(decide_disconnect(self.state, conn))

    # -- memory: budget, eviction, creation (the shell owns the waiting) -----------------

    def _make_room(self, needed: int) -> None:
        """Evict least-recently-used idle layouts until ``needed`` more GPU bytes fit
        the budget; OutOfMemory (the shell waits) when evicting all would not do."""
        if needed <= 0:
            return
        plan = plan_evictions(self.state, needed, self._busy())
        if plan is None:
            raise OutOfMemory(f"the GPU budget has no room for {needed} more bytes")
        for name in plan:
            self.record(decide_evict(self.state, 0, name, "budget"))

    def _create_gpu(self, allocation_id: str, aligned: int) -> None:
        """Create device memory; on a real out-of-memory (other processes hold the
        GPU) evict the least recently used idle layout and try again."""
        while True:
            try:
                self.gpu.create(allocation_id, aligned)
                return
            except OutOfMemory:
                candidates = eviction_candidates(self.state, self._busy())
                if not candidates:
                    raise
                self.record(decide_evict(self.state, 0, candidates[0].name, "oom"))

    def allocate(self, conn: int, size: int, tag: str) -> m.AllocateResponse:
        """Raises Rejection, or OutOfMemory for the shell to wait out."""
        layout = self._layout(conn)
        validate_allocate(layout, conn, size, tag, self.limits)
        aligned = align_up(size, self.gpu.granularity)
        self._make_room(admit_allocation(self.state, conn, aligned))
        allocation_id = uuid.uuid4().hex
        self._create_gpu(allocation_id, aligned)
        try:
            events = decide_allocate(self._layout(conn), conn, allocation_id, size, aligned, tag, self.limits)
            self.record(events)
        except BaseException:
            self.gpu.release(allocation_id)
            raise
        (created,) = events
        return m.AllocateResponse(allocation_id, size, aligned, created.layout_slot)

    def load_restore(self, conn: int) -> None:
        """Give an evicted layout GPU memory again, for its restorer to fill.
        Raises OutOfMemory for the shell to wait out."""
        layout = self._layout(conn)
        decide_restore_loading(self.state, conn, layout.name)  # check before spending memory
        self._make_room(admit_restore(self.state, layout))
        created: list[str] = []
        try:
            for allocation in layout.allocations.values():
                self._create_gpu(allocation.allocation_id, allocation.aligned_size)
                created.append(allocation.allocation_id)
            self.record(decide_restore_loading(self.state, conn, layout.name))
        except BaseException:
            for allocation_id in created:
                self.gpu.release(allocation_id)
            raise

    def finish_restore(self, conn: int) -> str:
        layout = self._layout(conn)
        self.record(decide_restore_finished(self.state, conn, layout.name))
        return self._layout(conn).layout_hash or ""

    # -- the host tier ------------------------------------------------------------------

    def host_copies_to_create(self, conn: int, allocation_ids: list[str]) -> list[Allocation]:
        """Check a request for host copies; returns the allocations that need one made."""
        if len(allocation_ids) > MAX_FDS_PER_MESSAGE:
            raise LimitExceeded(f"at most {MAX_FDS_PER_MESSAGE} host copies per request")
        layout = self._layout(conn)
        if self.host is None:
            raise StateViolation("this server keeps no host tier")
        found = [lookup_allocation(layout, i) for i in allocation_ids]
        if layout.restorer == conn:
            missing = [a.allocation_id for a in found if a.allocation_id not in layout.host_copies]
            if missing:
                raise StateViolation(f"{len(missing)} allocations have no host copy to restore from")
            return []
        require_writer(layout, conn, "host copies")
        new = {a.allocation_id: a for a in found if a.allocation_id not in layout.host_copies}
        admit_host_copy(self.state, sum(self._host_size(a) for a in new.values()))
        return list(new.values())

    def _host_size(self, allocation: Allocation) -> int:
        return align_up(allocation.aligned_size, self.host.granularity)

    def create_host_copy(self, allocation: Allocation) -> None:
        """The slow part (pinning host pages): the shell may run it in a thread."""
        self.host.create(allocation.allocation_id, self._host_size(allocation))

    def record_host_copies(self, conn: int, allocations: list[Allocation]) -> None:
        """Record host copies the shell created; on refusal (the writer lost its
        lock meanwhile) the memory is released and the refusal raised."""
        try:
            events: list[Event] = []
            for allocation in allocations:
                events += decide_host_copy(self._layout(conn), conn, allocation.allocation_id)
        except BaseException:
            for allocation in allocations:
                self.host.release(allocation.allocation_id)
            raise
        self.record(events)

    def export_host_copies(self, conn: int, allocation_ids: list[str]) -> Reply:
        layout = self._layout(conn)
        found = [lookup_allocation(layout, i) for i in allocation_ids]
        fds: list[int] = []
        try:
            for allocation in found:
                fds.append(export_fd(self.host, allocation.allocation_id))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        rows = [_info(a, aligned=self._host_size(a)) for a in found]
        return Reply(m.ExportHostCopiesResponse(rows), fds=tuple(fds))

    # -- admin ---------------------------------------------------------------------------

    def admin(self, conn: int, request: object, peer: Peer) -> Reply:
        if not self.policy.is_admin(peer.uid, peer.gid, self.server_uid):
            raise PermissionDenied(
                f"uid {peer.uid} may not {type(request).__name__[:-7].lower()}: admin verbs are for "
                "the server's uid, root, or a policy admin"
            )
        name = validate_layout_name(request.layout)
        if isinstance(request, m.RevokeRequest):
            return Reply(m.RevokeResponse(self.revoke(conn, name, peer)))
        if isinstance(request, m.EvictRequest):
            layout = self.state.layout(name)
            self.record(decide_evict(self.state, conn, name, "admin"))
            tier = self.state.layout(name).tier.value if name in self.state.layouts else "none"
            return Reply(m.EvictResponse(tier, layout.gpu_bytes))
        if isinstance(request, m.PinRequest):
            self.record(decide_pin(self.state, conn, name, request.residency))
            return Reply(m.PinResponse(self.state.layout(name).residency.value))
        raise UnknownRequest(f"{type(request).__name__} is not an admin request")

    def revoke(self, conn: int, layout: str, peer: Peer) -> int:
        """Take the layout's locks away: the writer aborts (its memory is
        released), readers and a restorer are dropped, the next waiter is granted.
        Idempotent: a layout nobody holds (its holder died already) revokes 0."""
        victims = holders(self.state, layout)
        self.record([LayoutRevoked(conn, peer.uid, len(victims), layout=layout)])
        for victim in victims:
            hook = self._revoke_hooks.pop(victim, None)
            self.record(decide_disconnect(self.state, victim))
            if hook is not None:
                hook()
        return len(victims)

    # -- everything else: one synchronous handler per request --------------------

    def _session(self, conn: int):
        session = self.state.sessions.get(conn)
        if session is None:
            raise NotConnected("this request needs a lock: send HandshakeRequest first")
        return session

    def _layout(self, conn: int) -> LayoutState:
        return self.state.layout(self._session(conn).layout)

    def handle(self, conn: int, request: object) -> Reply:
        """Raises Rejection for an invalid request (the shell answers an error)."""
        handler = self._handlers.get(type(request))
        if handler is None:
            raise UnknownRequest(f"{type(request).__name__} is not a request this server takes")
        return handler(conn, request)

    def _export(self, conn: int, req: m.ExportAllocationRequest) -> Reply:
        allocation = queries.get_allocation(self._layout(conn), conn, req.allocation_id)
        fd = export_fd(self.gpu, allocation.allocation_id)
        return Reply(_info(allocation, m.ExportAllocationResponse), fds=(fd,))

    def _export_many(self, conn: int, req: m.ExportAllocationsRequest) -> Reply:
        if len(req.allocation_ids) > MAX_FDS_PER_MESSAGE:
            raise LimitExceeded(f"at most {MAX_FDS_PER_MESSAGE} allocations per export")
        layout = self._layout(conn)
        found = [queries.get_allocation(layout, conn, i) for i in req.allocation_ids]
        if layout.restorer == conn and layout.tier is not Tier.RESTORING:
            raise StateViolation("the layout's GPU memory is not there yet")
        fds: list[int] = []
        try:
            for allocation in found:
                fds.append(export_fd(self.gpu, allocation.allocation_id))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return Reply(m.ExportAllocationsResponse([_info(a) for a in found]), fds=tuple(fds))

    def _get_allocation(self, conn: int, req: m.GetAllocationRequest) -> Reply:
        allocation = queries.get_allocation(self._layout(conn), conn, req.allocation_id)
        return Reply(_info(allocation, m.GetAllocationResponse))

    def _list_allocations(self, conn: int, req: m.ListAllocationsRequest) -> Reply:
        found = queries.list_allocations(self._layout(conn), conn, req.tag)
        return Reply(m.ListAllocationsResponse([_info(a) for a in found]))

    def _free(self, conn: int, req: m.FreeAllocationRequest) -> Reply:
        self.record(decide_free(self._layout(conn), conn, req.allocation_id))
        return Reply(m.FreeAllocationResponse(True))

    def _commit(self, conn: int, req: m.CommitRequest) -> Reply:
        (commit,) = decide_commit(self._layout(conn), conn, req.residency or "device")
        # The lock is released (and waiters granted: a writer clears the hash
        # at once) before the response goes out, so the hash comes from the event.
        self.record([commit])
        return Reply(m.CommitResponse(True, commit.layout_hash), close_after=True)

    def _metadata_put(self, conn: int, req: m.MetadataPutRequest) -> Reply:
        self.record(
            decide_metadata_put(
                self._layout(conn), conn, req.key, req.allocation_id, req.offset_bytes, req.value,
                self.limits,
            )
        )
        return Reply(m.MetadataPutResponse(True))

    def _metadata_put_many(self, conn: int, req: m.MetadataPutManyRequest) -> Reply:
        entries = [(e.key, e.allocation_id, e.offset_bytes, e.value) for e in req.entries]
        events = decide_metadata_put_many(self._layout(conn), conn, entries, self.limits)
        self.record(events)
        return Reply(m.MetadataPutManyResponse(True, len(events)))

    def _metadata_get(self, conn: int, req: m.MetadataGetRequest) -> Reply:
        entry = queries.get_metadata(self._layout(conn), conn, req.key)
        if entry is None:
            return Reply(m.MetadataGetResponse(False))
        return Reply(m.MetadataGetResponse(True, entry.allocation_id, entry.offset_bytes, entry.value))

    def _metadata_delete(self, conn: int, req: m.MetadataDeleteRequest) -> Reply:
        events = decide_metadata_delete(self._layout(conn), conn, req.key)
        self.record(events)
        return Reply(m.MetadataDeleteResponse(bool(events)))

    def _metadata_list(self, conn: int, req: m.MetadataListRequest) -> Reply:
        return Reply(m.MetadataListResponse(queries.list_metadata(self._layout(conn), conn, req.prefix)))

    def _metadata_scan(self, conn: int, req: m.MetadataScanRequest) -> Reply:
        layout = self._layout(conn)
        queries.require_view(layout, conn, "metadata_scan")
        if len(req.prefix) > self.limits.max_key_bytes:
            # Longer than any key: it matches nothing, and must not be cached
            # (64 prefixes of a frame's size each would pin a GiB).
            return Reply(m.MetadataScanResponse([], [], [], []))
        key = (layout.name, req.prefix)
        cached = self._scans.get(key)
        # A committed layout's metadata never changes, so every reader of a
        # model shares one answer; any change makes a new map, which misses.
        if cached is not None and cached[0] is layout.metadata:
            return Reply(cached[1])
        entries = queries.scan_metadata(layout, conn, req.prefix)
        response = m.MetadataScanResponse(
            [e.key for e in entries],
            [e.allocation_id for e in entries],
            [e.offset_bytes for e in entries],
            [e.value for e in entries],
        )
        if len(self._scans) >= _SCAN_CACHE_ENTRIES:
            self._scans.clear()
        self._scans[key] = (layout.metadata, response)
        return Reply(response)

    def _state_hash(self, conn: int, req: m.GetStateHashRequest) -> Reply:
        return Reply(m.GetStateHashResponse(self._layout(conn).layout_hash or ""))

    # -- probes -------------------------------------------------------------------

    def visibility(self, peer: Peer) -> View:
        """What a peer may see in probes: admins everything, a tenant the layouts
        it may read and its own row; a peer of no tenant nothing."""
        if self.policy.is_admin(peer.uid, peer.gid, self.server_uid):
            return View(None)
        tenant = self.tenant_of(peer)
        if tenant is None:
            raise PermissionDenied(f"uid {peer.uid} is no tenant of this server's policy")
        return View(tenant)

    def probe(self, conn: int, request: object, peer: Peer) -> Reply:
        view = self.visibility(peer)
        if isinstance(request, m.GetRuntimeStateRequest):
            return Reply(self.runtime_state(view))
        if isinstance(request, m.GetEventHistoryRequest):
            return Reply(self.history(request.since_seq, request.limit, request.layout, view))
        raise UnknownRequest(f"{type(request).__name__} is not a probe")

    def _seconds_since(self, seq: int) -> float | None:
        entry = self.log.entry(seq)
        return None if entry is None else (time.monotonic_ns() - entry.mono_ns) / 1e9

    def runtime_state(self, view: View | None = None) -> m.GetRuntimeStateResponse:
        view = view or View(None)
        state = self.state
        handles, handle_bytes = self.gpu.live_handles()
        host_handles, host_handle_bytes = self.host.live_handles() if self.host else (0, 0)
        info = self.gpu.device_info()
        rows = layout_rows(state, self.waiting_counts, self._seconds_since)
        writers, others = self.waiting_counts()
        return m.GetRuntimeStateResponse(
            backend=self.gpu.name,
            device=self.gpu.device,
            device_name=info.name,
            device_uuid=info.uuid,
            capacity_bytes=state.capacity_bytes,
            budget_bytes=state.budget_bytes if state.budget_bytes is not None else state.capacity_bytes,
            used_bytes=state.gpu_bytes,
            host_budget_bytes=state.host_budget_bytes,
            host_used_bytes=state.host_bytes,
            device_free_bytes=info.free_bytes,
            server_handle_count=handles,
            server_handle_bytes=handle_bytes,
            host_handle_count=host_handles,
            host_handle_bytes=host_handle_bytes,
            allocations_cleared=self.allocations_cleared,
            sessions=len(state.sessions),
            waiting=writers + others,
            first_event_seq=self.log.first_seq,
            last_event_seq=self.log.last_seq,
            uptime_s=time.monotonic() - self.started,
            pid=os.getpid(),
            layouts=[row for row in rows if view.layout(row.name)],
            tenants=[row for row in tenant_rows(state) if view.tenant(row.name)],
        )

    def history(
        self,
        since_seq: int | None,
        limit: int | None,
        layout: str | None = None,
        view: View | None = None,
    ) -> m.GetEventHistoryResponse:
        """Events after ``since_seq``, capped by count and (roughly) by bytes.

        A filtered page skips other layouts' events; the scan is bounded too,
        and ``scanned_seq`` says where the next page starts."""
        view = view or View(None)
        cap = self.history_max_events if limit is None else max(0, min(limit, self.history_max_events))
        filtered = layout is not None or view.tenant_policy is not None
        rows: list[dict] = []
        budget = self.history_max_bytes
        scanned = max(since_seq or 0, self.log.first_seq - 1)
        for entry in self.log.since(scanned, cap * 16 + 1024 if filtered else cap):
            event = entry.event
            if (layout is None or event.layout == layout) and view.layout(event.layout):
                row = history_entry(entry)
                budget -= 96 + sum(len(v) for v in row.values() if isinstance(v, str | bytes))
                if len(rows) >= cap or (rows and budget < 0):
                    break
                rows.append(row)
            scanned = entry.seq
        return m.GetEventHistoryResponse(rows, self.log.first_seq, self.log.last_seq, scanned)


@attrs.frozen
class View:
    """What a probe shows: everything (``tenant_policy`` None), or one tenant's share."""

    tenant_policy: TenantPolicy | None

    def layout(self, name: str) -> bool:
        return self.tenant_policy is None or not name or self.tenant_policy.may_read(name)

    def tenant(self, name: str) -> bool:
        return self.tenant_policy is None or self.tenant_policy.name == name
