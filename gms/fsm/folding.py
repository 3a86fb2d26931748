"""``fold(state, event) -> state``: the one way the state changes.

Total and deterministic: every event type has a step, and a step either
returns the next state or raises :class:`InvariantViolation` when the state
cannot accept the event.  Nothing is ever silently ignored: the shell only
folds events its decisions produced, so a refusal here is a bug in the shell.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from immutables import Map

from .errors import InvariantViolation
from .events import (
    AllocationCreated,
    AllocationFreed,
    AllocationOomGaveUp,
    AllocationOomWait,
    ConnectionDropped,
    Event,
    LockTimeout,
    MetadataDeleted,
    MetadataPut,
    RoConnect,
    RoDisconnect,
    RwAbort,
    RwCommit,
    RwConnect,
)
from .layout_hash import compute_layout_hash
from .state import EMPTY_STATE, Allocation, MetadataEntry, State


def _refuse(state: State, event: Event, why: str) -> InvariantViolation:
    return InvariantViolation(
        f"cannot fold {event.KIND} from conn {event.conn} ({why}); "
        f"state {state.lock_state.value}, writer={state.writer}, readers={sorted(state.readers)}"
    )


def _require_writer(state: State, event: Event) -> None:
    if state.writer != event.conn:
        raise _refuse(state, event, "connection is not the writer")


def _rw_connect(state: State, event: RwConnect) -> State:
    if state.writer is not None or state.readers:
        raise _refuse(state, event, "lock is held")
    return State(writer=event.conn)


def _rw_commit(state: State, event: RwCommit) -> State:
    _require_writer(state, event)
    expected = compute_layout_hash(state.allocations.values(), state.metadata.values())
    if event.layout_hash != expected:
        raise _refuse(state, event, f"hash {event.layout_hash} != layout's {expected}")
    return State(
        committed=True,
        allocations=state.allocations,
        metadata=state.metadata,
        layout_hash=event.layout_hash,
        next_layout_slot=state.next_layout_slot,
    )


def _rw_abort(state: State, event: RwAbort) -> State:
    _require_writer(state, event)
    return EMPTY_STATE


def _ro_connect(state: State, event: RoConnect) -> State:
    if state.writer is not None or not state.committed:
        raise _refuse(state, event, "no committed layout to read")
    if event.conn in state.readers:
        raise _refuse(state, event, "already a reader")
    return State(
        readers=state.readers | {event.conn},
        committed=True,
        allocations=state.allocations,
        metadata=state.metadata,
        layout_hash=state.layout_hash,
        next_layout_slot=state.next_layout_slot,
    )


def _ro_disconnect(state: State, event: RoDisconnect) -> State:
    if event.conn not in state.readers:
        raise _refuse(state, event, "not a reader")
    return State(
        readers=state.readers - {event.conn},
        committed=True,
        allocations=state.allocations,
        metadata=state.metadata,
        layout_hash=state.layout_hash,
        next_layout_slot=state.next_layout_slot,
    )


def _layout_changed(
    state: State,
    *,
    allocations: Map | None = None,
    metadata: Map | None = None,
    next_layout_slot: int | None = None,
) -> State:
    # Only the writer changes the layout, so readers are empty, nothing is
    # committed and there is no hash: the rest of the state is implied.
    return State(
        writer=state.writer,
        allocations=state.allocations if allocations is None else allocations,
        metadata=state.metadata if metadata is None else metadata,
        next_layout_slot=state.next_layout_slot if next_layout_slot is None else next_layout_slot,
    )


def _allocation_created(state: State, event: AllocationCreated) -> State:
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
    return _layout_changed(
        state,
        allocations=state.allocations.set(event.allocation_id, allocation),
        next_layout_slot=event.layout_slot + 1,
    )


def _allocation_freed(state: State, event: AllocationFreed) -> State:
    _require_writer(state, event)
    if event.allocation_id not in state.allocations:
        raise _refuse(state, event, f"unknown allocation {event.allocation_id!r}")
    for entry in state.metadata.values():
        if entry.allocation_id == event.allocation_id:
            raise _refuse(state, event, f"metadata {entry.key!r} still points into it")
    return _layout_changed(state, allocations=state.allocations.delete(event.allocation_id))


def _metadata_put(state: State, event: MetadataPut) -> State:
    _require_writer(state, event)
    allocation = state.allocations.get(event.allocation_id)
    if allocation is None:
        raise _refuse(state, event, f"unknown allocation {event.allocation_id!r}")
    if not 0 <= event.offset_bytes < allocation.size:
        raise _refuse(state, event, f"offset {event.offset_bytes} outside {allocation.size}")
    entry = MetadataEntry(event.key, event.allocation_id, event.offset_bytes, event.value)
    return _layout_changed(state, metadata=state.metadata.set(event.key, entry))


def _metadata_deleted(state: State, event: MetadataDeleted) -> State:
    _require_writer(state, event)
    if event.key not in state.metadata:
        raise _refuse(state, event, f"unknown key {event.key!r}")
    return _layout_changed(state, metadata=state.metadata.delete(event.key))


def _writer_observation(state: State, event: Event) -> State:
    _require_writer(state, event)
    return state


def _lockless_observation(state: State, event: Event) -> State:
    if state.holds_lock(event.conn):
        raise _refuse(state, event, "connection holds a lock")
    return state


def _any_observation(state: State, event: Event) -> State:
    return state


_STEPS: dict[type[Event], Callable[[State, Event], State]] = {
    RwConnect: _rw_connect,
    RwCommit: _rw_commit,
    RwAbort: _rw_abort,
    RoConnect: _ro_connect,
    RoDisconnect: _ro_disconnect,
    AllocationCreated: _allocation_created,
    AllocationFreed: _allocation_freed,
    MetadataPut: _metadata_put,
    MetadataDeleted: _metadata_deleted,
    AllocationOomWait: _writer_observation,
    AllocationOomGaveUp: _writer_observation,
    LockTimeout: _lockless_observation,
    ConnectionDropped: _any_observation,
}


def fold(state: State, event: Event) -> State:
    try:
        step = _STEPS[type(event)]
    except KeyError:
        raise InvariantViolation(f"no fold step for {type(event).__name__}") from None
    return step(state, event)


def fold_all(events: Iterable[Event], state: State = EMPTY_STATE) -> State:
    for event in events:
        state = fold(state, event)
    return state
