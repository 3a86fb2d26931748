"""The service core of one node (one GPU), without sockets: sessions and locks,
and the rooms that answer requests.

Every change of state goes through one write path, :class:`Ledger`
(``ledger``); each room has one job:

* ``requests``: what a session's state answers at once (reads, metadata,
  free, commit, exports);
* ``placement``: GPU memory for allocations and restores (the budget,
  eviction, creation on the lane, waiting for memory);
* ``host_tier``: host copies for residency ``system`` and restores;
* ``snapshots``: the disk tier (a snapshot after a commit that asks, a
  restore from one, recovery at a cold start);
* ``probes``: runtime state and history.

This class keeps what is left: sessions (who may open one, waiting for the
lock, what a disconnect releases) and the admin verbs.  The Trio shell
(``gms.server.service.session``) owns sockets and time and calls in here.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from ...cuda import DeviceInfo, MemoryBackend
from ...disk.store import DiskStore
from ...fsm import (
    Limits,
    MemoryTier,
    NodeState,
    PermissionDenied,
    RequestedLockType,
    decide_delete,
    decide_disconnect,
    decide_evict,
    decide_pin,
    decide_restore_finished,
    decide_revoke,
    decide_session,
    host_room,
    opening,
    schedule,
    validate_layout_name,
)
from ...fsm.events import Event, ServerStarted, SessionRefused
from ...fsm.queries import layout_of
from ...fsm.rules import check_lock_type
from ...operator.policy import OPEN_POLICY, Policy
from ...store import EventLog
from ...system.peer import Peer
from ...wire import messages as m
from ..edge.inflight import InFlight
from ..edge.reply import Reply
from ..edge.tarpit import Tarpit
from ..tiers.copier_link import CopierLink
from ..tiers.host_memory import HostMemory
from ..tiers.lanes import Lane
from ..tiers.memory import Memory
from ..tiers.memory_signal import MemorySignal
from .durability import IN_MEMORY
from .host_tier import HostTier
from .ledger import Ledger
from .lock_queues import GrantCallback, LockQueues, Waiter
from .placement import Placement
from .probes import Probes
from .requests import DEFAULT_SCAN_CACHE_BYTES, Requests
from .snapshots import Snapshots
from .transfers import Transfers

_LOCK_TYPES = {lock.value: lock for lock in RequestedLockType}  # a lookup, not the enum's call


class ServiceCore:
    def __init__(
        self,
        gpu: Memory,
        host: HostMemory | Memory | None,
        *,
        device: DeviceInfo,
        signal: MemorySignal,
        on_event: Callable[[Event], None] = lambda event: None,
        policy: Policy = OPEN_POLICY,
        limits: Limits = Limits(),
        log: EventLog | None = None,
        budget_bytes: int | None = None,
        host_budget_bytes: int | None = None,
        history_max_events: int = 10_000,
        history_max_bytes: int = 8 << 20,
        server_uid: int,
        alloc_retry_interval: float = 0.05,
        alloc_retry_timeout: float | None = None,
        copier: CopierLink | None = None,
        scan_cache_bytes: int = DEFAULT_SCAN_CACHE_BYTES,
        keeper=None,
        disk: DiskStore | None = None,
        disk_budget_bytes: int | None = None,
    ) -> None:
        """``keeper``: the server's keeper link (``gms.server.restart.mirror``): where
        what the ledger stores becomes durable, shown by the probes and the metrics.
        ``disk``: the disk tier's folder (None: no disk tier)."""
        if host is not None and not isinstance(host, HostMemory):
            # exact host copies, no copier: clients copy
            host = HostMemory(host, fds=host.fds, room=lambda: host_room(self.ledger.state))
        self.device = device
        self.policy = policy
        self.server_uid = server_uid
        self.queues = LockQueues()
        tiers = {MemoryTier.GPU: gpu} | ({MemoryTier.HOST: host} if host is not None else {})
        self.snapshots: Snapshots | None = None
        if disk is not None:
            observe = on_event

            def on_event(event: Event) -> None:  # (a commit that asks for a snapshot wakes the saver)
                observe(event)
                self.snapshots.notice(event)

        self.ledger = Ledger(
            log if log is not None else EventLog(), tiers, self.queues, on_event=on_event, on_released=signal.released,
            durability=keeper if keeper is not None else IN_MEMORY,
        )
        self.copier = copier if host is not None or disk is not None else None
        if disk is not None:
            self.snapshots = self.ledger.disk = Snapshots(self.ledger, gpu, disk, self.copier, policy.may_write)
            if host is not None:
                host.spill = self.snapshots.spill
        self.durability = self.ledger.durability
        # What this server runs with: the log's first event, or (a log handed
        # over from another server) what SERVER_RESUMED carries (gms.server.restart.resume).
        self.started_event = ServerStarted(
            0, device.total_bytes, budget_bytes, host_budget_bytes if host is not None else 0,
            policy.quotas(), limits.as_dict(), backend=gpu.name, device=device.device,
            device_uuid=device.uuid, layout="",
            tenant_limits=policy.tenant_limits(limits.tenant_metadata_quota, limits.tenant_max_layouts),
            disk_budget_bytes=disk_budget_bytes if disk is not None else 0,
        )
        self.log = self.ledger.log  # read here; the ledger alone writes it
        if not self.ledger.state.started:
            self.ledger.record([self.started_event], by_server=True)
        self.requests = Requests(
            self.ledger, gpu, scan_cache_bytes, persists=lambda tenant: disk is not None and policy.persists(tenant),
        )
        self.placement = Placement(
            self.ledger, gpu, signal, retry_interval=alloc_retry_interval, retry_timeout=alloc_retry_timeout
        )
        self.host_tier = HostTier(self.ledger, host)
        self.transfers = None if self.copier is None or host is None else Transfers(
            self.ledger, gpu, host, self.copier, self.requests)
        self.keeper = keeper
        self.probes = Probes(
            self.ledger, gpu, host, policy, server_uid,
            history_max_events=history_max_events, history_max_bytes=history_max_bytes, keeper=keeper, disk=disk,
        )
        self._next_conn = 1
        self._revoke_hooks: dict[int, Callable[[], None]] = {}
        self.fds = gpu.fds  # the server's FdBudget (gms.server.edge.admission), the tables' too
        self.inflight = InFlight()  # big frames in flight, per uid (gms.server.edge.inflight)
        self.tarpit = Tarpit(time.monotonic)  # refusals of a uid that keeps asking, answered late

    def background(self) -> list:
        """Tasks for the server's nursery: the copier's supervisor, the host pool's refill, the saver."""
        host = self.ledger.tiers.get(MemoryTier.HOST)
        tasks = [self.copier.run] if self.copier is not None else []
        tasks += [self.snapshots.run] if self.snapshots is not None else []
        return tasks + ([host.keep_pool] if host is not None and host.keeps_pool else [])

    async def aclose(self) -> None:
        """Release every allocation and host copy (on their lanes), then stop the lanes
        (snapshots stay: they are what outlives the server)."""
        for tier in self.ledger.tiers.values():
            await tier.close()
        if self.snapshots is not None:
            await self.snapshots.aclose()

    @property
    def state(self) -> NodeState:
        return self.log.state

    def new_conn(self) -> int:
        conn = self._next_conn
        self._next_conn += 1
        return conn

    def continue_conns(self, next_conn: int) -> None:
        """Number connections after another server's (a take-over, a restart): conn
        numbers in the log and the sessions stay unique."""
        self._next_conn = max(self._next_conn, next_conn)

    @property
    def next_conn(self) -> int:
        return self._next_conn

    # -- sessions and locks -------------------------------------------------------

    def handshake(
        self,
        conn: int,
        request: m.HandshakeRequest,
        peer: Peer,
        on_grant: GrantCallback,
        alive: Callable[[], bool] = lambda: True,
        turned_away: Callable[[], None] | None = None,
    ) -> RequestedLockType:
        """Open the session (or record its refusal) and ask for its lock; returns
        the lock asked for.  A handshake nobody is queued ahead of, on a layout
        that can take it now, is granted at once, recorded with the session in
        one batch (a read lock and its session in one event, READER_JOINED):
        its client is the one being answered.  Else it is queued, and
        ``on_grant`` runs when it is granted; ``alive`` is asked before a grant
        (False drops the waiter instead); ``turned_away`` runs instead when
        nothing will grant it (``gms.fsm.turned_away``; at once, or later)."""
        return self.open_session(conn, self._decide_session(conn, request, peer), on_grant, alive, turned_away)

    def open_session(
        self, conn: int, opened: Event, on_grant: GrantCallback, alive: Callable[[], bool] = lambda: True,
        turned_away: Callable[[], None] | None = None,
    ) -> RequestedLockType:
        """Record the decided SESSION_OPENED and ask for its lock (as :meth:`handshake`
        says); the server's own sessions come in here too (``warm_start``)."""
        requested = _LOCK_TYPES[opened.lock_type]
        layout = opened.layout
        grant = None
        if not self.queues.waiting_on(layout):  # (a session changes no layout: granted on the layout as it is)
            grant = next(iter(schedule(self.state.layout(layout), [(conn, requested)])), None)
        events, grant = opening(opened, grant)
        self.ledger.record(events)
        if grant is not None:
            on_grant(grant)
        else:
            self.queues.add(layout, conn, Waiter(requested, on_grant, alive, turned_away))
            self.ledger.grant(layout)
        return requested

    def _decide_session(self, conn: int, request: m.HandshakeRequest, peer: Peer) -> Event:
        """The SESSION_OPENED a handshake proposes; a refusal by the policy is
        recorded (SESSION_REFUSED) and raised."""
        requested = _LOCK_TYPES[check_lock_type(request.lock_type)]
        tenant = self.policy.tenant_for(peer.uid, peer.gid)
        try:
            if tenant is None:
                raise PermissionDenied(
                    f"uid {peer.uid} (gid {peer.gid}) is no tenant of this server's policy "
                    f"({self.policy.source})"
                )
            layout = validate_layout_name(request.layout)
            (opened,) = decide_session(
                self.state, conn, layout, requested,
                tenant=tenant.name,
                may_read=tenant.may_read(layout),
                may_write=tenant.may_write(layout),
                uid=peer.uid, gid=peer.gid, pid=peer.pid,
                limit_bytes=request.limit_bytes,
                expect_hash=request.expect_hash,
            )
        except PermissionDenied as refused:
            self.ledger.record([SessionRefused(conn, peer.uid, peer.gid, peer.pid, refused.message, layout="")])
            raise
        return opened

    def cancel_lock_request(self, conn: int) -> None:
        session = self.state.sessions.get(conn)
        if session is not None and self.queues.remove(session.layout, conn):
            self.ledger.grant(session.layout, waiter_left=True)

    def on_revoke(self, conn: int, hook: Callable[[], None]) -> None:
        """``hook`` ends the connection's task when an admin revokes its lock."""
        self._revoke_hooks[conn] = hook

    def disconnect(self, conn: int) -> None:
        """Whatever ended the connection, release what it held or waited for."""
        self._revoke_hooks.pop(conn, None)
        self.cancel_lock_request(conn)
        self.ledger.record(decide_disconnect(self.state, conn))

    def finish_restore(self, conn: int) -> str:
        layout = layout_of(self.state, conn)
        self.ledger.record(decide_restore_finished(self.state, conn, layout.name))
        return layout_of(self.state, conn).layout_hash or ""

    # -- admin -------------------------------------------------------------------------

    def refusal_delay(self, peer: Peer) -> float:
        """How long a refusal of ``peer``'s past its limits waits (admins never do)."""
        if self.policy.is_admin(peer.uid, peer.gid, self.server_uid):
            return 0.0
        return self.tarpit.delay(peer.uid)

    def require_admin(self, peer: Peer, request: object) -> None:
        """Admin verbs are for the server's uid, root, or a policy admin (the route table asks, once)."""
        if not self.policy.is_admin(peer.uid, peer.gid, self.server_uid):
            raise PermissionDenied(
                f"uid {peer.uid} may not {type(request).__name__[:-7].lower()}: admin verbs are for "
                "the server's uid, root, or a policy admin"
            )

    def evict(self, conn: int, layout: str) -> Reply:
        name = validate_layout_name(layout)
        before = self.state.layout(name)
        self.ledger.record(decide_evict(self.state, conn, name, "admin"))
        tier = self.state.layout(name).tier.value if name in self.state.layouts else "none"
        return Reply(m.EvictResponse(tier, before.gpu_bytes))

    def delete(self, conn: int, layout: str, peer: Peer) -> Reply:
        """An admin's delete: the idle committed layout goes from every tier, its snapshot too."""
        name = validate_layout_name(layout)
        before = self.state.layout(name)
        self.ledger.record(decide_delete(self.state, conn, peer.uid, name))
        return Reply(m.DeleteResponse(before.gpu_bytes, before.host_bytes, before.disk_bytes))

    def pin(self, conn: int, layout: str, residency: str) -> Reply:
        name = validate_layout_name(layout)
        self.ledger.record(decide_pin(self.state, conn, name, residency))
        return Reply(m.PinResponse(self.state.layout(name).residency.value))

    def revoke(self, conn: int, layout: str, peer: Peer) -> int:
        """Take the layout's locks away: the writer aborts (its memory is
        released), readers and a restorer are dropped, the next waiter is granted.
        Idempotent: a layout nobody holds (its holder died already) revokes 0."""
        events, victims = decide_revoke(self.state, conn, peer.uid, validate_layout_name(layout))
        self.ledger.record(events)
        for victim in victims:
            hook = self._revoke_hooks.pop(victim, None)
            self.ledger.record(decide_disconnect(self.state, victim), by_server=True)
            if hook is not None:
                hook()
        return len(victims)


async def open_core(gpu: MemoryBackend, host: MemoryBackend | None = None, **options) -> ServiceCore:
    """A core over these backends, each with its lane (inside Trio); the device is asked on its lane."""
    gpu_memory = Memory(gpu, Lane("gpu"), options.pop("stock_bytes", 0))
    return ServiceCore(
        gpu_memory,
        Memory(host, Lane("host")) if host is not None else None,
        device=await gpu_memory.device_info(),
        signal=options.pop("signal", None) or MemorySignal(),
        server_uid=options.pop("server_uid", os.getuid()),
        **options,
    )
