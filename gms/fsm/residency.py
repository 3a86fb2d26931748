"""Residency decisions: what to evict under the budget, pinning, and restores.

Eviction is least-recently-used over idle committed layouts (no writer, no
reader, no restorer, nobody waiting), never ``device`` ones, and only when it
makes the request fit: evicting without making room would cost hits and
still leave the request waiting.  VMM memory has no arena, so freeing any
layout's bytes makes room for any other's: there is nothing to compact.
A full host tier spills saved layouts to their snapshots the same way
(least recently used first, only when that makes the room).  Which layout
*may* be evicted or spilled is the table's rule for ``LAYOUT_EVICTED`` and
``LAYOUT_SPILLED`` (``gms.fsm.rules``); this module only chooses among them.
"""

from __future__ import annotations

from collections.abc import Container

from . import rules
from .errors import Rejection, UnknownLayout
from .events import (
    Event,
    LayoutDeleted,
    LayoutEvicted,
    LayoutSpilled,
    ResidencySet,
    RestoreFinished,
    RestoreLoading,
)
from .state import LayoutState, NodeState, Residency


def why_not_evictable(node: NodeState, layout: LayoutState) -> str | None:
    return _why_not(node, LayoutEvicted(0, "budget", layout=layout.name))


def _why_not(node: NodeState, event: Event) -> str | None:
    """The rules' refusal of ``event`` on ``node``, or None where they allow it."""
    try:
        rules.check(node, event)
    except Rejection as refused:
        return refused.message
    return None


def eviction_candidates(node: NodeState, busy: Container[str] = ()) -> list[LayoutState]:
    """Idle evictable layouts, least recently used first (``busy``: names with waiters)."""
    found = [
        layout
        for layout in node.layouts.values()
        if layout.name not in busy and why_not_evictable(node, layout) is None
    ]
    return sorted(found, key=_lru)


def plan_evictions(node: NodeState, needed: int, busy: Container[str] = ()) -> list[str] | None:
    """The LRU layouts whose eviction frees ``needed`` GPU bytes; None if all of them would not."""
    return _covering(eviction_candidates(node, busy), needed, lambda layout: layout.gpu_bytes)


def plan_spills(node: NodeState, needed: int, busy: Container[str] = ()) -> list[str] | None:
    """The LRU layouts on the host tier whose spill to their snapshots frees
    ``needed`` host bytes; None if all of them would not (spilling then would
    only cost their next readers a disk read)."""
    spillable = [
        layout
        for layout in node.layouts.values()
        if layout.host_bytes
        and layout.name not in busy
        and _why_not(node, LayoutSpilled(0, "host budget", layout=layout.name)) is None
    ]
    return _covering(sorted(spillable, key=_lru), needed, lambda layout: layout.host_bytes)


def _lru(layout: LayoutState) -> tuple:
    return (layout.last_use, layout.name)


def _covering(ordered: list[LayoutState], needed: int, size) -> list[str] | None:
    """The first of ``ordered`` whose sizes add up to ``needed``; None if all do not."""
    if needed <= 0:
        return []
    chosen: list[str] = []
    for layout in ordered:
        chosen.append(layout.name)
        needed -= size(layout)
        if needed <= 0:
            return chosen
    return None


def decide_spill(node: NodeState, conn: int, name: str, reason: str) -> list[Event]:
    _known(node, name)
    return [LayoutSpilled(conn, reason, layout=name)]


def _known(node: NodeState, name: str) -> LayoutState:
    layout = node.layouts.get(name)
    if layout is None:
        raise UnknownLayout(f"no layout {name!r} on this server")
    return layout


def decide_evict(node: NodeState, conn: int, name: str, reason: str) -> list[Event]:
    _known(node, name)
    return [LayoutEvicted(conn, reason, layout=name)]


def decide_delete(node: NodeState, conn: int, uid: int, name: str) -> list[Event]:
    """An admin's delete of an idle committed layout, from every tier (``NOT_EVICTABLE``
    while anyone holds it: revoke first)."""
    _known(node, name)
    return [LayoutDeleted(conn, uid, layout=name)]


def decide_pin(node: NodeState, conn: int, name: str, residency: Residency | str) -> list[Event]:
    layout = _known(node, name)
    event = ResidencySet(conn, rules.parse_residency(residency).value, layout=name)
    if event.residency != layout.residency.value:
        return [event]
    rules.check(node, event)  # pinning what is already so: still only where pinning is legal
    return []


def decide_restore_loading(node: NodeState, conn: int, name: str) -> list[Event]:
    return [RestoreLoading(conn, layout=name)]


def decide_restore_finished(node: NodeState, conn: int, name: str) -> list[Event]:
    return [RestoreFinished(conn, layout=name)]
