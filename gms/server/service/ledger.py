"""The one write path: every change of state, grants included, is recorded here.

``Ledger.record(events)`` appends the events to the log (all or nothing; the
log folds, and the fold's rules refuse what is not legal), hands the memory
each event released to its tier (the release runs on the tier's lane, the
table forgets it at once), grants whatever the changed layouts can grant now
(each grant recorded the same way: a writer's grant clears a committed
layout and releases its memory too), and, if any memory was released or a
layout may have become evictable (a lock let go, a residency changed, a
queue emptied), wakes every session waiting for memory.  Nothing else
appends to the log.  Every stored batch goes to the server's durability (its
keeper, or nothing: ``durability``), flushed at the end of each write.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

from ...fsm import (
    InvariantViolation,
    MemoryTier,
    NodeState,
    Rejection,
    StateViolation,
    batch_effects,
)
from ...fsm.events import Event
from ...store import EventLog, Folded
from ..tiers.table import TierStore
from .durability import IN_MEMORY, Durability
from .lock_queues import LockQueues

T = TypeVar("T")


def _keys(events: list[Event]) -> list[tuple[str, str | None]]:
    """What two decisions must share to be the same: each event's kind and allocation."""
    return [(type(e).__name__, getattr(e, "allocation_id", None)) for e in events]


class Ledger:
    def __init__(
        self,
        log: EventLog,
        tiers: dict[MemoryTier, TierStore],
        queues: LockQueues,
        *,
        on_event: Callable[[Event], None],
        on_released: Callable[[], None],
        durability: Durability = IN_MEMORY,
    ) -> None:
        """``tiers``: every tier (``gms.server.tiers.table.tier_table``), each told what a
        batch releases; ``on_event``: told of every stored event, with whoever
        :meth:`observe` adds."""
        self.log = log
        self.durability = durability
        self.tiers = tiers
        self.queues = queues
        self._observers = [on_event]
        self._on_released = on_released

    def observe(self, observer: Callable[[Event], None]) -> None:
        """Tell ``observer`` of every event stored from now on, after those told before it
        (the saver: a commit that asks for a snapshot wakes it)."""
        self._observers.append(observer)

    @property
    def state(self) -> NodeState:
        return self.log.state

    def record(self, events: Iterable[Event] | Folded, *, by_server: bool = False) -> bool:
        """Append, release, grant, wake; returns whether memory waiters were woken.

        ``events`` may come folded already (:meth:`fold`, before an ``await``):
        stored as folded while nothing was appended since, folded again if
        something was.  A refused event raises its Rejection (nothing was
        appended) when a client's request proposed it; ``by_server`` events
        (evictions, grants) the server proposed itself, so their refusal is a
        broken invariant."""
        try:
            folded = self._append(events, by_server)
            room = self._released(folded)
            events = folded.events
            touched = (events[0].layout,) if len(events) == 1 else dict.fromkeys(event.layout for event in events)
            for layout in touched:  # in order: one layout, or a few
                if layout and self.queues.waiting_on(layout):
                    room = self._grant(layout) or room
        finally:
            self.durability.flush(soon=True)
        if room:
            self._on_released()
        return room

    def fold(self, events: list[Event]) -> Folded:
        """What recording ``events`` now would do, recorded nowhere (a refusal
        raises): for a decision that spans an ``await``, which records it after,
        or one that builds a batch (:meth:`fold_more`)."""
        return self.log.fold(events)

    async def make_then_record(
        self,
        decide: Callable[[], list[Event]],
        make: Callable[[], Awaitable[T]],
        undo: Callable[[T], None],
        *,
        changed: str,
        keep: Callable[[T], None] = lambda made: None,
    ) -> list[Event]:
        """Decide, make what the decision needs, decide again, then record it or undo.

        ``decide()`` gives the events on the state as it is; they are folded
        before anything is made (a refusal costs nothing).  ``make()`` awaits
        what they need (memory, pinned or copied into): the world may change
        meanwhile, so they are decided again on the state as it is then and,
        if they are the same events on the same allocations, ``keep(made)``
        takes what was made into the tables and they are recorded.  Anything
        else (a refusal now; other events: StateViolation ``changed``; an
        error in ``keep``) undoes what was made: ``undo(made)`` (a ``make``
        that fails gives back what it made itself)."""
        first = decide()
        self.fold(first)
        made = await make()
        try:
            again = decide()
            if _keys(again) != _keys(first):
                raise StateViolation(changed)
            keep(made)
            self.record(again)
        except BaseException:
            undo(made)
            raise
        return again

    def fold_more(self, folded: Folded, events: list[Event]) -> Folded:
        """``folded`` and then ``events``, which the server proposes (a grant, say):
        their refusal is a broken invariant."""
        try:
            return self.log.fold(events, after=folded)
        except Rejection as refused:
            raise InvariantViolation(f"the server proposed an illegal event: {refused.message}") from refused

    def grant(self, layout: str, *, waiter_left: bool = False) -> None:
        """The layout's queue changed: grant what it can grant now.  A waiter that
        left (``waiter_left``) may unblock readers behind it, and may leave a
        layout nobody waits for, which may then be evicted: room."""
        try:
            room = self.queues.waiting_on(layout) and self._grant(layout)
        finally:
            self.durability.flush(soon=True)
        if room or (waiter_left and layout not in self.queues.busy()):
            self._on_released()

    def _grant(self, layout: str) -> bool:
        """Record the grants ``layout`` can make now; True if they may have made room."""
        room = False
        grants, away = self.queues.take_grants(self.state.layout(layout))
        for grant, waiter in grants:
            room = self._released(self._append([grant.event], by_server=True)) or room
            waiter.on_grant(grant)
        for waiter in away:
            waiter.turned_away()  # its task answers and records why
        return room

    def _append(self, events: Iterable[Event] | Folded, by_server: bool) -> Folded:
        log = self.log
        try:
            if not isinstance(events, Folded):
                folded = log.fold(events)
            elif events.base is log.state:
                folded = events
            else:  # something was recorded since it was folded: fold it again, on what is
                folded = log.fold(events.events)
        except Rejection as refused:
            if by_server:
                raise InvariantViolation(f"the server proposed an illegal event: {refused.message}") from refused
            raise
        entries = log.store(folded)
        self.durability.logged(entries)
        for entry in entries:
            for observer in self._observers:
                observer(entry.event)
        return folded

    def _released(self, folded: Folded) -> bool:
        """Hand what the stored batch released to each tier; True if it released
        memory or may have made an idle layout evictable (room)."""
        released, room = batch_effects(folded.befores, folded.events)
        for tier, allocation_ids in released.items():
            self.tiers[tier].release(allocation_ids)
        return room
