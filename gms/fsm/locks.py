"""Lock predicates and the grant schedule the shell's waiting logic runs.

The shell keeps handshakes that cannot be granted yet in arrival order, one
queue per layout, and whenever a layout's state may have changed asks
:func:`schedule` which of its waiters to grant now.  Writers have priority: no
reader is admitted while an ``RW`` request waits, so a stream of readers
cannot starve a writer.  A reader that arrives at an evicted layout is granted
the restore instead (``RESTORE_CLAIMED``): it brings the layout back from the
host tier or the disk while the readers behind it wait.  A reader of a layout
that is empty because its last snapshot was not served is not kept waiting
(:func:`turned_away`): nothing will come from disk, and no writer is there.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs

from .events import Event, RestoreClaimed, RoConnect, RwConnect
from .rules import fold_layout, lock_event_allowed
from .state import LayoutState


class RequestedLockType(str, enum.Enum):
    RW = "RW"
    RO = "RO"
    RW_OR_RO = "RW_OR_RO"


class GrantedLockType(str, enum.Enum):
    RW = "RW"
    RO = "RO"


def can_grant_rw(state: LayoutState) -> bool:
    return lock_event_allowed(state, RwConnect)


def can_grant_ro(state: LayoutState, writers_waiting: int = 0) -> bool:
    """A read lock now, or the restore that leads to one; never past a waiting writer."""
    return writers_waiting == 0 and (
        lock_event_allowed(state, RoConnect) or lock_event_allowed(state, RestoreClaimed)
    )


def resolve_rw_or_ro(state: LayoutState, writers_waiting: int = 0) -> GrantedLockType | None:
    """The seed's auto mode: RW on an empty store, RO on a committed one.

    ``None`` means wait: a writer holds the lock (it will commit, giving RO, or
    abort, giving RW), a restore is under way, or a writer is queued ahead.
    """
    if state.writer is not None:
        return None
    if not state.committed:
        return GrantedLockType.RW
    return GrantedLockType.RO if can_grant_ro(state, writers_waiting) else None


def grant_for(
    state: LayoutState, requested: RequestedLockType, writers_waiting: int = 0
) -> GrantedLockType | None:
    if requested is RequestedLockType.RW:
        return GrantedLockType.RW if can_grant_rw(state) else None
    if requested is RequestedLockType.RO:
        return GrantedLockType.RO if can_grant_ro(state, writers_waiting) else None
    return resolve_rw_or_ro(state, writers_waiting)


def lock_event(state: LayoutState, conn: int, granted: GrantedLockType) -> Event:
    if granted is GrantedLockType.RW:
        return RwConnect(conn, layout=state.name)
    if state.evicted:
        return RestoreClaimed(conn, layout=state.name)
    return RoConnect(conn, layout=state.name)


@attrs.frozen
class Grant:
    conn: int
    granted: GrantedLockType
    event: Event

    @property
    def restore(self) -> bool:
        return isinstance(self.event, RestoreClaimed)


def schedule(state: LayoutState, waiting: Sequence[tuple[int, RequestedLockType]]) -> list[Grant]:
    """Which of a layout's waiting handshakes (in arrival order) to grant now, in order.

    Each grant's event is folded before the next waiter is considered, so the
    result is exactly what appending the events one by one would allow (the
    predicates above are the table's own, so every grant is legal).
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
        event = lock_event(state, conn, granted)
        state = fold_layout(state, event)
        grants.append(Grant(conn, granted, event))
        if granted is GrantedLockType.RW:
            break
    return grants


def turned_away(state: LayoutState, waiting: Sequence[tuple[int, RequestedLockType]]) -> list[int]:
    """Which of a layout's waiting readers to answer now, ungranted: the layout is
    empty because its last snapshot was not served (``unserved``: set aside, or
    refused) and no writer holds it or waits to build it, so nothing would ever
    grant them.  A writer (RW, or RW_OR_RO, which builds an empty layout) keeps
    them waiting for its commit."""
    if not state.unserved or state.writer is not None:
        return []
    if any(requested is not RequestedLockType.RO for _, requested in waiting):
        return []
    return [conn for conn, _ in waiting]
