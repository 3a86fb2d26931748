"""The event log: sequence, reads, retention with snapshot, refusal."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gms.fsm import InvariantViolation, LockState, StateViolation
from gms.fsm.events import RoConnect
from gms.store import EventLog, replay

from .fsm_events import churn, closed_reader, committed, reader, started, writer


def test_sequence_numbers_and_clocks():
    log = EventLog()
    entries = log.extend(churn(4))
    assert [e.seq for e in entries] == [1, 2, 3, 4]
    assert all(a.mono_ns <= b.mono_ns for a, b in zip(entries, entries[1:]))
    assert all(e.wall_ns > 1_600_000_000 * 10**9 for e in entries)
    assert (log.first_seq, log.last_seq, len(log)) == (1, 4, 4)


def test_refused_event_is_not_stored():
    log = EventLog()
    log.extend([started(), *writer(1)])
    with pytest.raises(StateViolation, match="no session"):
        log.append(RoConnect(2, layout="w"))
    assert log.last_seq == 3 and log.state.layout("w").lock_state is LockState.RW
    assert replay(log) == log.state


def test_the_log_starts_with_the_server():
    with pytest.raises(InvariantViolation, match="SERVER_STARTED"):
        EventLog().extend(writer(1))


@given(
    n=st.integers(0, 300),
    retain=st.integers(0, 50),
    chunk=st.integers(1, 16),
    since=st.integers(-5, 320),
    limit=st.none() | st.integers(0, 40),
)
def test_retention_keeps_replay_exact_and_reads_contiguous(n, retain, chunk, since, limit):
    log = EventLog(retain=retain, chunk_size=chunk)
    for event in churn(n):
        log.append(event)
        assert replay(log) == log.state
    assert retain <= len(log) <= retain + chunk or len(log) == n
    assert log.last_seq == n and log.first_seq == n - len(log) + 1
    assert log.snapshot.last_seq == log.first_seq - 1
    got = [e.seq for e in log.since(since, limit)]
    start = max(since + 1, log.first_seq)
    expected = list(range(start, n + 1))[: limit if limit is not None else None]
    assert got == expected


def test_unbounded_log_keeps_everything():
    log = EventLog(retain=None, chunk_size=3)
    log.extend(churn(100))
    assert len(log) == 100 and log.first_seq == 1
    assert [e.event for e in log.entries()] == list(churn(100))


def test_snapshot_is_the_state_at_the_cut():
    log = EventLog(retain=2, chunk_size=2)
    log.extend([started(), *writer(1)])
    log.extend(committed(log.state, 1))
    log.extend([*reader(3), *closed_reader(3)])
    snap = log.snapshot
    assert snap.last_seq == 6 and snap.state.layout("w").lock_state is LockState.COMMITTED
    assert replay(log) == log.state


def test_entry_finds_kept_events_by_sequence_number():
    log = EventLog(retain=4, chunk_size=2)
    log.extend(churn(11))
    assert [log.entry(seq) for seq in (0, 1, 12)] == [None, None, None]
    assert [log.entry(seq).seq for seq in range(log.first_seq, 12)] == list(range(log.first_seq, 12))
