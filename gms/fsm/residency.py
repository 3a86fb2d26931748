"""Residency decisions: what to evict under the budget, pinning, and restores.

Eviction is least-recently-used over idle committed layouts (no writer, no
reader, no restorer, nobody waiting), never ``device`` ones, and only when it
makes the request fit: evicting without making room would cost hits and
still leave the request waiting.  VMM memory has no arena, so freeing any
layout's bytes makes room for any other's: there is nothing to compact.
"""

from __future__ import annotations

from collections.abc import Container

from .decide import parse_residency, require_host_copies
from .errors import NotEvictable, StateViolation, UnknownLayout
from .events import Event, LayoutEvicted, ResidencySet, RestoreFinished, RestoreLoading
from .node import NodeState
from .state import LayoutState, Residency, Tier


def why_not_evictable(layout: LayoutState) -> str | None:
    if not layout.committed or layout.writer is not None:
        return "it is not a committed layout"
    if layout.residency is Residency.DEVICE:
        return "it is pinned to the device (residency device)"
    if not layout.resident:
        return f"it is not on the GPU (tier {layout.tier.value})"
    if layout.readers or layout.restorer is not None:
        return f"it has {len(layout.readers) + (layout.restorer is not None)} readers"
    return None


def eviction_candidates(node: NodeState, busy: Container[str] = ()) -> list[LayoutState]:
    """Idle evictable layouts, least recently used first (``busy``: names with waiters)."""
    found = [
        layout
        for layout in node.layouts.values()
        if layout.name not in busy and why_not_evictable(layout) is None
    ]
    return sorted(found, key=lambda layout: (layout.last_use, layout.name))


def plan_evictions(node: NodeState, needed: int, busy: Container[str] = ()) -> list[str] | None:
    """The LRU layouts whose eviction frees ``needed`` GPU bytes; None if all of them would not."""
    if needed <= 0:
        return []
    chosen: list[str] = []
    for layout in eviction_candidates(node, busy):
        chosen.append(layout.name)
        needed -= layout.gpu_bytes
        if needed <= 0:
            return chosen
    return None


def _known(node: NodeState, name: str) -> LayoutState:
    layout = node.layouts.get(name)
    if layout is None:
        raise UnknownLayout(f"no layout {name!r} on this server")
    return layout


def decide_evict(node: NodeState, conn: int, name: str, reason: str) -> list[Event]:
    layout = _known(node, name)
    why = why_not_evictable(layout)
    if why is not None:
        raise NotEvictable(f"cannot evict layout {name!r}: {why}")
    return [LayoutEvicted(conn, reason, layout=name)]


def decide_pin(node: NodeState, conn: int, name: str, residency: Residency | str) -> list[Event]:
    layout = _known(node, name)
    residency = parse_residency(residency)
    if not layout.committed or layout.writer is not None:
        raise StateViolation(f"layout {name!r} is not committed: its writer sets residency at commit")
    if not layout.resident:
        raise StateViolation(f"layout {name!r} is evicted: pin it once a reader has brought it back")
    if residency is Residency.SYSTEM:
        require_host_copies(layout)
    if residency is layout.residency:
        return []
    return [ResidencySet(conn, residency.value, layout=name)]


def decide_restore_loading(node: NodeState, conn: int, name: str) -> list[Event]:
    layout = node.layout(name)
    if layout.restorer != conn or layout.tier is not Tier.HOST:
        raise StateViolation("this connection is not restoring the layout")
    return [RestoreLoading(conn, layout=name)]


def decide_restore_finished(node: NodeState, conn: int, name: str) -> list[Event]:
    layout = node.layout(name)
    if layout.restorer != conn or layout.tier is not Tier.RESTORING:
        raise StateViolation("this connection is not restoring the layout")
    return [RestoreFinished(conn, layout=name)]
