"""Lock predicates and the grant schedule the shell's waiting logic runs.

The shell keeps handshakes that cannot be granted yet in arrival order and,
whenever the state may have changed, asks :func:`schedule` which of them to
grant now.  Writers have priority: no reader is admitted while an ``RW``
request waits, so a stream of readers cannot starve a writer.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs

from .events import Event, RoConnect, RwConnect
from .folding import fold
from .state import State


class RequestedLockType(str, enum.Enum):
    RW = "RW"
    RO = "RO"
    RW_OR_RO = "RW_OR_RO"


class GrantedLockType(str, enum.Enum):
    RW = "RW"
    RO = "RO"


def can_grant_rw(state: State) -> bool:
    return state.writer is None and not state.readers


def can_grant_ro(state: State, writers_waiting: int = 0) -> bool:
    return state.writer is None and state.committed and writers_waiting == 0


def resolve_rw_or_ro(state: State, writers_waiting: int = 0) -> GrantedLockType | None:
    """The seed's auto mode: RW on an empty store, RO on a committed one.

    ``None`` means wait: a writer holds the lock (it will commit, giving RO, or
    abort, giving RW), or a writer is queued ahead of any reader.
    """
    if state.writer is not None:
        return None
    if not state.committed:
        return GrantedLockType.RW
    return GrantedLockType.RO if writers_waiting == 0 else None


def grant_for(
    state: State, requested: RequestedLockType, writers_waiting: int = 0
) -> GrantedLockType | None:
    if requested is RequestedLockType.RW:
        return GrantedLockType.RW if can_grant_rw(state) else None
    if requested is RequestedLockType.RO:
        return GrantedLockType.RO if can_grant_ro(state, writers_waiting) else None
    return resolve_rw_or_ro(state, writers_waiting)


def lock_event(conn: int, granted: GrantedLockType) -> Event:
    return RwConnect(conn) if granted is GrantedLockType.RW else RoConnect(conn)


@attrs.frozen
class Grant:
    conn: int
    granted: GrantedLockType
    event: Event


def schedule(state: State, waiting: Sequence[tuple[int, RequestedLockType]]) -> list[Grant]:
    """Which waiting handshakes (in arrival order) to grant now, in order.

    Each grant's event is folded before the next waiter is considered, so the
    result is exactly what appending the events one by one would allow.
    """
    writers_waiting = sum(1 for _, requested in waiting if requested is RequestedLockType.RW)
    grants: list[Grant] = []
    for conn, requested in waiting:
        if requested is RequestedLockType.RW:
            writers_waiting -= 1  # a writer never yields to itself
        granted = grant_for(state, requested, writers_waiting)
        if granted is None:
            if requested is RequestedLockType.RW:
                break  # nothing behind a blocked writer can be granted either
            continue
        event = lock_event(conn, granted)
        state = fold(state, event)
        grants.append(Grant(conn, granted, event))
        if granted is GrantedLockType.RW:
            break
    return grants
