"""``fold_layout(layout, event) -> layout``: how one layout changes.

Total and deterministic: every layout event type has a step, and a step
either returns the next state or raises :class:`InvariantViolation` when the
state cannot accept the event.  Nothing is ever silently ignored: the shell
only folds events its decisions produced, so a refusal here is a bug in the
shell.  The node fold (:mod:`gms.fsm.node`) routes each event to its layout.
"""

from __future__ import annotations

from collections.abc import Callable


from .errors import InvariantViolation
from .events import (
    AllocationCreated,
    AllocationFreed,
    AllocationOomGaveUp,
    AllocationOomWait,
    Event,
    HostCopyCreated,
    LayoutEvicted,
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
from .layout_hash import compute_layout_hash
from .replace import replace
from .state import Allocation, LayoutState, MetadataEntry, Residency, Tier


def _refuse(state: LayoutState, event: Event, why: str) -> InvariantViolation:
    return InvariantViolation(
        f"cannot fold {event.KIND} from conn {event.conn} into layout {state.name!r} ({why}); "
        f"state {state.lock_state.value}, writer={state.writer}, readers={sorted(state.readers)}, "
        f"restorer={state.restorer}, tier={state.tier.value}"
    )


def _require_writer(state: LayoutState, event: Event) -> None:
    if state.writer != event.conn:
        raise _refuse(state, event, "connection is not the writer")


def _require_restorer(state: LayoutState, event: Event) -> None:
    if state.restorer != event.conn:
        raise _refuse(state, event, "connection is not the restorer")


def _residency(state: LayoutState, event: Event, value: str) -> Residency:
    try:
        return Residency(value)
    except ValueError:
        raise _refuse(state, event, f"unknown residency {value!r}") from None


def _host_copies_complete(state: LayoutState) -> bool:
    return len(state.host_copies) == len(state.allocations)


# -- locks --------------------------------------------------------------------------


def _rw_connect(state: LayoutState, event: RwConnect) -> LayoutState:
    if state.writer is not None or state.readers or state.restorer is not None:
        raise _refuse(state, event, "lock is held")
    return state.fresh(writer=event.conn)


def _rw_commit(state: LayoutState, event: RwCommit) -> LayoutState:
    _require_writer(state, event)
    expected = compute_layout_hash(state.allocations.values(), state.metadata.values())
    if event.layout_hash != expected:
        raise _refuse(state, event, f"hash {event.layout_hash} != layout's {expected}")
    residency = _residency(state, event, event.residency)
    if residency is Residency.SYSTEM and not _host_copies_complete(state):
        raise _refuse(state, event, "residency system without a host copy of every allocation")
    return replace(
        state, writer=None, committed=True, layout_hash=event.layout_hash,
        residency=residency, loads=state.loads + 1,
    )


def _rw_abort(state: LayoutState, event: RwAbort) -> LayoutState:
    _require_writer(state, event)
    return state.fresh()


def _ro_connect(state: LayoutState, event: RoConnect) -> LayoutState:
    if state.writer is not None or not state.committed:
        raise _refuse(state, event, "no committed layout to read")
    if not state.resident or state.restorer is not None:
        raise _refuse(state, event, "layout is not on the GPU")
    if event.conn in state.readers:
        raise _refuse(state, event, "already a reader")
    return replace(state, readers=state.readers | {event.conn})


def _ro_disconnect(state: LayoutState, event: RoDisconnect) -> LayoutState:
    if event.conn not in state.readers:
        raise _refuse(state, event, "not a reader")
    return replace(state, readers=state.readers - {event.conn})


# -- the writer's layout --------------------------------------------------------------


def _allocation_created(state: LayoutState, event: AllocationCreated) -> LayoutState:
    _require_writer(state, event)
    if event.allocation_id in state.allocations:
        raise _refuse(state, event, f"allocation {event.allocation_id!r} exists")
    if event.layout_slot != state.next_layout_slot:
        raise _refuse(state, event, f"slot {event.layout_slot} != next {state.next_layout_slot}")
    if not 0 < event.size <= event.aligned_size:
        raise _refuse(state, event, f"bad sizes {event.size}/{event.aligned_size}")
    allocation = Allocation(
        event.allocation_id, event.size, event.aligned_size, event.tag, event.layout_slot
    )
    return replace(
        state,
        allocations=state.allocations.set(event.allocation_id, allocation),
        next_layout_slot=event.layout_slot + 1,
        held_bytes=state.held_bytes + event.aligned_size,
    )


def _allocation_freed(state: LayoutState, event: AllocationFreed) -> LayoutState:
    _require_writer(state, event)
    allocation = state.allocations.get(event.allocation_id)
    if allocation is None:
        raise _refuse(state, event, f"unknown allocation {event.allocation_id!r}")
    for entry in state.metadata.values():
        if entry.allocation_id == event.allocation_id:
            raise _refuse(state, event, f"metadata {entry.key!r} still points into it")
    host_copies, host_bytes = state.host_copies, state.host_bytes
    if event.allocation_id in host_copies:
        host_bytes -= host_copies[event.allocation_id]
        host_copies = host_copies.delete(event.allocation_id)
    return replace(
        state,
        allocations=state.allocations.delete(event.allocation_id),
        held_bytes=state.held_bytes - allocation.aligned_size,
        host_copies=host_copies,
        host_bytes=host_bytes,
    )


def _metadata_put(state: LayoutState, event: MetadataPut) -> LayoutState:
    _require_writer(state, event)
    allocation = state.allocations.get(event.allocation_id)
    if allocation is None:
        raise _refuse(state, event, f"unknown allocation {event.allocation_id!r}")
    if not 0 <= event.offset_bytes < allocation.size:
        raise _refuse(state, event, f"offset {event.offset_bytes} outside {allocation.size}")
    entry = MetadataEntry(event.key, event.allocation_id, event.offset_bytes, event.value)
    return replace(state, metadata=state.metadata.set(event.key, entry))


def _metadata_deleted(state: LayoutState, event: MetadataDeleted) -> LayoutState:
    _require_writer(state, event)
    if event.key not in state.metadata:
        raise _refuse(state, event, f"unknown key {event.key!r}")
    return replace(state, metadata=state.metadata.delete(event.key))


def _host_copy_created(state: LayoutState, event: HostCopyCreated) -> LayoutState:
    _require_writer(state, event)
    allocation = state.allocations.get(event.allocation_id)
    if allocation is None:
        raise _refuse(state, event, f"unknown allocation {event.allocation_id!r}")
    if event.allocation_id in state.host_copies:
        raise _refuse(state, event, f"allocation {event.allocation_id!r} has a host copy")
    return replace(
        state,
        host_copies=state.host_copies.set(event.allocation_id, allocation.aligned_size),
        host_bytes=state.host_bytes + allocation.aligned_size,
    )


# -- residency ---------------------------------------------------------------------------


def _idle_committed(state: LayoutState, event: Event) -> None:
    if not state.committed or state.writer is not None:
        raise _refuse(state, event, "not a committed layout")


def _residency_set(state: LayoutState, event: ResidencySet) -> LayoutState:
    _idle_committed(state, event)
    if not state.resident:
        raise _refuse(state, event, "layout is not on the GPU")
    residency = _residency(state, event, event.residency)
    if residency is Residency.SYSTEM and not _host_copies_complete(state):
        raise _refuse(state, event, "residency system without a host copy of every allocation")
    return replace(state, residency=residency)


def _layout_evicted(state: LayoutState, event: LayoutEvicted) -> LayoutState:
    _idle_committed(state, event)
    if state.readers or state.restorer is not None or not state.resident:
        raise _refuse(state, event, "layout is in use or not on the GPU")
    if state.residency is Residency.DEVICE:
        raise _refuse(state, event, "layout is pinned to the device")
    if state.residency is Residency.UNPINNED:
        # No host copy: its next user reloads it from wherever it came from.
        return state.fresh(evictions=state.evictions + 1)
    return replace(state, tier=Tier.HOST, evictions=state.evictions + 1)


def _restore_claimed(state: LayoutState, event: RestoreClaimed) -> LayoutState:
    _idle_committed(state, event)
    if state.tier is not Tier.HOST or state.restorer is not None:
        raise _refuse(state, event, "not an evicted layout awaiting a restorer")
    return replace(state, restorer=event.conn)


def _restore_loading(state: LayoutState, event: RestoreLoading) -> LayoutState:
    _require_restorer(state, event)
    if state.tier is not Tier.HOST:
        raise _refuse(state, event, "GPU memory exists already")
    return replace(state, tier=Tier.RESTORING)


def _restore_finished(state: LayoutState, event: RestoreFinished) -> LayoutState:
    _require_restorer(state, event)
    if state.tier is not Tier.RESTORING:
        raise _refuse(state, event, "no GPU memory was filled")
    return replace(
        state,
        tier=Tier.GPU,
        restorer=None,
        readers=state.readers | {event.conn},
        restores=state.restores + 1,
    )


def _restore_aborted(state: LayoutState, event: RestoreAborted) -> LayoutState:
    _require_restorer(state, event)
    return replace(state, tier=Tier.HOST, restorer=None)


# -- observations ---------------------------------------------------------------------------


def _holder_observation(state: LayoutState, event: Event) -> LayoutState:
    if not state.holds_lock(event.conn):
        raise _refuse(state, event, "connection holds no lock")
    return state


def _lockless_observation(state: LayoutState, event: Event) -> LayoutState:
    if state.holds_lock(event.conn):
        raise _refuse(state, event, "connection holds a lock")
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
    AllocationOomWait: _holder_observation,
    AllocationOomGaveUp: _holder_observation,
    LockTimeout: _lockless_observation,
}


def fold_layout(state: LayoutState, event: Event) -> LayoutState:
    if event.layout != state.name:
        raise InvariantViolation(f"{event.KIND} for layout {event.layout!r} folded into {state.name!r}")
    try:
        step = LAYOUT_STEPS[type(event)]
    except KeyError:
        raise InvariantViolation(f"no layout fold step for {type(event).__name__}") from None
    return step(state, event)
