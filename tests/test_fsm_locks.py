"""The seed's state table and transitions, one row at a time, on one layout."""

from __future__ import annotations

import attrs
import pytest

from gms.fsm import (
    GrantedLockType,
    LayoutState,
    LockState,
    Rejection,
    RequestedLockType,
    can_grant_ro,
    can_grant_rw,
    decide_commit,
    fold_all,
    fold_layout,
    resolve_rw_or_ro,
    schedule,
    turned_away,
)
from gms.fsm.events import (
    LayoutEvicted,
    RestoreAborted,
    RestoreClaimed,
    RestoreFinished,
    RestoreLoading,
    RoConnect,
    RoDisconnect,
    RwAbort,
    RwConnect,
)

from .fsm_events import committed as committed_by
from .fsm_events import opened, reader, started, writer

RW, RO, AUTO = RequestedLockType.RW, RequestedLockType.RO, RequestedLockType.RW_OR_RO
EMPTY = LayoutState("w")


def fold(events, state=EMPTY):
    for event in events:
        state = fold_layout(state, event)
    return state


def committed(readers=(), residency="device"):
    state = fold([RwConnect(1, layout="w")])
    state = fold(decide_commit(state, 1, residency), state)
    return fold([RoConnect(r, layout="w") for r in readers], state)


