"""Layout decisions: (layout, connection, request) -> the events that would carry it out.

Decisions propose; they do not judge.  Whether a proposed event is legal is
the table's business (``gms.fsm.rules``), asked once, by the fold, when the
shell appends the events; a batch is appended all or nothing.  What stays
here is what only a request knows: how a free cascades to the metadata
pointing into its allocation, the slot a new allocation takes, the hash a
commit publishes (computed once, here, and trusted after).
"""

from __future__ import annotations

from collections.abc import Iterable

from .events import (
    AllocationCreated,
    AllocationFreed,
    Event,
    HostCopyCreated,
    MetadataDeleted,
    MetadataPut,
    RwAbort,
    RwCommit,
)
from .layout_hash import compute_layout_hash
from .rules import Who, parse_residency, require
from .state import LayoutState, Residency


def decide_allocate(
    state: LayoutState, conn: int, allocation_id: str, size: int, aligned_size: int, tag: str
) -> list[Event]:
    """Memory for the writer; the slot is the next free one."""
    return [
        AllocationCreated(
            conn, allocation_id, size, aligned_size, tag, state.next_layout_slot, layout=state.name
        )
    ]


def decide_free(state: LayoutState, conn: int, allocation_id: str) -> list[Event]:
    """Free cascades: the metadata pointing into the allocation goes first (found
    through the layout's index, in O(keys of that allocation))."""
    freed = AllocationFreed(conn, allocation_id, layout=state.name)
    keys = state.keys_by_allocation.get(allocation_id)
    if not keys:
        return [freed]
    return [*(MetadataDeleted(conn, key, layout=state.name) for key in keys), freed]


def decide_metadata_put(
    state: LayoutState, conn: int, key: str, allocation_id: str, offset_bytes: int, value: bytes
) -> list[Event]:
    return [MetadataPut(conn, key, allocation_id, offset_bytes, value, layout=state.name)]


def decide_metadata_put_many(
    state: LayoutState, conn: int, entries: Iterable[tuple[str, str, int, bytes]]
) -> list[Event]:
    """All or nothing: the shell appends the batch atomically."""
    return [
        MetadataPut(conn, key, allocation_id, offset_bytes, value, layout=state.name)
        for key, allocation_id, offset_bytes, value in entries
    ]


def decide_metadata_delete(state: LayoutState, conn: int, key: str) -> list[Event]:
    """Deleting a missing key is not an error: nothing to append (for the writer)."""
    if key in state.metadata:
        return [MetadataDeleted(conn, key, layout=state.name)]
    require(state, conn, Who.WRITER, "metadata_delete")
    return []


def may_commit(state: LayoutState, conn: int, residency: Residency | str) -> Residency:
    """The writer's, with a residency there is: the residency; else refused.  What a
    commit that must wait first (for its host copies) is refused by before it waits."""
    require(state, conn, Who.WRITER, "commit")
    return parse_residency(residency)


def decide_commit(
    state: LayoutState, conn: int, residency: Residency | str = Residency.DEVICE, persist: bool = False,
) -> list[Event]:
    """Publish, with the layout's hash.  Only the writer's commit is worth hashing;
    dangling metadata cannot be produced by legal events, so finding one is a
    broken invariant (the server stops), not a rejection."""
    residency = may_commit(state, conn, residency)
    layout_hash = compute_layout_hash(state.allocations.values(), state.metadata.values())
    return [RwCommit(conn, layout_hash, residency.value, bool(persist), layout=state.name)]


def decide_abort(state: LayoutState, conn: int, discard: bool) -> list[Event]:
    """The writer gives up its rebuild; ``discard``: the snapshot kept through it goes too."""
    require(state, conn, Who.WRITER, "abort")
    return [RwAbort(conn, bool(discard), layout=state.name)]


def decide_host_copy(state: LayoutState, conn: int, allocation_id: str) -> list[Event]:
    """A host copy for one of the writer's allocations; asking twice is not an error."""
    if allocation_id in state.host_copies:
        require(state, conn, Who.WRITER, "host copies")
        return []
    return [HostCopyCreated(conn, allocation_id, layout=state.name)]
