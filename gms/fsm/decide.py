"""Decisions: (state, connection, request) -> events to append, or a Rejection.

Every check the seed names for a request lives here; the shell validates
nothing itself.  Decisions never change state: the shell appends the events
they return and the fold applies them.
"""

from __future__ import annotations

from collections.abc import Iterable

from .errors import (
    InvalidArgument,
    InvariantViolation,
    LimitExceeded,
    ModeViolation,
    NotConnected,
    OffsetOutOfBounds,
    UnknownAllocation,
)
from .events import (
    AllocationCreated,
    AllocationFreed,
    Event,
    MetadataDeleted,
    MetadataPut,
    RoDisconnect,
    RwAbort,
    RwCommit,
)
from .folding import fold
from .layout_hash import compute_layout_hash
from .limits import Limits
from .state import Allocation, State


def require_lock(state: State, conn: int, action: str) -> None:
    if not state.holds_lock(conn):
        raise NotConnected(f"{action} needs a lock: send HandshakeRequest first")


def require_writer(state: State, conn: int, action: str) -> None:
    if state.writer == conn:
        return
    if conn in state.readers:
        raise ModeViolation(f"{action} needs the RW lock; this connection holds RO")
    require_lock(state, conn, action)


def _check_text(name: str, text: str, max_bytes: int) -> None:
    if not text:
        raise InvalidArgument(f"{name} must not be empty")
    if len(text.encode()) > max_bytes:
        raise LimitExceeded(f"{name} is longer than {max_bytes} bytes")


def lookup_allocation(state: State, allocation_id: str) -> Allocation:
    allocation = state.allocations.get(allocation_id)
    if allocation is None:
        raise UnknownAllocation(f"no allocation {allocation_id!r} in the current layout")
    return allocation


def validate_allocate(state: State, conn: int, size: int, tag: str, limits: Limits) -> None:
    """Checked before the shell creates memory, so refusals cost nothing."""
    require_writer(state, conn, "allocate")
    if size <= 0:
        raise InvalidArgument(f"allocation size must be positive, got {size}")
    if limits.max_allocation_bytes is not None and size > limits.max_allocation_bytes:
        raise LimitExceeded(
            f"allocation of {size} bytes exceeds the {limits.max_allocation_bytes}-byte limit"
        )
    _check_text("tag", tag, limits.max_tag_bytes)
    if len(state.allocations) >= limits.max_allocations:
        raise LimitExceeded(f"layout already holds {limits.max_allocations} allocations")


def decide_allocate(
    state: State,
    conn: int,
    allocation_id: str,
    size: int,
    aligned_size: int,
    tag: str,
    limits: Limits,
) -> list[Event]:
    """Record memory the shell has created; the slot is the next free one."""
    validate_allocate(state, conn, size, tag, limits)
    return [
        AllocationCreated(conn, allocation_id, size, aligned_size, tag, state.next_layout_slot)
    ]


def decide_free(state: State, conn: int, allocation_id: str) -> list[Event]:
    """Free cascades: metadata pointing into the allocation goes first."""
    require_writer(state, conn, "free")
    lookup_allocation(state, allocation_id)
    events: list[Event] = [
        MetadataDeleted(conn, entry.key)
        for entry in state.metadata.values()
        if entry.allocation_id == allocation_id
    ]
    events.append(AllocationFreed(conn, allocation_id))
    return events


def decide_metadata_put(
    state: State,
    conn: int,
    key: str,
    allocation_id: str,
    offset_bytes: int,
    value: bytes,
    limits: Limits,
) -> list[Event]:
    require_writer(state, conn, "metadata_put")
    _check_text("metadata key", key, limits.max_key_bytes)
    if len(value) > limits.max_metadata_value_bytes:
        raise LimitExceeded(
            f"metadata value of {len(value)} bytes exceeds {limits.max_metadata_value_bytes}"
        )
    allocation = lookup_allocation(state, allocation_id)
    if not 0 <= offset_bytes < allocation.size:
        raise OffsetOutOfBounds(
            f"offset {offset_bytes} is outside allocation {allocation_id!r} "
            f"of {allocation.size} bytes"
        )
    if key not in state.metadata and len(state.metadata) >= limits.max_metadata_keys:
        raise LimitExceeded(f"layout already holds {limits.max_metadata_keys} metadata keys")
    return [MetadataPut(conn, key, allocation_id, offset_bytes, value)]


def decide_metadata_put_many(
    state: State,
    conn: int,
    entries: Iterable[tuple[str, str, int, bytes]],
    limits: Limits,
) -> list[Event]:
    """All or nothing: each put is decided on the state the earlier ones leave."""
    events: list[Event] = []
    for key, allocation_id, offset_bytes, value in entries:
        (put,) = decide_metadata_put(state, conn, key, allocation_id, offset_bytes, value, limits)
        state = fold(state, put)
        events.append(put)
    return events


def decide_metadata_delete(state: State, conn: int, key: str) -> list[Event]:
    """Deleting a missing key is not an error: nothing to append."""
    require_writer(state, conn, "metadata_delete")
    return [MetadataDeleted(conn, key)] if key in state.metadata else []


def decide_commit(state: State, conn: int) -> list[Event]:
    """Publish.  Dangling metadata cannot be produced by valid events, so
    finding one is a broken invariant (the server stops), not a rejection."""
    require_writer(state, conn, "commit")
    layout_hash = compute_layout_hash(state.allocations.values(), state.metadata.values())
    return [RwCommit(conn, layout_hash)]


def decide_disconnect(state: State, conn: int) -> list[Event]:
    """A closed or dropped connection releases whatever lock it holds."""
    if state.writer == conn:
        return [RwAbort(conn)]
    if conn in state.readers:
        if not state.committed:
            raise InvariantViolation(f"reader {conn} on an uncommitted layout")
        return [RoDisconnect(conn)]
    return []
