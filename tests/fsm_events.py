"""Building valid node histories by hand, for the pure-core tests."""

from __future__ import annotations

from gms.fsm import decide_commit
from gms.fsm.events import (
    RoConnect,
    RoDisconnect,
    RwAbort,
    RwConnect,
    ServerStarted,
    SessionClosed,
    SessionOpened,
)


def started(quotas=None, budget=None, host_budget=None, capacity=None) -> ServerStarted:
    return ServerStarted(0, capacity, budget, host_budget, quotas or {"default": None}, layout="")


def opened(conn: int, layout: str = "w", lock: str = "RW", tenant: str = "default", limit=None) -> SessionOpened:
    return SessionOpened(conn, tenant, 1000, 1000, 4242, lock, limit, layout=layout)


def writer(conn: int, layout: str = "w", tenant: str = "default") -> list:
    """A session that takes RW (the caller continues it)."""
    return [opened(conn, layout, "RW", tenant), RwConnect(conn, layout=layout)]


def reader(conn: int, layout: str = "w") -> list:
    return [opened(conn, layout, "RO"), RoConnect(conn, layout=layout)]


def closed_reader(conn: int, layout: str = "w") -> list:
    return [RoDisconnect(conn, layout=layout), SessionClosed(conn, layout=layout)]


def aborted(conn: int, layout: str = "w") -> list:
    return [RwAbort(conn, layout=layout), SessionClosed(conn, layout=layout)]


def committed(state, conn: int, layout: str = "w") -> list:
    """The writer's commit, decided on ``state``, and its session's end."""
    return [*decide_commit(state.layout(layout), conn), SessionClosed(conn, layout=layout)]


def churn(n: int):
    """n events: a start, then writers coming and going; every prefix is a valid history."""
    events = [started()]
    conn = 1
    while len(events) < n:
        events += writer(conn) + aborted(conn)
        conn += 1
    yield from events[:n]
