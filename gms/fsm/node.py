"""The node: every layout of one GPU, the sessions on them, the tenants and the budgets.

``fold(node, event) -> node`` is the one way the state changes (the event log
calls it).  Node events (the start, sessions) change the node; every other
event is folded into the layout it names by :func:`fold_layout`, and the
node's byte accounting is settled from the layout before and after, in O(1):

* a tenant is charged ``held_bytes`` for every layout it owns (built), on the
  GPU or evicted to the host: its quota bounds what it keeps in gms;
* the node's ``gpu_bytes`` sums what is on the GPU now: the GPU budget bounds it;
* ``host_bytes`` sums the host copies: the host budget bounds it.

``tick`` counts folded events: a logical clock that orders layouts by last use
(for LRU eviction) without reading a clock in the core.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs
from immutables import Map

from .errors import InvariantViolation
from .events import (
    ConnectionDropped,
    Event,
    LayoutRevoked,
    RestoreClaimed,
    RestoreFinished,
    RoConnect,
    RoDisconnect,
    RwAbort,
    RwCommit,
    RwConnect,
    ServerStarted,
    SessionClosed,
    SessionOpened,
    SessionRefused,
)
from .folding import fold_layout
from .replace import replace
from .state import LayoutState

DEFAULT_TENANT = "default"


@attrs.frozen
class SessionInfo:
    """A handshaken connection: the layout it locks, and who it is."""

    layout: str
    tenant: str
    uid: int
    gid: int
    pid: int
    lock_type: str
    limit_bytes: int | None = None


@attrs.frozen(slots=False)  # dict-backed: see gms.fsm.replace
class TenantState:
    name: str
    quota_bytes: int | None = None  # None: unlimited
    used_bytes: int = 0
    sessions: int = 0


@attrs.frozen(slots=False)  # dict-backed: see gms.fsm.replace
class NodeState:
    started: bool = False
    capacity_bytes: int | None = None
    budget_bytes: int | None = None
    host_budget_bytes: int | None = None
    layouts: Map[str, LayoutState] = Map()
    sessions: Map[int, SessionInfo] = Map()
    tenants: Map[str, TenantState] = Map()
    gpu_bytes: int = 0
    host_bytes: int = 0
    tick: int = 0

    def layout(self, name: str) -> LayoutState:
        """The named layout; a vacant one if the node holds none of that name."""
        found = self.layouts.get(name)
        return found if found is not None else LayoutState(name)


EMPTY_NODE = NodeState()

# Events after which a layout counts as used (LRU order).
_USES = (RwConnect, RwCommit, RwAbort, RoConnect, RoDisconnect, RestoreClaimed, RestoreFinished)
# Events that take a lock: the connection must have opened a session on the layout.
_ACQUIRES = (RwConnect, RoConnect, RestoreClaimed)


def _refuse(node: NodeState, event: Event, why: str) -> InvariantViolation:
    return InvariantViolation(f"cannot fold {event.KIND} from conn {event.conn} ({why})")


# -- node steps -----------------------------------------------------------------------


def _server_started(node: NodeState, event: ServerStarted) -> NodeState:
    if node.started:
        raise _refuse(node, event, "the server has started already")
    tenants = Map({name: TenantState(name, quota) for name, quota in event.quotas.items()})
    return replace(
        node,
        started=True,
        capacity_bytes=event.capacity_bytes,
        budget_bytes=event.budget_bytes,
        host_budget_bytes=event.host_budget_bytes,
        tenants=tenants,
    )


def _session_opened(node: NodeState, event: SessionOpened) -> NodeState:
    if not event.layout:
        raise _refuse(node, event, "a session names a layout")
    if event.conn in node.sessions:
        raise _refuse(node, event, "connection has a session")
    tenant = node.tenants.get(event.tenant)
    if tenant is None:
        raise _refuse(node, event, f"unknown tenant {event.tenant!r}")
    session = SessionInfo(
        event.layout, event.tenant, event.uid, event.gid, event.pid, event.lock_type, event.limit_bytes
    )
    return replace(
        node,
        sessions=node.sessions.set(event.conn, session),
        tenants=node.tenants.set(tenant.name, replace(tenant, sessions=tenant.sessions + 1)),
    )


def _session_closed(node: NodeState, event: SessionClosed) -> NodeState:
    session = node.sessions.get(event.conn)
    if session is None or session.layout != event.layout:
        raise _refuse(node, event, f"no session on layout {event.layout!r}")
    if node.layout(event.layout).holds_lock(event.conn):
        raise _refuse(node, event, "the session still holds a lock")
    tenant = node.tenants[session.tenant]
    return replace(
        node,
        sessions=node.sessions.delete(event.conn),
        tenants=node.tenants.set(tenant.name, replace(tenant, sessions=tenant.sessions - 1)),
    )


def _observation(node: NodeState, event: Event) -> NodeState:
    return node


_NODE_STEPS: dict[type[Event], Callable[[NodeState, Event], NodeState]] = {
    ServerStarted: _server_started,
    SessionOpened: _session_opened,
    SessionClosed: _session_closed,
    SessionRefused: _observation,
    LayoutRevoked: _observation,
    ConnectionDropped: _observation,
}


# -- layout events: fold the layout, settle the accounting ---------------------------------


def _charge(tenants: Map, name: str | None, delta: int, event: Event) -> Map:
    if name is None or delta == 0:
        return tenants
    tenant = tenants.get(name)
    if tenant is None:
        raise InvariantViolation(f"{event.KIND}: layout owned by unknown tenant {name!r}")
    return tenants.set(name, replace(tenant, used_bytes=tenant.used_bytes + delta))


def _settle(
    node: NodeState, before: LayoutState, after: LayoutState, event: Event, tick: int
) -> NodeState:
    tenants = node.tenants
    if before.owner == after.owner:
        tenants = _charge(tenants, after.owner, after.held_bytes - before.held_bytes, event)
    else:
        tenants = _charge(tenants, before.owner, -before.held_bytes, event)
        tenants = _charge(tenants, after.owner, after.held_bytes, event)
    if after.vacant:
        layouts = node.layouts.delete(after.name) if after.name in node.layouts else node.layouts
    else:
        layouts = node.layouts.set(after.name, after)
    return replace(
        node,
        layouts=layouts,
        tenants=tenants,
        gpu_bytes=node.gpu_bytes - before.gpu_bytes + after.gpu_bytes,
        host_bytes=node.host_bytes - before.host_bytes + after.host_bytes,
        tick=tick,
    )


def _layout_event(node: NodeState, event: Event, tick: int) -> NodeState:
    if not event.layout:
        raise _refuse(node, event, "the event names no layout")
    before = node.layout(event.layout)
    if isinstance(event, _ACQUIRES):
        session = node.sessions.get(event.conn)
        if session is None or session.layout != event.layout:
            raise _refuse(node, event, f"no session on layout {event.layout!r}")
    after = fold_layout(before, event)
    if isinstance(event, RwConnect):
        after = replace(after, owner=node.sessions[event.conn].tenant, last_use=tick)
    elif isinstance(event, _USES):
        after = replace(after, last_use=tick)
    return _settle(node, before, after, event, tick)


def fold(node: NodeState, event: Event) -> NodeState:
    if not node.started and not isinstance(event, ServerStarted):
        raise _refuse(node, event, "the log starts with SERVER_STARTED")
    tick = node.tick + 1
    step = _NODE_STEPS.get(type(event))
    if step is None:
        return _layout_event(node, event, tick)
    return replace(step(node, event), tick=tick)


def fold_all(events: Iterable[Event], state: NodeState = EMPTY_NODE) -> NodeState:
    for event in events:
        state = fold(state, event)
    return state
