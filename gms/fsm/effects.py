"""Which server-owned memory an event releases, derived from the state before it.

The shell folds an event, then hands what this returns to the memory adapter.
Allocation *creation* is the one effect that precedes its event: the shell
creates memory first and records ``ALLOCATION_CREATED`` once it exists.
"""

from __future__ import annotations

from .events import AllocationFreed, Event, RwAbort, RwConnect
from .state import Allocation, State


def released_allocations(before: State, event: Event) -> tuple[Allocation, ...]:
    if isinstance(event, RwConnect | RwAbort):
        return tuple(before.allocations.values())
    if isinstance(event, AllocationFreed):
        return (before.allocations[event.allocation_id],)
    return ()
