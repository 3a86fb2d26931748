"""What an event does to memory: what it releases, and whether it may make room.

Which server-owned memory an event releases is its rule's ``releases`` column
(a function of ``gms.fsm.releases``), applied to the layout before it.

The shell folds an event, then hands what this returns to the memory
adapters: ``gpu`` (the device) or ``host`` (the host tier).  Creation is the
one effect that precedes its event: the shell creates memory first and
records ``ALLOCATION_CREATED``, ``HOST_COPY_CREATED`` or ``RESTORE_LOADING``
once it exists.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from .events import Event
from .releases import MemoryTier
from .rules import RULES, kinds
from .state import NodeState


@attrs.frozen
class Release:
    tier: MemoryTier
    allocation_id: str
    aligned_size: int


def released_memory(before: NodeState, event: Event) -> list[Release]:
    return [Release(*release) for release in _releases(before, event)]


def _releases(before: NodeState, event: Event) -> list[tuple[MemoryTier, str, int]]:
    """(tier, allocation id, aligned size) of what ``event`` releases: its rule's
    ``releases`` column (gms.fsm.releases), on the layout before it."""
    rule = RULES.get(type(event))
    if rule is None or rule.releases is None or event.layout not in before.layouts:
        return []
    return rule.releases(before.layouts[event.layout], event)


# Events after which an idle layout may have become evictable (a lock let go,
# a residency changed): room for a waiting allocation, though nothing was released.
_MAY_MAKE_ROOM = kinds("makes_room")
_RELEASING = kinds("releases")


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
