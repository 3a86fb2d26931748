"""The event log: sequence, reads, retention with snapshot, refusal."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gms.fsm import InvariantViolation, LockState, StateViolation
from gms.fsm.events import RoConnect, ServerResumed
from gms.store import EventLog, LogEntry, Snapshot, replay
from gms.store.log import RESTART_STRIDE, after_loss

from .fsm_events import aborted, churn, closed_reader, committed, reader, started, writer


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


# -- a restart's gap: numbers are never used twice --------------------------------------------


def restarted(follows: int) -> ServerResumed:
    return ServerResumed(
        0, "restart", 4242, "signal SIGKILL", 2, None, None, None, {"default": None}, layout="", follows_seq=follows,
    )


def test_a_restart_numbers_past_anything_the_dead_server_may_have_used():
    assert [after_loss(n) for n in (0, 7, RESTART_STRIDE - 1, RESTART_STRIDE)] == [
        RESTART_STRIDE, RESTART_STRIDE, RESTART_STRIDE, 2 * RESTART_STRIDE,
    ]
    log = EventLog(retain=None, chunk_size=4)
    log.extend(churn(7))  # (the dead server had used more: they never reached its keeper)
    log.skip_lost()
    (entry,) = log.extend([restarted(7)])
    assert entry.seq == RESTART_STRIDE and log.last_seq == RESTART_STRIDE
    assert [e.seq for e in log.entries()] == [1, 2, 3, 4, 5, 6, 7, RESTART_STRIDE]
    assert replay(log) == log.state


@given(since=st.integers(0, 12), limit=st.none() | st.integers(0, 12), chunk=st.integers(1, 5))
def test_reads_page_across_the_gap(since, limit, chunk):
    log = EventLog(retain=None, chunk_size=chunk)
    log.extend(churn(6))
    log.skip_lost()
    log.extend([restarted(6), *writer(9)])
    seqs = [1, 2, 3, 4, 5, 6, RESTART_STRIDE, RESTART_STRIDE + 1, RESTART_STRIDE + 2]
    since = since if since <= 6 else RESTART_STRIDE + since - 7
    expected = [n for n in seqs if n > since][: limit if limit is not None else None]
    assert [e.seq for e in log.since(since, limit)] == expected
    assert [log.entry(n) for n in (7, RESTART_STRIDE - 1)] == [None, None], "nothing in the gap"
    assert log.entry(RESTART_STRIDE).event == restarted(6)


def test_a_log_resumed_across_a_gap_rebuilds_and_refuses_any_other():
    log = EventLog(retain=None)
    log.extend(churn(5))
    log.skip_lost()
    log.extend([restarted(5), *writer(9)])
    entries = list(log.entries())
    again = EventLog.resumed(Snapshot(0, EventLog().state), entries, retain=None)
    assert (again.state, again.last_seq, [e.seq for e in again.entries()]) == (
        log.state, log.last_seq, [e.seq for e in entries],
    )
    empty = Snapshot(0, EventLog().state)
    broken = [entry if entry.seq != 4 else LogEntry(40, *entry[1:]) for entry in entries[:5]]
    with pytest.raises(ValueError, match="event 40 cannot follow event 3"):
        EventLog.resumed(empty, broken, retain=None)
    for wrong in (restarted(4), restarted(6)):  # a restart that says it follows another event
        with pytest.raises(ValueError, match=f"event {RESTART_STRIDE} cannot follow event 5"):
            EventLog.resumed(empty, [*entries[:5], entries[5]._replace(event=wrong)], retain=None)
    with pytest.raises(ValueError, match="cannot follow event 5"):  # nor past its restart's first number
        EventLog.resumed(empty, [*entries[:5], entries[5]._replace(seq=RESTART_STRIDE + 1)], retain=None)


def test_a_restart_with_nothing_kept_since_its_snapshot_starts_the_kept_numbers_at_its_own():
    log = EventLog(retain=None)
    log.extend(churn(5))
    resumed = EventLog.resumed(Snapshot(log.last_seq, log.state), [], retain=None)
    resumed.skip_lost()
    resumed.extend([restarted(5)])
    assert (resumed.first_seq, resumed.last_seq, len(resumed)) == (RESTART_STRIDE, RESTART_STRIDE, 1)
    assert resumed.snapshot == Snapshot(RESTART_STRIDE - 1, log.state)
    assert [e.seq for e in resumed.since(0)] == [RESTART_STRIDE]


# -- an earlier server's events, shown but never folded (gms.store.prior) ---------------------


def test_a_resumed_log_shows_the_events_before_its_snapshot_and_drops_them_first():
    from gms.handover.image import decode_entries, encode_entries
    from gms.store.prior import Prior, batches

    first = EventLog(retain=None)
    first.extend([started(), *writer(1)])
    first.extend(committed(first.state, 1))
    first.extend([*reader(2), *closed_reader(2)])
    old = list(first.entries())
    rows = [[old[0].seq, old[2].seq, 3, encode_entries(old[:3])], [old[3].seq, old[-1].seq, len(old) - 3,
                                                                    encode_entries(old[3:])],
            [99, 1, 1, b"x"], "not a row"]  # the last two are not well formed: left out
    prior = Prior(batches(rows, first.last_seq + 1), decode_entries)
    log = EventLog.resumed(Snapshot(first.last_seq, first.state), retain=len(old) + 2, prior=prior)
    log.extend([restarted(first.last_seq)])
    assert log.first_seq == 1 and [e.seq for e in log.since(0)] == [*(e.seq for e in old), first.last_seq + 1]
    assert log.entry(2) == old[1] and [e.seq for e in log.since(3, limit=2)] == [4, 5]
    assert log.replay() == log.state  # the prior is shown, never folded
    log.extend([*writer(20), *aborted(20)])  # past the count bound: the oldest batch goes first, whole
    assert log.first_seq == old[3].seq and len(list(log.since(0))) <= len(old) + 2 + 4096
