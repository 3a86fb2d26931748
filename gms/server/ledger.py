"""The one write path: every change of state, grants included, is recorded here.

``Ledger.record(events)`` appends the events to the log (all or nothing; the
log folds, and the fold's rules refuse what is not legal), hands the memory
each event released to its tier (the release runs on the tier's lane, the
table forgets it at once), grants whatever the changed layouts can grant now
(each grant recorded the same way: a writer's grant clears a committed
layout and releases its memory too), and, if any memory was released or a
layout may have become evictable (a lock let go, a residency changed, a
queue emptied), wakes every session waiting for memory.  Nothing else
appends to the log.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..fsm import Grant, InvariantViolation, MemoryTier, NodeState, Rejection, may_make_room, released_memory
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
        """Append, release, grant, wake; returns whether memory waiters were woken.

        A refused event raises its Rejection (nothing was appended) when a
        client's request proposed it; ``by_server`` events (evictions, grants)
        the server proposed itself, so their refusal is a broken invariant."""
        events = events if isinstance(events, list) else list(events)
        room = self._append(events, by_server)
        touched: list[str] = []  # in order: a batch names one layout, or a few
        for event in events:
            if event.layout and event.layout not in touched:
                touched.append(event.layout)
        for layout in touched:
            room = self._grant(layout) or room
        if room:
            self._on_released()
        return room

    def grant(self, layout: str, *, waiter_left: bool = False) -> None:
        """The layout's queue changed: grant what it can grant now.  A waiter that
        left (``waiter_left``) may unblock readers behind it, and may leave a
        layout nobody waits for, which may then be evicted: room."""
        room = self._grant(layout)
        if room or (waiter_left and layout not in self.queues.busy()):
            self._on_released()

    def record_grant(self, grant: Grant) -> None:
        """A grant decided without a queue (nobody waited): recorded like any other."""
        if self._append([grant.event], by_server=True):
            self._on_released()

    def _grant(self, layout: str) -> bool:
        """Record the grants ``layout`` can make now; True if they may have made room."""
        if not self.queues.waiting_on(layout):
            return False
        room = False
        for grant, waiter in self.queues.take_grants(self.state.layout(layout)):
            room = self._append([grant.event], by_server=True) or room
            waiter.on_grant(grant)
        return room

    def _append(self, events: list[Event], by_server: bool) -> bool:
        releases: dict[MemoryTier, list[str]] = {}
        room = False

        def observe(before: NodeState, event: Event) -> None:
            nonlocal room
            for release in released_memory(before, event):
                releases.setdefault(release.tier, []).append(release.allocation_id)
            room = room or may_make_room(event)

        try:
            entries = self.log.extend(events, observe)
        except Rejection as refused:
            if by_server:
                raise InvariantViolation(f"the server proposed an illegal event: {refused.message}") from refused
            raise
        for entry in entries:
            self._on_event(entry.event)
        for tier, allocation_ids in releases.items():
            self.tiers[tier].release(allocation_ids)
        return bool(releases) or room
