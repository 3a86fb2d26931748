"""The node: every layout of one GPU, the sessions on them, the tenants and the budgets.

``fold(node, event) -> node`` is the one way the state changes (the event log
calls it).  It asks the rules (``gms.fsm.rules``) whether the event is legal
(a refusal raises the Rejection that says why), then applies it: node events
(the start, sessions) change the node; every other event is folded into the
layout it names by :func:`fold_layout`, and the node's byte accounting is
settled from the layout before and after, in O(1):

* a tenant is charged ``held_bytes`` for every layout it owns (built), on the
  GPU or evicted to the host: its quota bounds what it keeps in gms;
* the node's ``gpu_bytes`` sums what is on the GPU now: the GPU budget bounds it;
* ``host_bytes`` sums the host copies: the host budget bounds it;
* a tenant is charged ``metadata_bytes`` (keys and values: the daemon's RAM)
  for every layout it owns, bounded by its metadata quota, and the node's
  ``metadata_bytes`` sums them, bounded by ``max_metadata_bytes``;
* a tenant counts the layouts it owns and those its sessions may write
  (``layout_refs``): its ``max_layouts`` bounds them.

Settling also holds every bound: a step that would take a total past its
bound raises InvariantViolation, so no log can break a budget, a quota, a
session's limit, a metadata bound or a layout cap, whatever the shell asked.

``tick`` counts folded events: a logical clock that orders layouts by last use
(for LRU eviction) without reading a clock in the core.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs
from immutables import Map

from . import rules
from .errors import InvariantViolation
from .events import (
    ConnectionDropped,
    Event,
    LayoutRevoked,
    RwConnect,
    ServerResumed,
    ServerStarted,
    SessionClosed,
    SessionOpened,
    SessionRefused,
    StateDiscarded,
)
from .folding import LAYOUT_STEPS, fold_layout
from .limits import Limits
from .replace import rebuilt, replace, stamp
from .state import LayoutState, Tier

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
    metadata_quota: int | None = None  # bytes of keys and values; None: unlimited
    metadata_bytes: int = 0
    max_layouts: int | None = None  # None: only the node's cap
    # layout -> references: 1 if the tenant owns it, +1 per session of the
    # tenant that may write it (RW, RW_OR_RO).  A writer's session counts the
    # layout from its handshake, so the grant (which may come much later)
    # never adds one: the bound is checked once, when the session opens.
    layout_refs: Map[str, int] = Map()

    @property
    def layouts(self) -> int:
        return len(self.layout_refs)


@attrs.frozen(slots=False)  # dict-backed: see gms.fsm.replace
class NodeState:
    started: bool = False
    capacity_bytes: int | None = None
    budget_bytes: int | None = None
    host_budget_bytes: int | None = None  # 0: the server keeps no host tier
    limits: Limits = Limits()
    layouts: Map[str, LayoutState] = Map()
    sessions: Map[int, SessionInfo] = Map()
    tenants: Map[str, TenantState] = Map()
    gpu_bytes: int = 0
    host_bytes: int = 0
    metadata_bytes: int = 0
    tick: int = 0

    def layout(self, name: str) -> LayoutState:
        """The named layout; a vacant one if the node holds none of that name."""
        found = self.layouts.get(name)
        return found if found is not None else LayoutState(name)


EMPTY_NODE = NodeState()

# Events after which a layout counts as used (LRU order): their rules say so.
_USES = rules.kinds("uses")


# -- node steps -----------------------------------------------------------------------


def _server_started(node: NodeState, event: ServerStarted) -> NodeState:
    if node.started:
        raise InvariantViolation("cannot fold SERVER_STARTED: the server has started already")
    tenants = Map(
        {
            name: TenantState(
                name,
                quota,
                metadata_quota=event.tenant_limits.get(name, {}).get("metadata_quota"),
                max_layouts=event.tenant_limits.get(name, {}).get("max_layouts"),
            )
            for name, quota in event.quotas.items()
        }
    )
    return replace(
        node,
        started=True,
        capacity_bytes=event.capacity_bytes,
        budget_bytes=event.budget_bytes,
        host_budget_bytes=event.host_budget_bytes,
        limits=Limits.from_dict(event.limits),
        tenants=tenants,
    )


def _server_resumed(node: NodeState, event: ServerResumed, tick: int) -> NodeState:
    """The new server's configuration replaces the old one's; a tenant the new
    policy does not name keeps its quotas (it may own layouts: they stay charged);
    one that ``tenant_limits`` does not name is unbounded in metadata and layouts
    (a SERVER_RESUMED logged before those bounds existed)."""
    tenants = node.tenants
    for name, quota in event.quotas.items():
        bounds = event.tenant_limits.get(name, {})
        tenant = tenants.get(name) or TenantState(name)
        tenants = tenants.set(
            name,
            replace(
                tenant, quota_bytes=quota, metadata_quota=bounds.get("metadata_quota"),
                max_layouts=bounds.get("max_layouts"),
            ),
        )
    return replace(
        node,
        capacity_bytes=event.capacity_bytes,
        budget_bytes=event.budget_bytes,
        host_budget_bytes=event.host_budget_bytes,
        limits=Limits.from_dict(event.limits),
        tenants=tenants,
        tick=tick,
    )


def may_write(lock_type: str) -> bool:
    """A session that may become its layout's writer (it counts the layout)."""
    return lock_type != "RO"


