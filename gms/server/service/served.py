"""What a handshake and a route use of the session that serves them: a typed seam.

``gms.server.service.handshake`` and ``gms.server.service.routes`` are handed
the session (``gms.server.service.session.Session``) that runs the request; this
is all of it they may touch, so the two-way dependency shows in one place (no type
checker runs in CI to hold them to it). Nothing here is set by them: a wait for the
lock asks the session for its event (``expect_grant``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable

    import trio

    from ...fsm import Grant
    from ...handover.words import Waiting
    from ...system.peer import Peer
    from ...wire import messages as m
    from ..config import ServerConfig
    from ..edge.netio import Channel
    from ..metrics import Metrics
    from .core import ServiceCore
    from .quiesce import Quiesce
    from .waits import Waits


class Served(Protocol):
    core: ServiceCore
    config: ServerConfig
    conn: int
    peer: Peer
    channel: Channel  # (a word to the client while it waits: LockWaiting)
    metrics: Metrics
    quiesce: Quiesce  # a take-over's pause may interrupt a wait
    waits: Waits  # what it waits on, as data
    on_take_over: Callable[[Channel, object, m.TakeOverRequest], None] | None

    async def until_gone(self) -> None: ...

    def waiting_for(self, what: Waiting) -> AbstractContextManager[None]: ...

    def expect_grant(self) -> trio.Event: ...

    def on_grant(self, grant: Grant) -> None: ...

    def turned_away(self) -> None: ...

    def alive(self) -> bool: ...
