"""Inspection probes: they connect, ask, and close; they never take a lock."""

from __future__ import annotations

import time
from collections.abc import Iterator

import attrs

from ..fsm import EVENT_TYPES, Event
from ..wire import messages as m
from .transport import RpcTransport

RuntimeState = m.GetRuntimeStateResponse

_ENTRY_KEYS = ("seq", "kind", "time", "mono_ns", "logged_as", "conn")


@attrs.frozen
class HistoryEvent:
    """One event of the history, ``kind`` in the seed's words (docs/protocol.md);
    ``logged_as`` the kind the log stores where it differs (a reader's merged
    READER_JOINED shows as RO_CONNECT), else ""."""

    seq: int
    kind: str
    time: float
    mono_ns: int
    conn: int
    fields: dict
    logged_as: str = ""

    def to_event(self) -> Event:
        """The FSM event this entry records: fold these to rebuild the state."""
        return EVENT_TYPES[self.logged_as or self.kind](conn=self.conn, **self.fields)

    @classmethod
    def from_wire(cls, row: dict) -> HistoryEvent:
        fields = {k: v for k, v in row.items() if k not in _ENTRY_KEYS}
        return cls(row["seq"], row["kind"], row["time"], row["mono_ns"], row["conn"], fields,
                   row.get("logged_as", ""))

    @property
    def layout(self) -> str:
        return self.fields.get("layout", "")


@attrs.frozen
class EventHistory:
    events: list[HistoryEvent]
    first_seq: int
    last_seq: int
    scanned_seq: int = 0


DEFAULT_TIMEOUT_S = 10.0  # probes and admin verbs: a server that does not answer in this is hung


def one_shot(socket_path: str, request: object, expect: type, timeout: float | None):
    """Send one probe or admin request on a connection of its own; the server closes it.

    ``timeout`` bounds the whole exchange, connecting included: a server that
    accepts but never answers raises ResponseTimeoutError after it."""
    deadline = None if timeout is None else time.monotonic() + timeout
    transport = RpcTransport(socket_path, connect_timeout=timeout)
    try:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        response, fds = transport.call(request, expect, left)
    finally:
        transport.close()
    assert not fds
    return response


def get_runtime_state(socket_path: str, *, timeout: float | None = DEFAULT_TIMEOUT_S) -> RuntimeState:
    """The server's state: devices, budgets, every layout and tenant the caller may see."""
    return one_shot(socket_path, m.GetRuntimeStateRequest(), m.GetRuntimeStateResponse, timeout)


def get_event_history(
    socket_path: str,
    since_seq: int | None = None,
    limit: int | None = None,
    *,
    layout: str | None = None,
    timeout: float | None = DEFAULT_TIMEOUT_S,
) -> EventHistory:
    """One page of the log: events after ``since_seq`` (of ``layout`` only, if given), at most ``limit``."""
    response = one_shot(
        socket_path, m.GetEventHistoryRequest(since_seq, limit, layout), m.GetEventHistoryResponse, timeout
    )
    events = [HistoryEvent.from_wire(row) for row in response.events]
    return EventHistory(events, response.first_seq, response.last_seq, response.scanned_seq)


def iter_event_history(
    socket_path: str,
    since_seq: int = 0,
    *,
    layout: str | None = None,
    timeout: float | None = DEFAULT_TIMEOUT_S,
) -> Iterator[HistoryEvent]:
    """Every kept event after ``since_seq``, paging until the log's end at call time
    (``timeout`` bounds each page)."""
    end = None
    while True:
        page = get_event_history(socket_path, since_seq, layout=layout, timeout=timeout)
        end = page.last_seq if end is None else end
        yield from (e for e in page.events if e.seq <= end)
        # scanned_seq is where the server stopped looking (0 from an older server).
        reached = max(page.scanned_seq, page.events[-1].seq if page.events else 0)
        if reached >= end or reached <= since_seq:
            return
        since_seq = reached
