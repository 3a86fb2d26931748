"""How the node events change the node: the server's start and resume, a
session opened and closed, observations.  Like ``gms.fsm.folding``'s layout
steps, each trusts its event (its row in ``gms.fsm.rules`` was checked) and
only computes the next value; the rows name these steps.
"""

from __future__ import annotations

from immutables import Map

from .errors import InvariantViolation
from .events import Event, ServerResumed, ServerStarted, SessionClosed, SessionOpened
from .limits import Limits
from .replace import replace
from .state import NodeState, SessionInfo, TenantState, charged_metadata


def hold(event: Event, before: int, after: int, bound: int | None, what: str, *names: str) -> None:
    """A total may only pass its bound by not growing (a bound lowered under it).
    Every step that grows passes here: ``what`` is formatted (with ``names``)
    only to raise."""
    if bound is not None and after > bound and after > before:
        raise InvariantViolation(
            f"{event.KIND} would take {what.format(*names)} to {after}, past its bound of {bound}"
        )


def server_started(node: NodeState, event: ServerStarted) -> NodeState:
    if node.started:
        raise InvariantViolation("cannot fold SERVER_STARTED: the server has started already")
    tenants = Map(
        {
            name: TenantState(
                name,
                quota,
                metadata_quota=event.tenant_limits.get(name, {}).get("metadata_quota"),
                max_layouts=event.tenant_limits.get(name, {}).get("max_layouts"),
                disk_quota=event.tenant_limits.get(name, {}).get("disk_quota"),
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
        disk_budget_bytes=event.disk_budget_bytes,
        limits=Limits.from_dict(event.limits),
        tenants=tenants,
    )


def server_resumed(node: NodeState, event: ServerResumed, tick: int) -> NodeState:
    """The new server's configuration replaces the old one's; a tenant the new
    policy does not name keeps its quotas (it may own layouts: they stay charged);
    one that ``tenant_limits`` does not name is unbounded in metadata and layouts
    (a SERVER_RESUMED logged before those bounds existed).  A new charge per
    metadata entry recounts what every owner and the node are charged (one
    pass over the layouts, not their entries)."""
    limits = Limits.from_dict(event.limits)
    tenants = node.tenants
    metadata_bytes = node.metadata_bytes
    if limits.metadata_entry_bytes != node.limits.metadata_entry_bytes:
        owed: dict[str, int] = {}
        for layout in node.layouts.values():
            if layout.owner is not None:
                owed[layout.owner] = owed.get(layout.owner, 0) + charged_metadata(layout, limits.metadata_entry_bytes)
        tenants = Map({name: replace(t, metadata_bytes=owed.get(name, 0)) for name, t in tenants.items()})
        metadata_bytes = sum(owed.values())
    for name, quota in event.quotas.items():
        bounds = event.tenant_limits.get(name, {})
        tenant = tenants.get(name) or TenantState(name)
        tenants = tenants.set(
            name,
            replace(
                tenant, quota_bytes=quota, metadata_quota=bounds.get("metadata_quota"),
                max_layouts=bounds.get("max_layouts"), disk_quota=bounds.get("disk_quota"),
            ),
        )
    return replace(
        node,
        capacity_bytes=event.capacity_bytes,
        budget_bytes=event.budget_bytes,
        host_budget_bytes=event.host_budget_bytes,
        disk_budget_bytes=event.disk_budget_bytes,
        limits=limits,
        tenants=tenants,
        metadata_bytes=metadata_bytes,
        tick=tick,
    )


def may_write(lock_type: str) -> bool:
    """A session that may become its layout's writer (it counts the layout)."""
    return lock_type != "RO"


def refer(refs: Map, layout: str, delta: int) -> Map:
    count = refs.get(layout, 0) + delta
    if count < 0:
        raise InvariantViolation(f"layout {layout!r} dereferenced more than referenced")
    return refs.set(layout, count) if count else refs.delete(layout)


def session_opened(node: NodeState, event: SessionOpened, tick: int) -> NodeState:
    tenant = node.tenants[event.tenant]
    session = SessionInfo(
        event.layout, event.tenant, event.uid, event.gid, event.pid, event.lock_type, event.limit_bytes
    )
    refs = tenant.layout_refs
    if may_write(event.lock_type):
        refs = refer(refs, event.layout, 1)
        hold(event, len(tenant.layout_refs), len(refs), tenant.max_layouts, "tenant {!r}'s layouts", tenant.name)
    return replace(
        node,
        sessions=node.sessions.set(event.conn, session),
        tenants=node.tenants.set(tenant.name, replace(tenant, sessions=tenant.sessions + 1, layout_refs=refs)),
        tick=tick,
    )


def session_closed(node: NodeState, event: SessionClosed, tick: int) -> NodeState:
    session = node.sessions[event.conn]
    tenant = node.tenants[session.tenant]
    refs = refer(tenant.layout_refs, session.layout, -1) if may_write(session.lock_type) else tenant.layout_refs
    return replace(
        node,
        sessions=node.sessions.delete(event.conn),
        tenants=node.tenants.set(tenant.name, replace(tenant, sessions=tenant.sessions - 1, layout_refs=refs)),
        tick=tick,
    )


def observation(node: NodeState, event: Event, tick: int) -> NodeState:
    return replace(node, tick=tick)
