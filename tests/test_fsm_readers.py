"""A reader's visit in two events (READER_JOINED, READER_LEFT), against the four it replaces.

Each merged event is its pair's steps in one row: folded, it gives the state
the pair gives (the logical clock aside, which counts events), it is refused
where either of the pair would be, and a log that holds both forms (an older
server's four, this one's two) replays to the live state.
"""

from __future__ import annotations

import attrs
import pytest

from gms.fsm import (
    NotConnected,
    PermissionDenied,
    RequestedLockType,
    StateViolation,
    check_invariants,
    decide_disconnect,
    fold_all,
    opening,
    schedule,
)
from gms.fsm.events import ReaderJoined, ReaderLeft, RwConnect, SessionOpened
from gms.store import EventLog

from .fsm_events import closed_reader, committed, opened, reader, started, writer


def joined(conn: int, layout: str = "w", lock: str = "RO") -> ReaderJoined:
    return ReaderJoined(conn, "default", 1000, 1000, 4242, lock, None, layout=layout)


def committed_log() -> EventLog:
    log = EventLog()
    log.extend([started(), *writer(1)])
    log.extend(committed(log.state, 1))
    return log


def same(a, b) -> bool:
    """Equal but for the clock, which counts events (and so each layout's last use)."""
    layouts = {name: attrs.evolve(layout, last_use=0) for name, layout in a.layouts.items()}
    others = {name: attrs.evolve(layout, last_use=0) for name, layout in b.layouts.items()}
    return attrs.evolve(a, tick=0, layouts=None) == attrs.evolve(b, tick=0, layouts=None) and layouts == others


def test_a_reader_joining_and_leaving_folds_as_its_two_pairs_do():
    base = committed_log().state
    four, two = base, base
    for conn in (2, 3):
        four = fold_all(reader(conn), four)
        two = fold_all([joined(conn)], two)
        assert same(four, two) and two.layout("w").readers == set(range(2, conn + 1))
    for conn in (2, 3):
        four = fold_all(closed_reader(conn), four)
        two = fold_all([ReaderLeft(conn, layout="w")], two)
        assert same(four, two)
    assert two.layout("w").lock_state.value == "COMMITTED" and not two.sessions
    assert two.tick - base.tick == 4 and four.tick - base.tick == 8
    check_invariants(two)


def test_both_forms_in_one_log_replay_to_the_live_state():
    log = committed_log()
    log.extend(reader(2))
    log.extend([joined(3)])
    log.extend([ReaderLeft(2, layout="w")])  # joined the old way, left the new
    log.extend(closed_reader(3))  # and the other way round
    log.extend([joined(4)])
    assert log.replay() == log.state and log.state.layout("w").readers == {4}
    check_invariants(log.state)


@pytest.mark.parametrize("where", ["empty", "being written"])
def test_a_reader_cannot_join_where_a_read_lock_could_not_be_granted(where):
    log = EventLog()
    log.extend([started(), *writer(1)])
    if where == "empty":
        log.extend(decide_disconnect(log.state, 1))  # an abort: nothing was committed
    with pytest.raises(StateViolation):
        log.extend([joined(5)])
    assert 5 not in log.state.sessions


def test_a_joining_reader_is_checked_as_a_session_is():
    log = committed_log()
    log.extend([joined(2)])
    with pytest.raises(StateViolation, match="already handshaken"):
        log.extend([joined(2)])
    with pytest.raises(StateViolation, match="cannot join as a reader"):
        log.extend([joined(3, lock="RW")])
    with pytest.raises(PermissionDenied):
        log.extend([attrs.evolve(joined(4), tenant="nobody")])
    assert set(log.state.sessions) == {2}


def test_only_a_reader_leaves_as_one():
    log = committed_log()
    log.extend([opened(2, lock="RO")])  # a session that holds no lock yet
    with pytest.raises(NotConnected):
        log.extend([ReaderLeft(2, layout="w")])
    assert 2 in log.state.sessions


def test_a_handshake_records_a_read_lock_with_its_session_and_any_other_grant_after_it():
    state = committed_log().state
    ro = SessionOpened(2, "default", 1000, 1000, 4242, "RO", 1 << 20, "some-hash", layout="w")
    (grant,) = schedule(state.layout("w"), [(2, RequestedLockType.RO)])
    events, told = opening(ro, grant)
    assert [e.KIND for e in events] == ["READER_JOINED"] and told.event is events[0] and told.granted == grant.granted
    assert attrs.asdict(events[0]) == attrs.asdict(ro)  # the session as asked, every field
    rw = SessionOpened(3, "default", 1000, 1000, 4242, "RW", layout="w")
    (grant,) = schedule(state.layout("w"), [(3, RequestedLockType.RW)])
    events, told = opening(rw, grant)
    assert events == [rw, RwConnect(3, layout="w")] and told is grant
    assert opening(ro, None) == ([ro], None)


def test_a_reader_that_disconnects_leaves_in_one_event_a_writer_in_two():
    log = committed_log()
    log.extend([joined(2), opened(3, lock="RW")])
    assert [e.KIND for e in decide_disconnect(log.state, 2)] == ["READER_LEFT"]
    assert [e.KIND for e in decide_disconnect(log.state, 3)] == ["SESSION_CLOSED"]
