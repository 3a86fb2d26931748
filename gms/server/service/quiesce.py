"""The quiet point: every connection between requests or waiting, none half-served.

A take-over needs the server still: no request half-decided, no backend
call in flight, no answer half-sent.  :meth:`Quiesce.pause` asks for it.
Each session marks the awaits it may be stopped in: reading the next
request (``reading``/``read``), waiting for a lock or for memory
(``interruptible``).  Stopped there, it raises :class:`Parked` and its task ends, leaving the connection
open and its state for the hand-over (the session's ``image()``).  Anywhere
else (a lane call, a send) it is busy and runs on until its next
interruptible await, where it parks at once.  :meth:`Quiesce.until_quiet`
returns when every session has parked or ended.

Nothing is lost by stopping an interruptible await: a receive that is
cancelled has read nothing; a lock waiter stays in its queue (a grant made
while paused is kept by the session and goes with it); a memory wait is made
again from the start (it had made nothing).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import trio

STUCK_S = 0.5  # at a quiet point, an answer not yet taken this long after the pause is its client's to lose


class Parked(Exception):
    """A session stopped at a quiet point for a hand-over."""


def only_parked(exc: BaseException) -> bool:
    """Parked, or a group (from an inner nursery) of nothing but Parked and Cancelled."""
    if isinstance(exc, BaseExceptionGroup):
        rest = exc.split((Parked, trio.Cancelled))[1]
        return rest is None and exc.split(Parked)[0] is not None
    return isinstance(exc, Parked)


class Quiesce:
    def __init__(self) -> None:
        self.requested = False
        self.paused_at: float | None = None  # (trio time) when a take-over asked for the quiet point
        self._scopes: set[trio.CancelScope] = set()
        self._live: set[object] = set()  # sessions whose tasks run
        self.parked: dict[int, object] = {}  # conn -> parked session
        self._changed: trio.Event | None = None  # made when a take-over waits on it

    # -- the sessions' side ----------------------------------------------------------

    @contextmanager
    def interruptible(self) -> Iterator[None]:
        """Around an await a pause may stop: raises Parked if it does (or did)."""
        if self.requested:
            raise Parked
        scope = trio.CancelScope()
        self._scopes.add(scope)
        try:
            with scope:
                yield
        finally:
            self._scopes.discard(scope)
        if scope.cancelled_caught:
            raise Parked

    def reading(self, scope: trio.CancelScope) -> None:
        """A session waits for its next request inside ``scope``, a scope of its
        own entered once for its life (making and entering one is among the
        dearest steps of a request in Trio, so not one per read): a pause
        cancels it, which stops the wait.  The session calls :meth:`read` once
        the wait has ended, however it ended."""
        if self.requested:
            raise Parked
        self._scopes.add(scope)

    def read(self, scope: trio.CancelScope) -> None:
        """The wait :meth:`reading` began has ended, however it ended.  A pause
        that stopped it cancelled ``scope``: the session parks once the scope
        has caught the cancellation; one that came as the wait ended finds the
        session back from it, which parks at once (what it read stays in its
        connection, which a hand-over carries)."""
        self._scopes.discard(scope)

    def check(self) -> None:
        """At the top of a session's loop: park rather than start a request."""
        if self.requested:
            raise Parked

    def started(self, session: object) -> None:
        self._live.add(session)
        self._poke()

    def park(self, conn: int, session: object) -> None:
        self._live.discard(session)
        self.parked[conn] = session
        self._poke()

    def ended(self, session: object) -> None:
        self._live.discard(session)
        self._poke()

    # -- the take-over's side ---------------------------------------------------------------

    def pause(self) -> None:
        """Stop every interruptible await now, and every later one at once."""
        self.requested = True
        # A connection's first-request deadline stops here: the pause is the server's, not its client's.
        self.paused_at = trio.current_time()
        for scope in list(self._scopes):
            scope.cancel()

    async def until_quiet(self) -> None:
        """Return once no session task runs (each parked or ended)."""
        while self._live:
            if self._changed is None:
                self._changed = trio.Event()
            await self._changed.wait()

    async def until_quiet_dropping_stuck(self, stuck_s: float = STUCK_S) -> None:
        """:meth:`until_quiet`, but a session still sending its answer ``stuck_s``
        after the pause began is dropped: a send never parks half-done, and a
        client that reads nothing, or a trickle, would hold every other
        session paused as long as it liked (a trickle of 40 KiB every 0.1 s
        held a 14 MiB answer, and everyone, for the whole take-over).  So no
        client holds a take-over or another tenant for longer than
        ``stuck_s`` (and the work already running, which no client paces)."""
        with trio.move_on_after(stuck_s):
            await self.until_quiet()
            return
        for session in list(self._live):
            if session.channel.sending:
                session.drop_stuck()
        await self.until_quiet()

    def resume(self) -> dict[int, object]:
        """A take-over that did not happen: serving goes on; returns the parked
        sessions (their owner starts them again) and forgets them."""
        self.requested, self.paused_at = False, None
        parked, self.parked = self.parked, {}
        return parked

    def _poke(self) -> None:
        """Wake a take-over waiting for the sessions (nobody waits, most of the time:
        every connection starts and ends here)."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None
