"""Read-side decisions: what a connection may see of its layout's tables.

RW and RO never coexist on a layout, so a reader's view is the committed
layout and the writer's view is its own build; both read the same tables.  A
restorer sees the committed layout it is bringing back.
"""

from __future__ import annotations

from .errors import InvariantViolation, NotConnected, StateViolation
from .rules import Who, allocation_of, require
from .state import Allocation, LayoutState, MetadataEntry, Tier


def layout_of(node, conn: int) -> LayoutState:
    """The layout ``conn``'s session is on."""
    session = node.sessions.get(conn)
    if session is None:
        raise NotConnected("this request needs a lock: send HandshakeRequest first")
    return node.layouts.get(session.layout) or node.layout(session.layout)


def require_view(state: LayoutState, conn: int, action: str) -> None:
    if conn in state.readers:  # the common case, asked first
        if not (state.committed and state.resident):
            raise InvariantViolation(f"reader {conn} sees a layout that is not committed and resident")
    elif conn != state.writer and conn != state.restorer:
        require(state, conn, Who.HOLDER, action)  # raises why


def exportable(state: LayoutState, conn: int, allocation_ids: list[str]) -> list[Allocation]:
    """What a holder may export: the restorer only once the GPU memory exists."""
    _may_export(state, conn)
    return [allocation_of(state, allocation_id) for allocation_id in allocation_ids]


def export_one(state: LayoutState, conn: int, allocation_id: str) -> Allocation:
    """:func:`exportable` for one allocation (the common request)."""
    _may_export(state, conn)
    return allocation_of(state, allocation_id)


def _may_export(state: LayoutState, conn: int) -> None:
    require_view(state, conn, "get_allocation")
    if state.restorer == conn and state.tier is not Tier.RESTORING:
        raise StateViolation("the layout's GPU memory is not there yet")


def get_allocation(state: LayoutState, conn: int, allocation_id: str) -> Allocation:
    require_view(state, conn, "get_allocation")
    return allocation_of(state, allocation_id)


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


def host_copies_to_export(state: LayoutState, conn: int, allocation_ids: list[str]) -> bool:
    """Whose host copies a holder may ask for: the writer's (it may have them
    made), the restorer's of an evicted layout (they must exist).  True for
    the restorer."""
    require_view(state, conn, "host copies")
    for allocation_id in allocation_ids:
        allocation_of(state, allocation_id)  # another layout's id is unknown here
    if state.restorer != conn:
        return False
    _restorable(state, allocation_ids)
    return True


def host_chunks_to_export(state: LayoutState, conn: int, allocation_ids: list[str]) -> None:
    """The chunks of host copies are the restorer's to read, each copy there."""
    require_view(state, conn, "host chunks")
    if state.restorer != conn:
        raise StateViolation("host chunks are for the restorer of an evicted layout")
    for allocation_id in allocation_ids:
        allocation_of(state, allocation_id)
    _restorable(state, allocation_ids)


def _restorable(state: LayoutState, allocation_ids: list[str]) -> None:
    missing = [i for i in allocation_ids if i not in state.host_copies]
    if missing:
        raise StateViolation(
            f"{len(missing)} allocations have no host copy to restore from (the first: {missing[0]!r})"
        )


def unsaved(node) -> list[str]:
    """Layouts committed to persist whose snapshot is not saved yet and whose bytes
    are on the GPU to save from, least recently used first (the disk tier's queue)."""
    waiting = [
        layout for layout in node.layouts.values()
        if layout.unsaved and layout.resident
    ]
    return [layout.name for layout in sorted(waiting, key=lambda layout: (layout.last_use, layout.name))]


def reverting(node) -> list[str]:
    """The layouts that await a revert (LayoutState.awaits_revert), by name."""
    return sorted(name for name, layout in node.layouts.items() if layout.awaits_revert)


def snapshot_rows(layout: LayoutState) -> tuple[list[list], list[list]]:
    """A committed layout's allocations (in slot order) and metadata (in key order),
    as a snapshot's manifest and ``LAYOUT_RECOVERED`` write them."""
    allocations = sorted(layout.allocations.values(), key=lambda a: a.layout_slot)
    return (
        [[a.allocation_id, a.size, a.aligned_size, a.tag, a.layout_slot] for a in allocations],
        [[m.key, m.allocation_id, m.offset_bytes, m.value] for _, m in sorted(layout.metadata.items())],
    )
