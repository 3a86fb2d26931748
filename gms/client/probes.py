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


@attrs.frozen
class EventHistory:
    events: list[HistoryEvent]
    first_seq: int
    last_seq: int


def _probe(socket_path: str, request: object, expect: type, timeout: float):
    transport = RpcTransport(socket_path, connect_timeout=timeout)
    try:
        response, fds = transport.call(request, expect)
    finally:
        transport.close()
    assert not fds
    return response


def get_runtime_state(socket_path: str, *, timeout: float = 10.0) -> RuntimeState:
    return _probe(socket_path, m.GetRuntimeStateRequest(), m.GetRuntimeStateResponse, timeout)


def get_event_history(
    socket_path: str, since_seq: int | None = None, limit: int | None = None, *, timeout: float = 10.0
) -> EventHistory:
    """One page of the log: events after ``since_seq``, at most ``limit``."""
    response = _probe(
        socket_path, m.GetEventHistoryRequest(since_seq, limit), m.GetEventHistoryResponse, timeout
    )
    events = [HistoryEvent.from_wire(row) for row in response.events]
    return EventHistory(events, response.first_seq, response.last_seq)


def iter_event_history(
    socket_path: str, since_seq: int = 0, *, timeout: float = 10.0
) -> Iterator[HistoryEvent]:
    """Every kept event after ``since_seq``, paging until the log's end at call time."""
    page = get_event_history(socket_path, since_seq, timeout=timeout)
    end = page.last_seq
    while page.events:
        yield from page.events
        since_seq = page.events[-1].seq
        if since_seq >= end:
            return
        page = get_event_history(socket_path, since_seq, timeout=timeout)
