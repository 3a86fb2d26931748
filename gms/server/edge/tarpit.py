"""Refusals slowed down for a uid that keeps asking past its limits.

A tenant at one of its limits (a metadata quota, ``max_layouts``, its bytes)
is refused at once, and may simply ask again: a loop of refused requests
costs the server as much as served ones (a refused 1 MiB metadata put is
still a 1 MiB frame read and decoded), and everyone else waits behind it.
PostgreSQL's ``auth_delay`` answers failed logins late for the same reason.
Here the first ``FREE_PER_S`` refusals of a uid in a second are answered at
once and each one after them ``DELAY_S`` later: a session task sleeping, no
thread, nothing held but the connection the uid already holds (bounded by
``--max-connections-per-uid``).  Admins are never slowed.  A legitimate
client meets a limit once and changes course; it never sees the delay.
"""

from __future__ import annotations

from collections.abc import Callable

FREE_PER_S = 16
DELAY_S = 0.01
_MAX_UIDS = 4096  # uids tracked at once (the table is cleared past it: nobody is slowed for long wrongly)


class Tarpit:
    def __init__(self, clock: Callable[[], float], free_per_s: int = FREE_PER_S, delay_s: float = DELAY_S) -> None:
        self.clock = clock
        self.free_per_s = free_per_s
        self.delay_s = delay_s
        self._windows: dict[int, tuple[float, int]] = {}  # uid -> (the second's start, refusals in it)

    def delay(self, uid: int) -> float:
        """Count a refusal of ``uid``; how long to wait before answering it."""
        now = self.clock()
        start, count = self._windows.get(uid, (now, 0))
        if now - start >= 1.0:
            start, count = now, 0
        if len(self._windows) >= _MAX_UIDS and uid not in self._windows:
            self._windows.clear()
        self._windows[uid] = (start, count + 1)
        return 0.0 if count + 1 <= self.free_per_s else self.delay_s
