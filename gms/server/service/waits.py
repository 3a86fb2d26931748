"""What one session waits on, as data: the sans-IO half of ``Session``.

A session serves one request at a time, and three kinds of request wait
(``Waiting``): a handshake for its lock (until a grant, its deadline or a
hang-up), a granted restore for GPU memory, an allocation for memory.  A
take-over may stop the session in any of them and hand it on: ``image``
says what it waited on, and the successor's ``go_on`` starts from there.
Times are the caller's clock (Trio's), passed in; nothing here awaits,
reads a socket or a clock, so every transition is tested without them
(``tests/test_session_waits.py``), as ``ServerConnection``'s are.
"""

from __future__ import annotations

import math

import attrs

from ...fsm import Grant, RequestedLockType
from ...handover.image import PendingImage
from ...handover.words import Waiting
from ...wire import messages as m


@attrs.frozen
class LockWait:
    """A handshake waiting for its lock."""

    request: m.HandshakeRequest
    requested: RequestedLockType
    deadline: float  # the caller's clock; inf: no limit
    asked_at: float

    def left_ms(self, now: float) -> int | None:
        """What is left of its deadline (None: no limit), as a hand-over carries it."""
        return None if math.isinf(self.deadline) else max(0, int((self.deadline - now) * 1000))


class StateError(RuntimeError):
    """A transition the session's own code should never ask for (a bug, not a client)."""


@attrs.define
class Waits:
    lock: LockWait | None = None  # a handshake waiting for its lock
    grant: Grant | None = None  # the lock granted (also while the server paused for a take-over)
    memory: Waiting | None = None  # RESTORE or ALLOCATE, while it waits for memory
    pending: Waiting | None = None  # handed over waiting: to finish before anything else
    turned_away: bool = False  # nothing will grant the lock (gms.fsm.turned_away): answered ungranted

    # -- a handshake ---------------------------------------------------------------------

    def ask_lock(self, request: m.HandshakeRequest, requested: RequestedLockType, timeout_s: float,
                 now: float) -> LockWait:
        """The handshake was queued: it waits until ``timeout_s`` (inf: no limit) from ``now``."""
        if self.lock is not None:
            raise StateError("a second lock wait on one session")
        self.lock = LockWait(request, requested, now + timeout_s, now)
        return self.lock

    def granted(self, grant: Grant) -> None:
        self.grant = grant

    def turn_away(self) -> None:
        if self.grant is not None:
            raise StateError("a granted lock turned away")
        self.turned_away = True

    def lock_ended(self) -> LockWait:
        """Granted, timed out or given up: the wait is over (the grant, if any, stays)."""
        wait = self.lock
        if wait is None:
            raise StateError("no lock wait to end")
        self.lock = None
        return wait

    # -- memory --------------------------------------------------------------------------

    def wait_memory(self, kind: Waiting) -> None:
        if kind is Waiting.LOCK:
            raise StateError("a lock is not memory")
        if self.memory is not None:
            raise StateError(f"already waiting for memory ({self.memory})")
        self.memory = kind

    def memory_ended(self, *, parked: bool = False) -> None:
        """The wait is over, unless a take-over stopped it (``parked``): then the
        mark stays for the hand-over."""
        if not parked:
            self.memory = None

    # -- a hand-over ---------------------------------------------------------------------

    def image(self, now: float) -> PendingImage | None:
        """What a take-over hands on: the wait the session is in, if any."""
        grant = self.grant
        granted = grant.granted.value if grant else ""
        restore = bool(grant and grant.restore)
        if self.memory is not None:
            return PendingImage(self.memory, granted=granted, restore=restore)
        if self.lock is not None:
            return PendingImage(Waiting.LOCK, requested=self.lock.requested.value,
                                timeout_left_ms=self.lock.left_ms(now), granted=granted, restore=restore)
        return None

    def go_on(self, kind: Waiting, serving: object, *, requested: str = "", timeout_left: float = math.inf,
              granted: Grant | None = None, now: float = 0.0) -> None:
        """Handed over waiting on ``serving`` (the request the connection was
        serving): LOCK for ``requested``, ``timeout_left`` seconds more; RESTORE
        or ALLOCATE for memory.  ``granted``: the lock came while the server paused."""
        kind = Waiting(kind)
        if self.pending is not None or self.lock is not None:
            raise StateError("a session goes on from one wait")
        self.pending = kind
        if kind is Waiting.LOCK:
            self.lock = LockWait(serving, RequestedLockType(requested), now + timeout_left, now)
        if granted is not None:
            self.grant = granted

    def take_pending(self) -> Waiting | None:
        """The wait to finish first (once)."""
        kind, self.pending = self.pending, None
        return kind