STATES = {
    LockState.EMPTY: EMPTY,
    LockState.RW: fold([RwConnect(1, layout="w")]),
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
    s = fold([RwConnect(1, layout="w")])
    assert s.lock_state is LockState.RW
    assert fold([RwAbort(1, layout="w")], s).lock_state is LockState.EMPTY
    s = fold(decide_commit(s, 1), s)
    assert s.lock_state is LockState.COMMITTED
    s = fold([RoConnect(2, layout="w"), RoConnect(3, layout="w")], s)
    assert s.lock_state is LockState.RO
    s = fold([RoDisconnect(2, layout="w")], s)
    assert s.lock_state is LockState.RO
    s = fold([RoDisconnect(3, layout="w")], s)
    assert s.lock_state is LockState.COMMITTED
    s = fold([RwConnect(4, layout="w")], s)
    assert s.lock_state is LockState.RW and s.layout_hash is None and not s.committed


def node_in(lock_state: LockState):
    """A node whose layout "w" is in ``lock_state``; conn 9 has a session on "w" and no lock."""
    events = [started()]
    if lock_state is not LockState.EMPTY:
        events += writer(1)
        if lock_state is not LockState.RW:
            events += committed_by(fold_all(events), 1)
        if lock_state is LockState.RO:
            events += reader(2)
    node = fold_all([*events, opened(9, "w", "RO")])
    assert node.layout("w").lock_state is lock_state
    return node


@pytest.mark.parametrize(
    "lock_state, event",
    [
        (LockState.EMPTY, RoConnect(9, layout="w")),
        (LockState.RW, RwConnect(9, layout="w")),
        (LockState.RW, RoConnect(9, layout="w")),
        (LockState.RO, RwConnect(9, layout="w")),
        (LockState.COMMITTED, RwAbort(9, layout="w")),
        (LockState.RO, RoDisconnect(9, layout="w")),
        (LockState.RO, LayoutEvicted(0, "admin", layout="w")),  # in use
        (LockState.COMMITTED, LayoutEvicted(0, "admin", layout="w")),  # residency device
        (LockState.COMMITTED, RestoreClaimed(9, layout="w")),  # not evicted
        (LockState.COMMITTED, RoConnect(9, layout="other")),  # a layout conn 9 has no session on
    ],
)
def test_the_rules_refuse_impossible_events(lock_state, event):
    node = node_in(lock_state)
    with pytest.raises(Rejection):
        fold_all([event], node)


def test_rw_or_ro_three_branches():
    assert resolve_rw_or_ro(EMPTY) is GrantedLockType.RW
    assert resolve_rw_or_ro(STATES[LockState.COMMITTED]) is GrantedLockType.RO
    assert resolve_rw_or_ro(STATES[LockState.RO]) is GrantedLockType.RO
    assert resolve_rw_or_ro(STATES[LockState.RW]) is None  # wait for commit or abort


def test_writer_priority_blocks_new_readers():
    state = STATES[LockState.RO]
    # A writer waits for the reader to leave; a reader arriving after it waits too.
    assert schedule(state, [(5, RW), (6, RO)]) == []
    assert not can_grant_ro(state, writers_waiting=1)
    state = fold([RoDisconnect(2, layout="w")], state)
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
    grants = schedule(EMPTY, [(8, RO), (9, RW), (10, RW)])
    assert [(g.conn, g.granted) for g in grants] == [(9, GrantedLockType.RW)]


def evicted():
    return fold([LayoutEvicted(0, "budget", layout="w")], committed(residency="system"))


def test_an_evicted_layout_is_restored_by_one_reader_while_the_others_wait():
    state = evicted()
    assert state.tier.value == "host" and state.lock_state is LockState.COMMITTED
    grants = schedule(state, [(5, RO), (6, AUTO), (7, RO)])
    assert [(g.conn, g.restore) for g in grants] == [(5, True)], "one restorer; the rest wait"
    state = fold([grants[0].event, RestoreLoading(5, layout="w")], state)
    assert schedule(state, [(6, AUTO), (7, RO)]) == [] and not can_grant_rw(state)
    state = fold([RestoreFinished(5, layout="w")], state)
    assert state.resident and state.readers == {5} and state.restores == 1
    grants = schedule(state, [(6, AUTO), (7, RO)])
    assert [(g.conn, g.granted, g.restore) for g in grants] == [
        (6, GrantedLockType.RO, False), (7, GrantedLockType.RO, False),
    ]


def test_a_restorer_that_leaves_hands_the_restore_to_the_next_reader():
    state = fold([RestoreClaimed(5, layout="w"), RestoreLoading(5, layout="w")], evicted())
    state = fold([RestoreAborted(5, layout="w")], state)
    assert state.tier.value == "host" and state.restorer is None and not state.readers
    (grant,) = schedule(state, [(6, RO)])
    assert grant.restore and grant.conn == 6


def test_a_writer_may_replace_an_evicted_layout():
    (grant,) = schedule(evicted(), [(5, RW), (6, RO)])
    assert grant.granted is GrantedLockType.RW
    state = fold([grant.event], evicted())
    assert state.tier.value == "device" and not state.host_copies and not state.committed


def test_readers_of_a_layout_whose_snapshot_was_not_served_are_turned_away_unless_a_writer_builds_it():
    unserved = attrs.evolve(EMPTY, unserved="does not read: its manifest is torn")
    assert schedule(unserved, [(5, RO), (6, RO)]) == [], "nothing grants them"
    assert turned_away(unserved, [(5, RO), (6, RO)]) == [5, 6]
    assert turned_away(EMPTY, [(5, RO)]) == [], "an empty layout a writer has yet to build: readers wait"
    for waiting in ([(5, RO), (6, RW)], [(5, RO), (6, AUTO)]):  # a writer comes: they wait for its commit
        assert turned_away(unserved, waiting) == [], waiting
        assert schedule(unserved, waiting)[0].granted is GrantedLockType.RW
    building = fold([RwConnect(9, layout="w")], unserved)
    assert building.unserved == "" and turned_away(building, [(5, RO)]) == [], "a writer clears it"


def test_host_copies_are_read_by_the_writer_and_the_restorer_only_where_they_exist():
    from gms.fsm import NotConnected, StateViolation, decide_allocate, decide_host_copy
    from gms.fsm.decide import decide_commit
    from gms.fsm.queries import host_chunks_to_export, host_copies_to_export

    state = fold([RwConnect(1, layout="w")])
    for allocation_id in ("a", "b"):
        state = fold(decide_allocate(state, 1, allocation_id, 4096, 2 << 20, "w"), state)
    assert host_copies_to_export(state, 1, ["a", "b"]) is False  # the writer's: made if missing
    with pytest.raises(StateViolation, match="restorer"):
        host_chunks_to_export(state, 1, ["a"])
    state = fold(decide_host_copy(state, 1, "a") + decide_host_copy(state, 1, "b"), state)
    state = fold([*decide_commit(state, 1, "system"), LayoutEvicted(0, "budget", layout="w")], state)
    state = fold([RestoreClaimed(5, layout="w")], state)
    assert host_copies_to_export(state, 5, ["a", "b"]) is True
    host_chunks_to_export(state, 5, ["b"])
    with pytest.raises(NotConnected):
        host_copies_to_export(state, 6, ["a"])  # no lock on the layout
    lost = attrs.evolve(state, host_copies=state.host_copies.delete("b"))  # as a broken shell would leave it
    for ask in (host_copies_to_export, host_chunks_to_export):
        with pytest.raises(StateViolation, match="1 allocations have no host copy to restore from .*'b'"):
            ask(lost, 5, ["a", "b"])
