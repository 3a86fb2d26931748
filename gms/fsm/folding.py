"""``fold_layout(layout, event) -> layout``: how one layout changes.

Steps trust their event: legality is decided once, by the table in
``gms.fsm.rules``, which the node fold (``gms.fsm.node``) consults before it
calls a step.  A step only computes the next value: total, deterministic,
O(log n) in the layout's tables (persistent maps), and running sums
(``held_bytes``, ``host_bytes``, ``metadata_bytes``) are kept here so
accounting never scans a table.
"""

from __future__ import annotations

from collections.abc import Callable

from immutables import Map

from .errors import InvariantViolation
from .events import (
    AllocationCreated,
    AllocationFreed,
    AllocationOomGaveUp,
    AllocationOomWait,
    Event,
    HostCopyCreated,
    LayoutEvicted,
    LayoutLost,
    LockTimeout,
    MetadataDeleted,
    MetadataPut,
    ResidencySet,
    RestoreAborted,
    RestoreClaimed,
    RestoreFinished,
    RestoreLoading,
    RoConnect,
    RoDisconnect,
    RwAbort,
    RwCommit,
    RwConnect,
)
from .replace import rebuilt, replace
from .state import Allocation, LayoutState, MetadataEntry, Residency, Tier

_EMPTY_KEYS: Map = Map()


def entry_bytes(key: str, value: bytes) -> int:
    """What one metadata entry costs the daemon's RAM, as the fold counts it."""
    return len(key.encode()) + len(value)


# -- locks --------------------------------------------------------------------------


def _rw_connect(state: LayoutState, event: RwConnect) -> LayoutState:
    return state.fresh(writer=event.conn)


def _rw_commit(state: LayoutState, event: RwCommit) -> LayoutState:
    return replace(
        state, writer=None, committed=True, layout_hash=event.layout_hash,
        residency=Residency(event.residency), loads=state.loads + 1,
    )


def _rw_abort(state: LayoutState, event: RwAbort) -> LayoutState:
    return state.fresh()


def _ro_connect(state: LayoutState, event: RoConnect) -> LayoutState:
    return replace(state, readers=state.readers | {event.conn})


def _ro_disconnect(state: LayoutState, event: RoDisconnect) -> LayoutState:
    return replace(state, readers=state.readers - {event.conn})


# -- the writer's layout --------------------------------------------------------------


def _allocation_created(state: LayoutState, event: AllocationCreated) -> LayoutState:
    # Built by item, not by ``replace``'s keywords: the writer's steps are most of the log.
    allocation = Allocation(
        event.allocation_id, event.size, event.aligned_size, event.tag, event.layout_slot
    )
    fields = state.__dict__.copy()
    fields["allocations"] = state.allocations.set(event.allocation_id, allocation)
    fields["next_layout_slot"] = event.layout_slot + 1
    fields["held_bytes"] = state.held_bytes + event.aligned_size
    return rebuilt(state, fields)


def _allocation_freed(state: LayoutState, event: AllocationFreed) -> LayoutState:
    allocation_id = event.allocation_id
    fields = state.__dict__.copy()
    fields["allocations"] = state.allocations.delete(allocation_id)
    fields["held_bytes"] = state.held_bytes - state.allocations[allocation_id].aligned_size
    if allocation_id in state.host_copies:
        fields["host_bytes"] = state.host_bytes - state.host_copies[allocation_id]
        fields["host_copies"] = state.host_copies.delete(allocation_id)
    if allocation_id in state.keys_by_allocation:
        fields["keys_by_allocation"] = state.keys_by_allocation.delete(allocation_id)
    return rebuilt(state, fields)


def _unindex(keys: Map, allocation_id: str, key: str) -> Map:
    remaining = keys[allocation_id].delete(key)
    return keys.set(allocation_id, remaining) if remaining else keys.delete(allocation_id)


