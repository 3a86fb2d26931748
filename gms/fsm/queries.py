"""Read-side decisions: what a connection may see of its layout's tables.

RW and RO never coexist on a layout, so a reader's view is the committed
layout and the writer's view is its own build; both read the same tables.  A
restorer sees the committed layout it is bringing back.
"""

from __future__ import annotations

from .decide import lookup_allocation, require_lock
from .errors import InvariantViolation
from .state import Allocation, LayoutState, MetadataEntry


def require_view(state: LayoutState, conn: int, action: str) -> None:
    require_lock(state, conn, action)
    if conn in state.readers and not (state.committed and state.resident):
        raise InvariantViolation(f"reader {conn} sees a layout that is not committed and resident")


def get_allocation(state: LayoutState, conn: int, allocation_id: str) -> Allocation:
    require_view(state, conn, "get_allocation")
    return lookup_allocation(state, allocation_id)


def list_allocations(state: LayoutState, conn: int, tag: str | None = None) -> list[Allocation]:
    require_view(state, conn, "list_allocations")
    found = (a for a in state.allocations.values() if tag is None or a.tag == tag)
    return sorted(found, key=lambda a: a.layout_slot)


def get_metadata(state: LayoutState, conn: int, key: str) -> MetadataEntry | None:
    require_view(state, conn, "metadata_get")
    return state.metadata.get(key)


def list_metadata(state: LayoutState, conn: int, prefix: str = "") -> list[str]:
    require_view(state, conn, "metadata_list")
    return sorted(k for k in state.metadata.keys() if k.startswith(prefix))


def scan_metadata(state: LayoutState, conn: int, prefix: str = "") -> list[MetadataEntry]:
    """Every entry under ``prefix``, sorted by key."""
    return [state.metadata[k] for k in list_metadata(state, conn, prefix)]
