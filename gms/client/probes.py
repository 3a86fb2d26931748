"""Inspection probes: they connect, ask, and close; they never take a lock."""

from __future__ import annotations

from collections.abc import Iterator

import attrs

from ..fsm import EVENT_TYPES, Event
from ..wire import messages as m
from .transport import RpcTransport

RuntimeState = m.GetRuntimeStateResponse

_ENTRY_KEYS = ("seq", "kind", "time", "mono_ns")


@attrs.frozen
class HistoryEvent:
    seq: int
    kind: str
    time: float
    mono_ns: int
    conn: int
    fields: dict

    def to_event(self) -> Event:
        """The FSM event this entry records: fold these to rebuild the state."""
        return EVENT_TYPES[self.kind](conn=self.conn, **self.fields)

    @classmethod
    def from_wire(cls, row: dict) -> HistoryEvent:
        fields = {k: v for k, v in row.items() if k not in _ENTRY_KEYS and k != "conn"}
        return cls(row["seq"], row["kind"], row["time"], row["mono_ns"], row["conn"], fields)

    @property
    def layout(self) -> str:
        return self.fields.get("layout", "")


@attrs.frozen
class EventHistory:
    events: list[HistoryEvent]
    first_seq: int
    last_seq: int
    scanned_seq: int = 0


def one_shot(socket_path: str, request: object, expect: type, timeout: float):
    """Send one probe or admin request on a connection of its own; the server closes it."""
    transport = RpcTransport(socket_path, connect_timeout=timeout)
    try:
        response, fds = transport.call(request, expect)
    finally:
        transport.close()
    assert not fds
    return response


def get_runtime_state(socket_path: str, *, timeout: float = 10.0) -> RuntimeState:
    """The server's state: devices, budgets, every layout and tenant the caller may see."""
    return one_shot(socket_path, m.GetRuntimeStateRequest(), m.GetRuntimeStateResponse, timeout)


def get_event_history(
    socket_path: str,
    since_seq: int | None = None,
    limit: int | None = None,
    *,
    layout: str | None = None,
    timeout: float = 10.0,
) -> EventHistory:
    """One page of the log: events after ``since_seq`` (of ``layout`` only, if given), at most ``limit``."""
    response = one_shot(
        socket_path, m.GetEventHistoryRequest(since_seq, limit, layout), m.GetEventHistoryResponse, timeout
    )
    events = [HistoryEvent.from_wire(row) for row in response.events]
    return EventHistory(events, response.first_seq, response.last_seq, response.scanned_seq)


def iter_event_history(
    socket_path: str, since_seq: int = 0, *, layout: str | None = None, timeout: float = 10.0
) -> Iterator[HistoryEvent]:
    """Every kept event after ``since_seq``, paging until the log's end at call time."""
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
