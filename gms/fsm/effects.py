"""What an event does to memory: what it releases, and whether it may make room.

Which server-owned memory an event releases is derived from the state before it.

The shell folds an event, then hands what this returns to the memory
adapters: ``gpu`` (the device) or ``host`` (the host tier).  Creation is the
one effect that precedes its event: the shell creates memory first and
records ``ALLOCATION_CREATED``, ``HOST_COPY_CREATED`` or ``RESTORE_LOADING``
once it exists.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs

from .events import (
    AllocationFreed,
    Event,
    LayoutEvicted,
    LayoutLost,
    RestoreAborted,
    RwAbort,
    RwConnect,
)
from .rules import kinds
from .state import NodeState, Residency, Tier


class MemoryTier(str, enum.Enum):
    GPU = "gpu"
    HOST = "host"


@attrs.frozen
class Release:
    tier: MemoryTier
    allocation_id: str
    aligned_size: int


_RELEASING = kinds("releases")  # the rules' rows say which events may release memory


def released_memory(before: NodeState, event: Event) -> list[Release]:
    return [Release(*release) for release in _releases(before, event)]


def _releases(before: NodeState, event: Event) -> list[tuple[MemoryTier, str, int]]:
    """(tier, allocation id, aligned size) of what ``event`` releases."""
    if type(event) not in _RELEASING or event.layout not in before.layouts:
        return []
    layout = before.layouts[event.layout]
    gpu = layout.tier is not Tier.HOST
    if isinstance(event, RwConnect | RwAbort):
        return _all(layout, gpu=gpu, host=True)
    if isinstance(event, AllocationFreed):
        allocation = layout.allocations[event.allocation_id]
        out = [(MemoryTier.GPU, allocation.allocation_id, allocation.aligned_size)]
        if allocation.allocation_id in layout.host_copies:
            out.append((MemoryTier.HOST, allocation.allocation_id, allocation.aligned_size))
        return out
    if isinstance(event, LayoutEvicted):
        return _all(layout, gpu=True, host=layout.residency is Residency.UNPINNED)
    if isinstance(event, LayoutLost):
        return _all(layout, gpu=gpu, host=True)
    if isinstance(event, RestoreAborted):
        return _all(layout, gpu=layout.tier is Tier.RESTORING, host=False)
    return []


def _all(layout, *, gpu: bool, host: bool) -> list[tuple[MemoryTier, str, int]]:
    out = []
    if gpu:
        out += [(MemoryTier.GPU, a.allocation_id, a.aligned_size) for a in layout.allocations.values()]
    if host:
        out += [(MemoryTier.HOST, i, size) for i, size in layout.host_copies.items()]
    return out


# Events after which an idle layout may have become evictable (a lock let go,
# a residency changed): room for a waiting allocation, though nothing was released.
_MAY_MAKE_ROOM = kinds("makes_room")


def may_make_room(event: Event) -> bool:
    """Should sessions waiting for memory look again after ``event``?  (Releases
    aside: every release does.)"""
    return type(event) in _MAY_MAKE_ROOM


def batch_effects(
    befores: Sequence[NodeState], events: Sequence[Event]
) -> tuple[dict[MemoryTier, list[str]], bool]:
    """What a batch folded on ``befores`` released, as allocation ids per tier
    (in order), and whether sessions waiting for memory should look again
    (a release, or :func:`may_make_room`)."""
    released: dict[MemoryTier, list[str]] = {}
    room = False
    for before, event in zip(befores, events):
        kind = type(event)
        if kind in _RELEASING:
            for tier, allocation_id, _ in _releases(before, event):
                released.setdefault(tier, []).append(allocation_id)
        if kind in _MAY_MAKE_ROOM:
            room = True
    return released, room or bool(released)
