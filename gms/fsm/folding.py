"""How one layout changes: a step per layout event, ``step(layout, event) -> layout``.

Each event's row in ``gms.fsm.rules`` names its step; steps trust their
event: legality is decided once, by that row, which the node fold
(``gms.fsm.node``) consults before it calls the step.  A step only computes the next value: total, deterministic,
O(log n) in the layout's tables (persistent maps), and running sums
(``held_bytes``, ``host_bytes``, ``metadata_bytes``) are kept here so
accounting never scans a table.
"""

from __future__ import annotations

from immutables import Map

from .events import (
    AllocationCreated,
    AllocationFreed,
    Event,
    HostCopyCreated,
    LayoutDeleted,
    LayoutEvicted,
    LayoutFellToDisk,
    LayoutLost,
    LayoutRecovered,
    LayoutSpilled,
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
    SnapshotFailed,
    SnapshotSaved,
    SnapshotSetAside,
)
from .replace import rebuilt, replace
from .state import Allocation, LayoutState, MetadataEntry, Residency, Tier

_EMPTY_KEYS: Map = Map()


def entry_bytes(key: str, value: bytes) -> int:
    """What one metadata entry costs the daemon's RAM, as the fold counts it
    (its key's UTF-8 bytes: for an ASCII key, its length, with no copy made)."""
    return (len(key) if key.isascii() else len(key.encode())) + len(value)


# -- locks --------------------------------------------------------------------------


_NOTHING_KEPT = {"kept_file": "", "kept_bytes": 0, "kept_owner": None}


def rw_connect(state: LayoutState, event: RwConnect) -> LayoutState:
    """The layout cleared; its snapshot (or, rebuilt again before that commit was
    saved, the one kept from before) stays until a newer one is whole (LayoutState.kept_file)."""
    if state.saved:
        kept = {"kept_file": state.disk_file, "kept_bytes": state.disk_bytes, "kept_owner": state.owner}
    else:
        kept = _kept(state)
    return state.fresh(writer=event.conn, **kept)


def rw_commit(state: LayoutState, event: RwCommit) -> LayoutState:
    kept = {} if event.persist or not state.kept_file else _NOTHING_KEPT  # a commit asking for none: it goes
    return replace(
        state, writer=None, committed=True, layout_hash=event.layout_hash,
        residency=Residency(event.residency), persist=event.persist, loads=state.loads + 1,
        keys_by_allocation=_EMPTY_KEYS,  # (no writer will free an allocation of it: see LayoutState)
        save_error="",
        **kept,
    )


def _kept(state: LayoutState) -> dict:
    return {"kept_file": state.kept_file, "kept_bytes": state.kept_bytes, "kept_owner": state.kept_owner}


def rw_abort(state: LayoutState, event: RwAbort) -> LayoutState:
    """The writer's layout goes; a snapshot kept through its rebuild stays, for the
    disk tier to bring back (LAYOUT_RECOVERED), unless the writer discards it."""
    return state.fresh() if event.discard else state.fresh(**_kept(state))


def ro_connect(state: LayoutState, event: RoConnect) -> LayoutState:
    return replace(state, readers=state.readers | {event.conn})


def ro_disconnect(state: LayoutState, event: RoDisconnect) -> LayoutState:
    return replace(state, readers=state.readers - {event.conn})


# -- the writer's layout --------------------------------------------------------------


def allocation_created(state: LayoutState, event: AllocationCreated) -> LayoutState:
    # Built by item, not by ``replace``'s keywords: the writer's steps are most of the log.
    allocation = Allocation(
        event.allocation_id, event.size, event.aligned_size, event.tag, event.layout_slot
    )
    fields = state.__dict__.copy()
    fields["allocations"] = state.allocations.set(event.allocation_id, allocation)
    fields["next_layout_slot"] = event.layout_slot + 1
    fields["held_bytes"] = state.held_bytes + event.aligned_size
    return rebuilt(state, fields)


def allocation_freed(state: LayoutState, event: AllocationFreed) -> LayoutState:
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


def metadata_put(state: LayoutState, event: MetadataPut) -> LayoutState:
    keys = state.keys_by_allocation
    size = state.metadata_bytes + entry_bytes(event.key, event.value)
    old = state.metadata.get(event.key)
    if old is not None:
        size -= entry_bytes(old.key, old.value)
        keys = _unindex(keys, old.allocation_id, old.key)
    # The allocation's own id string, not the event's copy: one per allocation, not one per entry.
    allocation_id = state.allocations[event.allocation_id].allocation_id
    keys = keys.set(allocation_id, keys.get(allocation_id, _EMPTY_KEYS).set(event.key, None))
    entry = MetadataEntry(event.key, allocation_id, event.offset_bytes, event.value)
    return replace(
        state, metadata=state.metadata.set(event.key, entry), keys_by_allocation=keys, metadata_bytes=size,
    )


def metadata_deleted(state: LayoutState, event: MetadataDeleted) -> LayoutState:
    old = state.metadata[event.key]
    return replace(
        state,
        metadata=state.metadata.delete(event.key),
        keys_by_allocation=_unindex(state.keys_by_allocation, old.allocation_id, old.key),
        metadata_bytes=state.metadata_bytes - entry_bytes(old.key, old.value),
    )


def host_copy_created(state: LayoutState, event: HostCopyCreated) -> LayoutState:
    size = state.allocations[event.allocation_id].aligned_size
    return replace(
        state,
        host_copies=state.host_copies.set(event.allocation_id, size),
        host_bytes=state.host_bytes + size,
    )