def _refer(refs: Map, layout: str, delta: int) -> Map:
    count = refs.get(layout, 0) + delta
    if count < 0:
        raise InvariantViolation(f"layout {layout!r} dereferenced more than referenced")
    return refs.set(layout, count) if count else refs.delete(layout)


def _session_opened(node: NodeState, event: SessionOpened, tick: int) -> NodeState:
    tenant = node.tenants[event.tenant]
    session = SessionInfo(
        event.layout, event.tenant, event.uid, event.gid, event.pid, event.lock_type, event.limit_bytes
    )
    refs = tenant.layout_refs
    if may_write(event.lock_type):
        refs = _refer(refs, event.layout, 1)
        _hold(event, len(tenant.layout_refs), len(refs), tenant.max_layouts, "tenant {!r}'s layouts", tenant.name)
    return replace(
        node,
        sessions=node.sessions.set(event.conn, session),
        tenants=node.tenants.set(tenant.name, replace(tenant, sessions=tenant.sessions + 1, layout_refs=refs)),
        tick=tick,
    )


def _session_closed(node: NodeState, event: SessionClosed, tick: int) -> NodeState:
    session = node.sessions[event.conn]
    tenant = node.tenants[session.tenant]
    refs = _refer(tenant.layout_refs, session.layout, -1) if may_write(session.lock_type) else tenant.layout_refs
    return replace(
        node,
        sessions=node.sessions.delete(event.conn),
        tenants=node.tenants.set(tenant.name, replace(tenant, sessions=tenant.sessions - 1, layout_refs=refs)),
        tick=tick,
    )


def _observation(node: NodeState, event: Event, tick: int) -> NodeState:
    return replace(node, tick=tick)


_NODE_STEPS: dict[type[Event], Callable[[NodeState, Event, int], NodeState]] = {
    ServerResumed: _server_resumed,
    StateDiscarded: _observation,
    SessionOpened: _session_opened,
    SessionClosed: _session_closed,
    SessionRefused: _observation,
    LayoutRevoked: _observation,
    ConnectionDropped: _observation,
}


# -- layout events: fold the layout, settle the accounting ---------------------------------


def _charge(tenants: Map, name: str, held: int, metadata: int, refs: int, layout: str, event: Event) -> Map:
    tenant = tenants.get(name)
    if tenant is None:
        raise InvariantViolation(f"{event.KIND}: layout owned by unknown tenant {name!r}")
    state = tenant.__dict__.copy()
    state["used_bytes"] = tenant.used_bytes + held
    if metadata:
        state["metadata_bytes"] = tenant.metadata_bytes + metadata
    if refs:
        state["layout_refs"] = _refer(tenant.layout_refs, layout, refs)
    return tenants.set(name, rebuilt(tenant, state))


def _hold(event: Event, before: int, after: int, bound: int | None, what: str, *names: str) -> None:
    """A total may only pass its bound by not growing (a bound lowered under it).
    Every step that grows passes here: ``what`` is formatted (with ``names``)
    only to raise."""
    if bound is not None and after > bound and after > before:
        raise InvariantViolation(
            f"{event.KIND} would take {what.format(*names)} to {after}, past its bound of {bound}"
        )


