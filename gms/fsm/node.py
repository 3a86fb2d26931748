"""The node: every layout of one GPU, the sessions on them, the tenants and the budgets.

``fold(node, event) -> node`` is the one way the state changes (the event log
calls it).  It asks the rules (``gms.fsm.rules``) whether the event is legal
(a refusal raises the Rejection that says why), then applies it: node events
(the start, sessions) change the node; every other event is folded into the
layout it names by :func:`fold_layout`, and the node's byte accounting is
settled from the layout before and after, in O(1) (a reader's joining and
leaving do both: the session on the node, then the lock on the layout):

* a tenant is charged ``held_bytes`` for every layout it owns (built), on the
  GPU or evicted to the host: its quota bounds what it keeps in gms;
* the node's ``gpu_bytes`` sums what is on the GPU now: the GPU budget bounds it;
* ``host_bytes`` sums the host copies: the host budget bounds it;
* ``disk_bytes`` sums the snapshots on disk: the disk budget bounds it, and
  each owner is charged its layouts' (its disk quota bounds them);
* a tenant is charged ``metadata_bytes`` (keys and values, and
  ``Limits.metadata_entry_bytes`` per entry: the daemon's RAM) for every
  layout it owns, bounded by its metadata quota, and the node's
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

from collections.abc import Iterable

from immutables import Map

from . import rules
from .errors import InvariantViolation
from .events import Event, ServerStarted
from .node_steps import hold, refer, server_started
from .replace import rebuilt, replace, stamp
from .state import (
    DEFAULT_TENANT,
    EMPTY_NODE,
    LayoutState,
    NodeState,
    SessionInfo,
    TenantState,
    charged_metadata,
)
from .tier_accounts import ACCOUNTS, TierAccount

__all__ = ["DEFAULT_TENANT", "EMPTY_NODE", "NodeState", "SessionInfo", "TenantState", "fold", "fold_all"]

# -- layout events: fold the layout, settle the accounting ---------------------------------


def _charge(
    tenants: Map, name: str, held: int, metadata: int, refs: int, layout: str, event: Event, disk: int = 0,
) -> Map:
    tenant = tenants.get(name)
    if tenant is None:
        raise InvariantViolation(f"{event.KIND}: layout owned by unknown tenant {name!r}")
    state = tenant.__dict__.copy()
    state["used_bytes"] = tenant.used_bytes + held
    if metadata:
        state["metadata_bytes"] = tenant.metadata_bytes + metadata
    if disk:
        state["disk_bytes"] = tenant.disk_bytes + disk
    if refs:
        state["layout_refs"] = refer(tenant.layout_refs, layout, refs)
    return tenants.set(name, rebuilt(tenant, state))


def _settle(
    node: NodeState, before: LayoutState, after: LayoutState, event: Event, tick: int
) -> NodeState:
    # ``before`` is the node's (never vacant: a vacant layout is dropped below)
    # or a fresh vacant one, which no tenant owns: its owner is the charged one.
    vacant = after.vacant
    was, now = before.owner, None if vacant else after.owner
    held = after.held_bytes - before.held_bytes
    disk = after.disk_bytes - before.disk_bytes
    kept = after.kept_bytes - before.kept_bytes
    per_entry = node.limits.metadata_entry_bytes
    metadata = after.metadata_bytes - before.metadata_bytes + (len(after.metadata) - len(before.metadata)) * per_entry
    layouts = node.layouts
    if not vacant:
        layouts = layouts.set(after.name, after)
    elif after.name in layouts:
        layouts = layouts.delete(after.name)
    state = node.__dict__.copy()
    state["layouts"] = layouts
    state["tick"] = tick
    if (
        was is not None and was == now and not held and not metadata and not disk and not kept
        and after.tier is before.tier and after.host_bytes == before.host_bytes
    ):
        return rebuilt(node, state)  # a lock or a residency moved: no total did
    tenants = node.tenants
    if was != now:
        if was is not None:
            tenants = _charge(
                tenants, was, -before.held_bytes, -charged_metadata(before, per_entry), -1, after.name, event,
                -before.disk_bytes,
            )
        if now is not None:
            tenants = _charge(
                tenants, now, after.held_bytes, charged_metadata(after, per_entry), 1, after.name, event,
                after.disk_bytes,
            )
    elif now is not None and (held or metadata or disk):
        tenants = _charge(tenants, now, held, metadata, 0, after.name, event, disk)
    if kept or after.kept_owner != before.kept_owner:  # a snapshot kept through a rebuild: its saver's
        if before.kept_owner is not None:
            tenants = _charge(tenants, before.kept_owner, 0, 0, 0, after.name, event, -before.kept_bytes)
        if after.kept_owner is not None:
            tenants = _charge(tenants, after.kept_owner, 0, 0, 0, after.name, event, after.kept_bytes)
    if len(layouts) > len(node.layouts) and len(layouts) > node.limits.max_layouts:
        raise InvariantViolation(f"{event.KIND} would hold more than {node.limits.max_layouts} layouts")
    grown = []  # the tiers whose total grew: their budgets are held below
    for account in ACCOUNTS:  # every tier alike: its total moves by the layout's bytes there
        moved = account.held(after) - account.held(before)
        if moved:
            state[account.total] = total = state[account.total] + moved
            if moved > 0:
                grown.append((account, total))
    metadata_bytes = node.metadata_bytes + metadata
    if held > 0 or metadata > 0 or grown or was != now:
        _hold_bounds(node, after, now, event, tenants, grown, metadata_bytes)
    state["tenants"] = tenants
    state["metadata_bytes"] = metadata_bytes
    return rebuilt(node, state)


def _hold_bounds(
    node: NodeState, after: LayoutState, owner: str | None, event: Event, tenants: Map,
    grown: list[tuple[TierAccount, int]], metadata: int,
) -> None:
    """Only for steps that grew something: every bound the growth could break
    (each asked only where its total grew and a bound is set: most steps grow
    one or two, and most bounds are off)."""
    for account, total in grown:
        hold(event, getattr(node, account.total), total, getattr(node, account.budget), account.what)
    if metadata > node.metadata_bytes:
        hold(event, node.metadata_bytes, metadata, node.limits.max_metadata_bytes, "the node's metadata bytes")
    if owner is not None:
        old, new = node.tenants[owner], tenants[owner]
        if new is not old:
            if new.used_bytes > old.used_bytes and new.quota_bytes is not None:
                hold(event, old.used_bytes, new.used_bytes, new.quota_bytes, "tenant {!r}'s bytes", owner)
            if new.metadata_bytes > old.metadata_bytes:
                hold(event, old.metadata_bytes, new.metadata_bytes, new.metadata_quota,
                      "tenant {!r}'s metadata bytes", owner)
            if new.layout_refs is not old.layout_refs:
                hold(event, old.layouts, new.layouts, new.max_layouts, "tenant {!r}'s layouts", owner)
            if new.disk_bytes > old.disk_bytes:
                hold(event, old.disk_bytes, new.disk_bytes, new.disk_quota, "tenant {!r}'s disk bytes", owner)
    if after.writer is not None:
        limit = node.sessions[after.writer].limit_bytes
        if limit is not None:
            hold(event, 0, after.held_bytes, limit, "layout {!r}'s bytes (its writer's limit)", after.name)


def _layout_event(node: NodeState, event: Event, tick: int, before: LayoutState, rule: rules.Rule) -> NodeState:
    after = rule.step(before, event)
    rules.check_move(rule, event, before, after)
    if rule.owns:
        after = stamp(after, before, owner=node.sessions[event.conn].tenant, last_use=tick)
    elif rule.uses:
        after = stamp(after, before, last_use=tick)
    return _settle(node, before, after, event, tick)


def fold(node: NodeState, event: Event) -> NodeState:
    """The next node: the event's row in ``gms.fsm.rules`` checked (a refusal
    raises the Rejection that says why), then its steps applied: a node step
    to the node, then a layout step to the layout it names, whose move the
    row must list and whose bytes are settled here.  InvariantViolation for
    an event no state could take."""
    if type(event) is ServerStarted:
        return replace(server_started(node, event), tick=node.tick + 1)
    if not node.started:
        raise InvariantViolation(f"cannot fold {event.KIND}: the log starts with SERVER_STARTED")
    rule, layout = rules.check(node, event)
    tick = node.tick + 1
    if rule.node_step is not None:
        node = rule.node_step(node, event, tick)
        if rule.step is None:
            return node
    elif layout is None:  # an event that may name a layout and names none: an observation
        return replace(node, tick=tick)
    return _layout_event(node, event, tick, layout, rule)


def fold_all(events: Iterable[Event], state: NodeState = EMPTY_NODE) -> NodeState:
    for event in events:
        state = fold(state, event)
    return state
