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

The rooms are built, in the order they need each other, by
``gms.server.assembly`` and handed in whole (:class:`Rooms`).  This class
keeps what is left: sessions (who may open one, waiting for the lock, what a
disconnect releases) and the admin verbs.  The Trio shell
(``gms.server.service.session``) owns sockets and time and calls in here.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs

from ...cuda import DeviceInfo
from ...fsm import (
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
    opening,
    schedule,
    validate_layout_name,
)
from ...fsm.events import Event, ServerStarted, SessionRefused
from ...fsm.queries import layout_of
from ...fsm.rules import check_lock_type
from ...system.peer import Peer
from ...wire import messages as m
from ..edge.inflight import InFlight
from ..edge.reply import Reply
from ..edge.tarpit import Tarpit
from ..tiers.copier_link import CopierLink
from ..tiers.host_memory import HostMemory
from ..tiers.memory import Memory
from .host_tier import HostTier
from .ledger import Ledger
from .lock_queues import GrantCallback, Waiter
from .placement import Placement
from .probes import Probes
from .requests import Requests
from .settings import Settings
from .snapshots import Snapshots
from .transfers import Transfers

_LOCK_TYPES = {lock.value: lock for lock in RequestedLockType}  # a lookup, not the enum's call


@attrs.frozen
class Rooms:
    """What a core is made of, built in dependency order by ``gms.server.assembly``."""

    ledger: Ledger
    gpu: Memory
    host: HostMemory | None
    copier: CopierLink | None  # the copier's supervisor, where a host or disk tier needs one
    snapshots: Snapshots | None  # the disk tier (None: none)
    requests: Requests
    placement: Placement
    host_tier: HostTier
    transfers: Transfers | None
    probes: Probes
    keeper: object = None  # the server's keeper link (gms.server.restart.mirror), None without one


class ServiceCore:
    def __init__(self, rooms: Rooms, *, device: DeviceInfo, settings: Settings) -> None:
        self.device = device
        self.policy = settings.policy
        self.server_uid = settings.server_uid
        self.ledger = rooms.ledger
        self.queues = rooms.ledger.queues
        self.durability = rooms.ledger.durability
        self.log = rooms.ledger.log  # read here; the ledger alone writes it
        self.host = rooms.host  # the host tier's table (None: none)
        self.copier = rooms.copier
        self.snapshots = rooms.snapshots
        self.requests = rooms.requests
        self.placement = rooms.placement
        self.host_tier = rooms.host_tier
        self.transfers = rooms.transfers
        self.probes = rooms.probes
        self.keeper = rooms.keeper
        # What this server runs with: the log's first event, or (a log handed
        # over from another server) what SERVER_RESUMED carries (gms.server.restart.resume).
        self.started_event = started_event(rooms, device, settings)
        if not self.ledger.state.started:
            self.ledger.record([self.started_event], by_server=True)
        self._next_conn = 1
        self._revoke_hooks: dict[int, Callable[[], None]] = {}
        self.fds = rooms.gpu.fds  # the server's FdBudget (gms.server.edge.admission), the tables' too
        self.inflight = InFlight()  # big frames in flight, per uid (gms.server.edge.inflight)
        self.tarpit = Tarpit(time.monotonic)  # refusals of a uid that keeps asking, answered late

    def background(self) -> list:
        """Tasks for the server's nursery: the copier's supervisor, the host pool's refill, the saver."""
        host = self.host
        tasks = [self.copier.run] if self.copier is not None else []
        tasks += [self.snapshots.run] if self.snapshots is not None else []
        return tasks + ([host.pool.keep] if host is not None and host.pool.kept else [])

    async def aclose(self) -> None:
        """Release every allocation and host copy (on their lanes), then stop the lanes
        (snapshots stay: they are what outlives the server)."""
        for tier in self.ledger.tiers.values():
            await tier.close()

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


def started_event(rooms: Rooms, device: DeviceInfo, settings: Settings) -> ServerStarted:
    """The node's first event: its device, budgets, limits and every tenant's quotas."""
    policy, limits = settings.policy, settings.limits
    return ServerStarted(
        0, device.total_bytes, settings.budget_bytes, settings.host_budget_bytes if rooms.host is not None else 0,
        policy.quotas(), limits.as_dict(), backend=rooms.gpu.name, device=device.device,
        device_uuid=device.uuid, layout="",
        tenant_limits=policy.tenant_limits(limits.tenant_metadata_quota, limits.tenant_max_layouts),
        disk_budget_bytes=settings.disk_budget_bytes if rooms.snapshots is not None else 0,
    )
