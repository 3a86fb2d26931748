"""The folded state: who holds the lock, and the one flat layout store.

States are immutable values.  The two tables are persistent maps
(:class:`immutables.Map`), so a fold step shares everything it does not
change and costs O(log n) instead of a copy of the layout.
"""

from __future__ import annotations

import enum

import attrs
from immutables import Map


class LockState(enum.Enum):
    """Derived from the state, never stored (the seed's four states)."""

    EMPTY = "EMPTY"
    RW = "RW"
    COMMITTED = "COMMITTED"
    RO = "RO"


@attrs.frozen
class Allocation:
    allocation_id: str
    size: int
    aligned_size: int
    tag: str
    layout_slot: int


@attrs.frozen
class MetadataEntry:
    key: str
    allocation_id: str
    offset_bytes: int
    value: bytes


@attrs.frozen
class State:
    writer: int | None = None
    readers: frozenset[int] = frozenset()
    committed: bool = False
    allocations: Map[str, Allocation] = Map()
    metadata: Map[str, MetadataEntry] = Map()
    layout_hash: str | None = None
    next_layout_slot: int = 0

    @property
    def lock_state(self) -> LockState:
        return lock_state(self)

    @property
    def total_bytes(self) -> int:
        return sum(a.aligned_size for a in self.allocations.values())

    def holds_lock(self, conn: int) -> bool:
        return conn == self.writer or conn in self.readers


EMPTY_STATE = State()


def lock_state(state: State) -> LockState:
    if state.writer is not None:
        return LockState.RW
    if state.readers:
        return LockState.RO
    if state.committed:
        return LockState.COMMITTED
    return LockState.EMPTY
