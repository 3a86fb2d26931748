"""The seed's state table and transitions, one row at a time."""

from __future__ import annotations

import pytest

from gms.fsm import (
    EMPTY_STATE,
    GrantedLockType,
    InvariantViolation,
    LockState,
    RequestedLockType,
    can_grant_ro,
    can_grant_rw,
    decide_commit,
    fold_all,
    resolve_rw_or_ro,
    schedule,
)
from gms.fsm.events import RoConnect, RoDisconnect, RwAbort, RwConnect

RW, RO, AUTO = RequestedLockType.RW, RequestedLockType.RO, RequestedLockType.RW_OR_RO


def committed(readers=()):
    state = fold_all([RwConnect(1)])
    state = fold_all(decide_commit(state, 1), state)
    return fold_all([RoConnect(r) for r in readers], state)


STATES = {
    LockState.EMPTY: EMPTY_STATE,
    LockState.RW: fold_all([RwConnect(1)]),
    LockState.COMMITTED: committed(),
    LockState.RO: committed(readers=[2]),
}


@pytest.mark.parametrize(
    "lock_state, rw_ok, ro_ok",
    [
        (LockState.EMPTY, True, False),
        (LockState.RW, False, False),
        (LockState.COMMITTED, True, True),
        (LockState.RO, False, True),
    ],
)
def test_state_table(lock_state, rw_ok, ro_ok):
    state = STATES[lock_state]
    assert state.lock_state is lock_state
    assert can_grant_rw(state) is rw_ok
    assert can_grant_ro(state) is ro_ok


def test_transitions():
    s = fold_all([RwConnect(1)])
    assert s.lock_state is LockState.RW
    assert fold_all([RwAbort(1)], s).lock_state is LockState.EMPTY
    s = fold_all(decide_commit(s, 1), s)
    assert s.lock_state is LockState.COMMITTED
    s = fold_all([RoConnect(2), RoConnect(3)], s)
    assert s.lock_state is LockState.RO
    s = fold_all([RoDisconnect(2)], s)
    assert s.lock_state is LockState.RO
    s = fold_all([RoDisconnect(3)], s)
    assert s.lock_state is LockState.COMMITTED
    s = fold_all([RwConnect(4)], s)
    assert s.lock_state is LockState.RW and s.layout_hash is None and not s.committed


@pytest.mark.parametrize(
    "lock_state, event",
    [
        (LockState.EMPTY, RoConnect(9)),
        (LockState.RW, RwConnect(9)),
        (LockState.RW, RoConnect(9)),
        (LockState.RO, RwConnect(9)),
        (LockState.COMMITTED, RwAbort(9)),
        (LockState.RO, RoDisconnect(9)),
    ],
)
def test_fold_refuses_impossible_events(lock_state, event):
    with pytest.raises(InvariantViolation):
        fold_all([event], STATES[lock_state])


def test_rw_or_ro_three_branches():
    assert resolve_rw_or_ro(EMPTY_STATE) is GrantedLockType.RW
    assert resolve_rw_or_ro(STATES[LockState.COMMITTED]) is GrantedLockType.RO
    assert resolve_rw_or_ro(STATES[LockState.RO]) is GrantedLockType.RO
    assert resolve_rw_or_ro(STATES[LockState.RW]) is None  # wait for commit or abort


def test_writer_priority_blocks_new_readers():
    state = STATES[LockState.RO]
    # A writer waits for the reader to leave; a reader arriving after it waits too.
    assert schedule(state, [(5, RW), (6, RO)]) == []
    assert not can_grant_ro(state, writers_waiting=1)
    state = fold_all([RoDisconnect(2)], state)
    grants = schedule(state, [(6, RO), (5, RW), (7, AUTO)])
    assert [(g.conn, g.granted) for g in grants] == [(5, GrantedLockType.RW)]


def test_schedule_grants_readers_together_and_writers_in_order():
    state = STATES[LockState.COMMITTED]
    grants = schedule(state, [(5, RO), (6, AUTO), (7, RO)])
    assert [(g.conn, g.granted) for g in grants] == [
        (5, GrantedLockType.RO),
        (6, GrantedLockType.RO),
        (7, GrantedLockType.RO),
    ]
    grants = schedule(EMPTY_STATE, [(8, RO), (9, RW), (10, RW)])
    assert [(g.conn, g.granted) for g in grants] == [(9, GrantedLockType.RW)]
