"""Handshakes waiting for a lock: one queue per layout, in arrival order.

Who is granted, and in what order, is the pure core's decision
(:func:`gms.fsm.schedule`); this only keeps the queues and each waiter's way
back to its task.  The ledger asks :meth:`LockQueues.take_grants` whenever a
layout may have changed, and records the grants like any other event.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from ...fsm import Grant, LayoutState, RequestedLockType, schedule, turned_away

GrantCallback = Callable[[Grant], None]


@attrs.frozen
class Waiter:
    """A queued handshake: what it asked for, how to wake its task, and whether
    its client is still there (the shell asks the kernel; a dead client is
    never granted a lock, least of all one that clears a committed layout)."""

    requested: RequestedLockType
    on_grant: GrantCallback
    alive: Callable[[], bool] = lambda: True
    # How to answer it ungranted when nothing will grant it (gms.fsm.turned_away);
    # None: it waits whatever comes (the server's own sessions).
    turned_away: Callable[[], None] | None = None


class LockQueues:
    def __init__(self) -> None:
        self._queues: dict[str, dict[int, Waiter]] = {}
        self._view: dict[str, tuple[int, int]] = {}  # replaced, never mutated: read by the metrics thread

    def add(self, layout: str, conn: int, waiter: Waiter) -> None:
        self._queues.setdefault(layout, {})[conn] = waiter
        self._refresh(layout)

    def remove(self, layout: str, conn: int) -> bool:
        """Drop a waiter (timed out, hung up); True if it was queued."""
        queue = self._queues.get(layout)
        if queue is None or queue.pop(conn, None) is None:
            return False
        if not queue:
            del self._queues[layout]
        self._refresh(layout)
        return True

    def take_grants(self, layout: LayoutState) -> tuple[list[tuple[Grant, Waiter]], list[Waiter]]:
        """The waiters ``layout`` can take now, in order, and those nothing will ever
        grant (answered ungranted), all removed from the queue."""
        queue = self._queues.get(layout.name)
        if not queue:
            return [], []
        # A client that died while queued may not have been noticed by its task
        # yet (its hang-up is read after this release, or hides behind a
        # request it pipelined): the kernel knows, so ask before granting.
        # Its task sees the hang-up and unwinds the session.
        for conn in [conn for conn, waiter in queue.items() if not waiter.alive()]:
            del queue[conn]
        waiting = [(conn, waiter.requested) for conn, waiter in queue.items()]
        taken = [(grant, queue.pop(grant.conn)) for grant in schedule(layout, waiting)]
        away = [queue.pop(conn) for conn in turned_away(layout, waiting) if queue[conn].turned_away is not None]
        if not queue:
            del self._queues[layout.name]
        self._refresh(layout.name)
        return taken, away

    def order(self) -> list[tuple[str, list[int]]]:
        """Every layout's waiting connections, in arrival order (for a hand-over)."""
        return [(layout, list(queue)) for layout, queue in self._queues.items()]

    def waiting_on(self, layout: str) -> bool:
        return layout in self._queues

    def busy(self) -> set[str]:
        """Layouts someone waits for: never evicted under them."""
        return set(self._queues)

    def counts(self, layout: str | None = None) -> tuple[int, int]:
        """(writers, others) waiting for a lock on ``layout`` (None: every layout)."""
        if layout is not None:
            return self._view.get(layout, (0, 0))
        writers = sum(w for w, _ in self._view.values())
        return writers, sum(o for _, o in self._view.values())

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """(writers, others) waiting per layout; safe to read from another thread."""
        return self._view

    def _refresh(self, layout: str) -> None:
        queue = self._queues.get(layout)
        if not queue:
            if layout in self._view:
                view = dict(self._view)
                del view[layout]
                self._view = view
            return
        writers = sum(1 for w in queue.values() if w.requested is RequestedLockType.RW)
        counts = (writers, len(queue) - writers)
        if self._view.get(layout) != counts:
            self._view = {**self._view, layout: counts}