def _settle(
    node: NodeState, before: LayoutState, after: LayoutState, event: Event, tick: int
) -> NodeState:
    # ``before`` is the node's (never vacant: a vacant layout is dropped below)
    # or a fresh vacant one, which no tenant owns: its owner is the charged one.
    vacant = after.vacant
    was, now = before.owner, None if vacant else after.owner
    held = after.held_bytes - before.held_bytes
    metadata = after.metadata_bytes - before.metadata_bytes
    layouts = node.layouts
    if not vacant:
        layouts = layouts.set(after.name, after)
    elif after.name in layouts:
        layouts = layouts.delete(after.name)
    state = node.__dict__.copy()
    state["layouts"] = layouts
    state["tick"] = tick
    if (
        was is not None and was == now and not held and not metadata
        and after.tier is before.tier and after.host_bytes == before.host_bytes
    ):
        return rebuilt(node, state)  # a lock or a residency moved: no total did
    tenants = node.tenants
    if was != now:
        if was is not None:
            tenants = _charge(tenants, was, -before.held_bytes, -before.metadata_bytes, -1, after.name, event)
        if now is not None:
            tenants = _charge(tenants, now, after.held_bytes, after.metadata_bytes, 1, after.name, event)
    elif now is not None and (held or metadata):
        tenants = _charge(tenants, now, held, metadata, 0, after.name, event)
    if len(layouts) > len(node.layouts) and len(layouts) > node.limits.max_layouts:
        raise InvariantViolation(f"{event.KIND} would hold more than {node.limits.max_layouts} layouts")
    if after.tier is before.tier:  # (most steps: the GPU's share moves with the held bytes)
        gpu_bytes = node.gpu_bytes + (held if after.tier is not Tier.HOST else 0)
    else:
        gpu_bytes = node.gpu_bytes - before.gpu_bytes + after.gpu_bytes
    host_bytes = node.host_bytes - before.host_bytes + after.host_bytes
    metadata_bytes = node.metadata_bytes + metadata
    if held > 0 or metadata > 0 or gpu_bytes > node.gpu_bytes or host_bytes > node.host_bytes or was != now:
        _hold_bounds(node, after, now, event, tenants, gpu_bytes, host_bytes, metadata_bytes)
    state["tenants"] = tenants
    state["gpu_bytes"] = gpu_bytes
    state["host_bytes"] = host_bytes
    state["metadata_bytes"] = metadata_bytes
    return rebuilt(node, state)


def _hold_bounds(
    node: NodeState, after: LayoutState, owner: str | None, event: Event, tenants: Map, gpu: int, host: int,
    metadata: int,
) -> None:
    """Only for steps that grew something: every bound the growth could break
    (each asked only where its total grew and a bound is set: most steps grow
    one or two, and most bounds are off)."""
    if gpu > node.gpu_bytes and node.budget_bytes is not None:
        _hold(event, node.gpu_bytes, gpu, node.budget_bytes, "the GPU's bytes")
    if host > node.host_bytes and node.host_budget_bytes is not None:
        _hold(event, node.host_bytes, host, node.host_budget_bytes, "the host tier's bytes")
    if metadata > node.metadata_bytes:
        _hold(event, node.metadata_bytes, metadata, node.limits.max_metadata_bytes, "the node's metadata bytes")
    if owner is not None:
        old, new = node.tenants[owner], tenants[owner]
        if new is not old:
            if new.used_bytes > old.used_bytes and new.quota_bytes is not None:
                _hold(event, old.used_bytes, new.used_bytes, new.quota_bytes, "tenant {!r}'s bytes", owner)
            if new.metadata_bytes > old.metadata_bytes:
                _hold(event, old.metadata_bytes, new.metadata_bytes, new.metadata_quota,
                      "tenant {!r}'s metadata bytes", owner)
            if new.layout_refs is not old.layout_refs:
                _hold(event, old.layouts, new.layouts, new.max_layouts, "tenant {!r}'s layouts", owner)
    if after.writer is not None:
        limit = node.sessions[after.writer].limit_bytes
        if limit is not None:
            _hold(event, 0, after.held_bytes, limit, "layout {!r}'s bytes (its writer's limit)", after.name)


def _layout_event(node: NodeState, event: Event, tick: int, before: LayoutState) -> NodeState:
    kind = type(event)
    step = LAYOUT_STEPS.get(kind)
    after = step(before, event) if step is not None else fold_layout(before, event)  # (which raises)
    rules.check_move(event, before, after)
    if kind is RwConnect:
        after = stamp(after, before, owner=node.sessions[event.conn].tenant, last_use=tick)
    elif kind in _USES:
        after = stamp(after, before, last_use=tick)
    return _settle(node, before, after, event, tick)


def fold(node: NodeState, event: Event) -> NodeState:
    """The next node; raises the Rejection of an illegal event (``gms.fsm.rules``),
    InvariantViolation for one no state could take."""
    if type(event) is ServerStarted:
        return replace(_server_started(node, event), tick=node.tick + 1)
    if not node.started:
        raise InvariantViolation(f"cannot fold {event.KIND}: the log starts with SERVER_STARTED")
    layout = rules.check(node, event)
    step = _NODE_STEPS.get(type(event))
    if step is None:
        return _layout_event(node, event, node.tick + 1, layout)
    return step(node, event, node.tick + 1)


def fold_all(events: Iterable[Event], state: NodeState = EMPTY_NODE) -> NodeState:
    for event in events:
        state = fold(state, event)
    return state