def _metadata_put(state: LayoutState, event: MetadataPut) -> LayoutState:
    keys = state.keys_by_allocation
    size = state.metadata_bytes + entry_bytes(event.key, event.value)
    old = state.metadata.get(event.key)
    if old is not None:
        size -= entry_bytes(old.key, old.value)
        keys = _unindex(keys, old.allocation_id, old.key)
    keys = keys.set(event.allocation_id, keys.get(event.allocation_id, _EMPTY_KEYS).set(event.key, None))
    entry = MetadataEntry(event.key, event.allocation_id, event.offset_bytes, event.value)
    return replace(
        state, metadata=state.metadata.set(event.key, entry), keys_by_allocation=keys, metadata_bytes=size,
    )


def _metadata_deleted(state: LayoutState, event: MetadataDeleted) -> LayoutState:
    old = state.metadata[event.key]
    return replace(
        state,
        metadata=state.metadata.delete(event.key),
        keys_by_allocation=_unindex(state.keys_by_allocation, old.allocation_id, old.key),
        metadata_bytes=state.metadata_bytes - entry_bytes(old.key, old.value),
    )


def _host_copy_created(state: LayoutState, event: HostCopyCreated) -> LayoutState:
    size = state.allocations[event.allocation_id].aligned_size
    return replace(
        state,
        host_copies=state.host_copies.set(event.allocation_id, size),
        host_bytes=state.host_bytes + size,
    )


# -- residency ---------------------------------------------------------------------------


def _residency_set(state: LayoutState, event: ResidencySet) -> LayoutState:
    return replace(state, residency=Residency(event.residency))


def _layout_evicted(state: LayoutState, event: LayoutEvicted) -> LayoutState:
    if state.residency is Residency.UNPINNED:
        # No host copy: its next user reloads it from wherever it came from.
        return state.fresh(evictions=state.evictions + 1)
    return replace(state, tier=Tier.HOST, evictions=state.evictions + 1)


def _restore_claimed(state: LayoutState, event: RestoreClaimed) -> LayoutState:
    return replace(state, restorer=event.conn)


def _restore_loading(state: LayoutState, event: RestoreLoading) -> LayoutState:
    return replace(state, tier=Tier.RESTORING)


def _restore_finished(state: LayoutState, event: RestoreFinished) -> LayoutState:
    return replace(
        state,
        tier=Tier.GPU,
        restorer=None,
        readers=state.readers | {event.conn},
        restores=state.restores + 1,
    )


def _restore_aborted(state: LayoutState, event: RestoreAborted) -> LayoutState:
    return replace(state, tier=Tier.HOST, restorer=None)


def _layout_lost(state: LayoutState, event: LayoutLost) -> LayoutState:
    return state.fresh()


def _unchanged(state: LayoutState, event: Event) -> LayoutState:
    return state


LAYOUT_STEPS: dict[type[Event], Callable[[LayoutState, Event], LayoutState]] = {
    RwConnect: _rw_connect,
    RwCommit: _rw_commit,
    RwAbort: _rw_abort,
    RoConnect: _ro_connect,
    RoDisconnect: _ro_disconnect,
    AllocationCreated: _allocation_created,
    AllocationFreed: _allocation_freed,
    MetadataPut: _metadata_put,
    MetadataDeleted: _metadata_deleted,
    HostCopyCreated: _host_copy_created,
    ResidencySet: _residency_set,
    LayoutEvicted: _layout_evicted,
    RestoreClaimed: _restore_claimed,
    RestoreLoading: _restore_loading,
    RestoreFinished: _restore_finished,
    RestoreAborted: _restore_aborted,
    LayoutLost: _layout_lost,
    AllocationOomWait: _unchanged,
    AllocationOomGaveUp: _unchanged,
    LockTimeout: _unchanged,
}


def fold_layout(state: LayoutState, event: Event) -> LayoutState:
    """Apply an event the rules have accepted (see module doc)."""
    try:
        step = LAYOUT_STEPS[type(event)]
    except KeyError:
        raise InvariantViolation(f"no layout fold step for {type(event).__name__}") from None
    return step(state, event)
