"""The one write path: every change of state, grants included, is recorded here.

``Ledger.record(events)`` appends the events to the log (all or nothing; the
log folds, and the fold's rules refuse what is not legal), hands the memory
each event released to its tier (the release runs on the tier's lane, the
table forgets it at once), grants whatever the changed layouts can grant now
(each grant recorded the same way: a writer's grant clears a committed
layout and releases its memory too), and, if any memory was released, wakes
every session waiting for memory.  Nothing else appends to the log.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..fsm import InvariantViolation, MemoryTier, NodeState, Rejection, released_memory
from ..fsm.events import Event
from ..store import EventLog
from .lock_queues import LockQueues
from .memory import Memory


class Ledger:
    def __init__(
        self,
        log: EventLog,
        tiers: dict[MemoryTier, Memory],
        queues: LockQueues,
        *,
        on_event: Callable[[Event], None],
        on_released: Callable[[], None],
    ) -> None:
        self.log = log
        self.tiers = tiers
        self.queues = queues
        self._on_event = on_event
        self._on_released = on_released

    @property
    def state(self) -> NodeState:
        return self.log.state

    def record(self, events: Iterable[Event], *, by_server: bool = False) -> bool:
        """Append, release, grant, wake; returns whether memory was released.

        A refused event raises its Rejection (nothing was appended) when a
        client's request proposed it; ``by_server`` events (evictions, grants)
        the server proposed itself, so their refusal is a broken invariant."""
        events = list(events)
        released = self._append(events, by_server)
        touched = dict.fromkeys(event.layout for event in events if event.layout)
        for layout in touched:
            released = self._grant(layout) or released
        if released:
            self._on_released()
        return released

    def regrant(self, layout: str) -> None:
        """A waiter left the queue (a writer's leaving may unblock readers behind it)."""
        if self._grant(layout):
            self._on_released()

    def _grant(self, layout: str) -> bool:
        released = False
        for grant, waiter in self.queues.take_grants(self.state.layout(layout)):
            released = self._append([grant.event], by_server=True) or released
            waiter.on_grant(grant)
        return released

    def _append(self, events: list[Event], by_server: bool) -> bool:
        releases: dict[MemoryTier, list[str]] = {}

        def observe(before: NodeState, event: Event) -> None:
            for release in released_memory(before, event):
                releases.setdefault(release.tier, []).append(release.allocation_id)

        try:
            self.log.extend(events, observe)
        except Rejection as refused:
            if by_server:
                raise InvariantViolation(f"the server proposed an illegal event: {refused.message}") from refused
            raise
        for event in events:
            self._on_event(event)
        for tier, allocation_ids in releases.items():
            self.tiers[tier].release(allocation_ids)
        return bool(releases)