# -- residency ---------------------------------------------------------------------------


def residency_set(state: LayoutState, event: ResidencySet) -> LayoutState:
    return replace(state, residency=Residency(event.residency))


def layout_evicted(state: LayoutState, event: LayoutEvicted) -> LayoutState:
    if restore_source(state) is Tier.HOST:
        return replace(state, tier=Tier.HOST, evictions=state.evictions + 1)
    if state.saved:  # its snapshot holds it (a system layout back from disk has no host copy)
        return _to_snapshot(state, evictions=state.evictions + 1)
    # Unpinned, no copy anywhere: its next user reloads it from wherever it came from.
    return state.fresh(evictions=state.evictions + 1)


def layout_spilled(state: LayoutState, event: LayoutSpilled) -> LayoutState:
    return _to_snapshot(state, evictions=state.evictions + 1)


def layout_fell_to_disk(state: LayoutState, event: LayoutFellToDisk) -> LayoutState:
    return _to_snapshot(state)


def _to_snapshot(state: LayoutState, **changes: object) -> LayoutState:
    """The layout on the disk tier: its snapshot alone holds the bytes (no host copy left)."""
    return replace(state, tier=Tier.DISK, host_copies=Map(), host_bytes=0, **changes)


def restore_claimed(state: LayoutState, event: RestoreClaimed) -> LayoutState:
    return replace(state, restorer=event.conn)


def restore_loading(state: LayoutState, event: RestoreLoading) -> LayoutState:
    return replace(state, tier=Tier.RESTORING)


def restore_finished(state: LayoutState, event: RestoreFinished) -> LayoutState:
    return replace(
        state,
        tier=Tier.GPU,
        restorer=None,
        readers=state.readers | {event.conn},
        restores=state.restores + 1,
    )


def restore_aborted(state: LayoutState, event: RestoreAborted) -> LayoutState:
    return replace(state, tier=restore_source(state), restorer=None)


def restore_source(state: LayoutState) -> Tier:
    """Where an evicted layout's bytes are restored from: the tier it is on; else
    (leaving the GPU, or restoring) its host copies (residency system, every one
    held, and some, or no snapshot), else its snapshot on disk."""
    if state.tier is Tier.HOST or state.tier is Tier.DISK:
        return state.tier
    every = len(state.host_copies) == len(state.allocations)
    if state.residency is Residency.SYSTEM and every and (state.host_copies or not state.saved):
        return Tier.HOST
    return Tier.DISK


# -- the disk tier ------------------------------------------------------------------------


def snapshot_saved(state: LayoutState, event: SnapshotSaved) -> LayoutState:
    """The commit's snapshot is whole: the earlier one kept through its rebuild goes."""
    return replace(state, disk_bytes=event.bytes, disk_file=event.file, save_error="", **_NOTHING_KEPT)


def snapshot_failed(state: LayoutState, event: SnapshotFailed) -> LayoutState:
    """Why this commit waits to be saved (a failure of a read back, or of another
    commit, changes nothing)."""
    if state.unsaved and event.layout_hash == state.layout_hash:
        return replace(state, save_error=event.reason)
    return state


def layout_recovered(state: LayoutState, event: LayoutRecovered) -> LayoutState:
    """The layout as its snapshot describes it, on the disk tier, with the residency
    it had at its save: a restored copy that may be evicted goes back to its
    snapshot (a ``system`` one too: it has no host copy until a new commit)."""
    allocations = {
        allocation_id: Allocation(allocation_id, size, aligned, tag, slot)
        for allocation_id, size, aligned, tag, slot in event.allocations
    }
    metadata = {}
    for key, allocation_id, offset, value in event.metadata:
        allocation_id = allocations[allocation_id].allocation_id  # one id string per allocation
        metadata[key] = MetadataEntry(key, allocation_id, offset, value)
    return state.fresh(
        committed=True,
        allocations=Map(allocations),
        metadata=Map(metadata),
        metadata_bytes=sum(entry_bytes(m.key, m.value) for m in metadata.values()),
        layout_hash=event.layout_hash,
        next_layout_slot=1 + max((a.layout_slot for a in allocations.values()), default=-1),
        held_bytes=sum(a.aligned_size for a in allocations.values()),
        owner=event.owner,
        residency=Residency(event.residency),
        tier=Tier.DISK,
        persist=True,
        disk_bytes=event.bytes,
        disk_file=event.file,
    )


def layout_lost(state: LayoutState, event: LayoutLost) -> LayoutState:
    """Dropped; a snapshot kept from before this commit stays, to be brought back (as rw_abort)."""
    return state.fresh(**_kept(state))


def layout_deleted(state: LayoutState, event: LayoutDeleted) -> LayoutState:
    """An admin's delete: every copy goes, a kept snapshot too."""
    return state.fresh()


def snapshot_set_aside(state: LayoutState, event: SnapshotSetAside) -> LayoutState:
    """The layout's snapshot was not served (it does not read, or the policy refuses
    it): an empty layout says why to its readers; one kept through a rebuild is kept
    no longer (the file was set aside or left unlisted)."""
    if state.kept_file and state.kept_file == event.file:
        return replace(state, unserved=event.reason, **_NOTHING_KEPT)
    if state.committed or state.writer is not None or state.kept_file:
        return state  # (a layout served from another snapshot, or being built)
    return replace(state, unserved=event.reason)


def unchanged(state: LayoutState, event: Event) -> LayoutState:
    return state
