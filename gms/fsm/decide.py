"""Layout decisions: (layout, connection, request) -> events to append, or a Rejection.

Every check the seed names for a request on one layout lives here; node-wide
checks (sessions, quotas, budgets, residency) live beside it in
``sessions``, ``accounting`` and ``residency``.  The shell validates nothing
itself.  Decisions never change state: the shell appends the events they
return and the fold applies them.
"""

from __future__ import annotations

from collections.abc import Iterable

from .errors import (
    HostCopyMissing,
    InvalidArgument,
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
    HostCopyCreated,
    MetadataDeleted,
    MetadataPut,
    RwCommit,
)
from .folding import fold_layout
from .layout_hash import compute_layout_hash
from .limits import Limits
from .state import Allocation, LayoutState, Residency


def require_lock(state: LayoutState, conn: int, action: str) -> None:
    if not state.holds_lock(conn):
        raise NotConnected(f"{action} needs a lock: send HandshakeRequest first")


def require_writer(state: LayoutState, conn: int, action: str) -> None:
    if state.writer == conn:
        return
    require_lock(state, conn, action)
    raise ModeViolation(f"{action} needs the RW lock; this connection holds RO")


def _check_text(name: str, text: str, max_bytes: int) -> None:
    if not text:
        raise InvalidArgument(f"{name} must not be empty")
    if len(text.encode()) > max_bytes:
        raise LimitExceeded(f"{name} is longer than {max_bytes} bytes")


def lookup_allocation(state: LayoutState, allocation_id: str) -> Allocation:
    allocation = state.allocations.get(allocation_id)
    if allocation is None:
        raise UnknownAllocation(f"no allocation {allocation_id!r} in the current layout")
    return allocation


def validate_allocate(state: LayoutState, conn: int, size: int, tag: str, limits: Limits) -> None:
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
    state: LayoutState,
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
        AllocationCreated(
            conn, allocation_id, size, aligned_size, tag, state.next_layout_slot, layout=state.name
        )
    ]


def decide_free(state: LayoutState, conn: int, allocation_id: str) -> list[Event]:
    """Free cascades: metadata pointing into the allocation goes first."""
    require_writer(state, conn, "free")
    lookup_allocation(state, allocation_id)
    events: list[Event] = [
        MetadataDeleted(conn, entry.key, layout=state.name)
        for entry in state.metadata.values()
        if entry.allocation_id == allocation_id
    ]
    events.append(AllocationFreed(conn, allocation_id, layout=state.name))
    return events


def decide_metadata_put(
    state: LayoutState,
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
    return [MetadataPut(conn, key, allocation_id, offset_bytes, value, layout=state.name)]


def decide_metadata_put_many(
    state: LayoutState,
    conn: int,
    entries: Iterable[tuple[str, str, int, bytes]],
    limits: Limits,
) -> list[Event]:
    """All or nothing: each put is decided on the state the earlier ones leave."""
    events: list[Event] = []
    for key, allocation_id, offset_bytes, value in entries:
        (put,) = decide_metadata_put(state, conn, key, allocation_id, offset_bytes, value, limits)
        state = fold_layout(state, put)
        events.append(put)
    return events


def decide_metadata_delete(state: LayoutState, conn: int, key: str) -> list[Event]:
    """Deleting a missing key is not an error: nothing to append."""
    require_writer(state, conn, "metadata_delete")
    return [MetadataDeleted(conn, key, layout=state.name)] if key in state.metadata else []


def decide_commit(
    state: LayoutState, conn: int, residency: Residency | str = Residency.DEVICE
) -> list[Event]:
    """Publish.  Dangling metadata cannot be produced by valid events, so
    finding one is a broken invariant (the server stops), not a rejection."""
    require_writer(state, conn, "commit")
    residency = parse_residency(residency)
    if residency is Residency.SYSTEM:
        require_host_copies(state)
    layout_hash = compute_layout_hash(state.allocations.values(), state.metadata.values())
    return [RwCommit(conn, layout_hash, residency.value, layout=state.name)]


def parse_residency(value: Residency | str) -> Residency:
    try:
        return Residency(value)
    except ValueError:
        choices = ", ".join(r.value for r in Residency)
        raise InvalidArgument(f"unknown residency {value!r}; choose one of {choices}") from None


def require_host_copies(state: LayoutState) -> None:
    missing = [a for a in state.allocations if a not in state.host_copies]
    if missing:
        raise HostCopyMissing(
            f"residency system needs a host copy of every allocation; {len(missing)} of "
            f"{len(state.allocations)} have none (the client library makes them at commit)"
        )


def decide_host_copy(state: LayoutState, conn: int, allocation_id: str) -> list[Event]:
    """A host copy for one of the writer's allocations; asking twice is not an error."""
    require_writer(state, conn, "host copy")
    lookup_allocation(state, allocation_id)
    if allocation_id in state.host_copies:
        return []
    return [HostCopyCreated(conn, allocation_id, layout=state.name)]
