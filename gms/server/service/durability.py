"""Where what the ledger stores becomes durable, and what an answer waits for.

The event log (``gms.store``) is memory and pure.  What outlives the server is
its keeper's (``gms.server.restart.mirror.KeeperLink`` implements this): the
ledger hands it every stored batch (``logged``) and says when a write is done
(``flush``); a session asks, before it answers, whether the keeper holds what
the answer tells of (``behind``, ``durable``).  A server without a keeper has
:data:`IN_MEMORY`: nothing to wait for.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from ...store import LogEntry


class Durability(Protocol):
    def logged(self, entries: list[LogEntry]) -> None:
        """A batch the log stored (in order, every one)."""

    def flush(self, soon: bool = False) -> None:
        """A write is done: hand on what it made (``soon``: unless it told of a
        lasting change, a moment later, with whatever follows)."""

    def added(self, conn: int) -> int:
        """Bytes the connection's requests have handed on so far."""

    def behind(self, layouts: Iterable[str] | None = None, conn: int | None = None, since: int = 0) -> bool:
        """Is a lasting change of ``layouts`` (or the node) not durable yet, or did
        ``conn``'s request (``since``: its :meth:`added` before it) add much to a
        long wait?"""

    async def durable(self, layouts: Iterable[str] | None = None, conn: int | None = None, since: int = 0) -> None:
        """Return once :meth:`behind` would say no."""


class InMemory:
    """No keeper: the log is all there is, and nothing waits."""

    def logged(self, entries: list[LogEntry]) -> None:
        pass

    def flush(self, soon: bool = False) -> None:
        pass

    def added(self, conn: int) -> int:
        return 0

    def behind(self, layouts=None, conn=None, since=0) -> bool:
        return False

    async def durable(self, layouts=None, conn=None, since=0) -> None:
        pass


IN_MEMORY: Durability = InMemory()
