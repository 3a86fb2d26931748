"""Hypothesis stateful machine over the pure core.

Drives many connections through random handshakes (RW, RO, RW_OR_RO),
crashes, allocations, frees, metadata puts and deletes, commits, reads and
bad requests, the way the shell does: decide, append to the log, fold.
After every step it checks the FSM invariants, that replaying the log (from
its snapshot, and from the very first event) gives the live state, and that
the independent reference model agrees on every table and every answer.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gms.fsm import (
    Limits,
    Rejection,
    RequestedLockType,
    check_invariants,
    decide_allocate,
    decide_commit,
    decide_disconnect,
    decide_free,
    decide_metadata_delete,
    decide_metadata_put,
    fold_all,
    schedule,
)
from gms.fsm import queries
from gms.store import EventLog

from .reference import ReferenceModel

MiB = 1 << 20
GRANULARITY = 2 * MiB
LIMITS = Limits(
    max_allocations=5,
    max_metadata_keys=4,
    max_metadata_value_bytes=8,
    max_key_bytes=6,
    max_tag_bytes=8,
)
KEYS = ["k0", "k1", "k2", "k3", "k4", "", "too-long-key"]
TAGS = ["weights", "kv_cache", "", "much-too-long"]
# Requests mostly come from the lock holder, so layouts grow; the rest probe
# the refusals (no lock, wrong mode).
WRITERISH = st.sampled_from(["writer", "writer", "writer", "any"])
READERISH = st.sampled_from(["reader", "reader", "writer", "any"])
SIZES = st.sampled_from([-1, 0, 1, 4096, GRANULARITY - 1, GRANULARITY, 3 * GRANULARITY]) | (
    st.integers(1, 8 * MiB)
)


def has_connections(machine) -> bool:
    # With nobody connected, every request is NOT_CONNECTED: one handshake
    # next is worth more than another refusal.
    return bool(machine.open_conns)


def has_writer(machine) -> bool:
    return machine.log.state.writer is not None


def aligned(size: int) -> int:
    return -(-size // GRANULARITY) * GRANULARITY if size > 0 else 0


def rejection_code(thunk):
    try:
        return None, thunk()
    except Rejection as rejection:
        return rejection.code, None


class FsmMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        # Tiny retention, so replay goes through snapshots and cut chunks.
        self.log = EventLog(retain=12, chunk_size=4)
        self.events = []
        self.model = ReferenceModel(
            LIMITS.max_allocations,
            LIMITS.max_metadata_keys,
            LIMITS.max_metadata_value_bytes,
            LIMITS.max_key_bytes,
            LIMITS.max_tag_bytes,
        )
        self.next_conn = 1
        self.next_alloc = 0
        self.waiting: list[tuple[int, RequestedLockType]] = []
        self.open_conns: set[int] = set()

    # -- helpers ----------------------------------------------------------

    def _append(self, events) -> None:
        for event in events:
            self.log.append(event)
            self.events.append(event)

    def _pump(self) -> None:
        grants = schedule(self.log.state, self.waiting)
        self._append([g.event for g in grants])
        granted = {g.conn for g in grants}
        self.waiting = [w for w in self.waiting if w[0] not in granted]
        assert [(g.conn, g.granted.value) for g in grants] == self.model.pump()

    def _pick_conn(self, data, role: str = "any") -> int:
        """``any`` also picks connections that hold no lock (0 never handshakes)."""
        state = self.log.state
        if role == "writer" and state.writer is not None:
            return state.writer
        if role == "reader" and state.readers:
            return data.draw(st.sampled_from(sorted(state.readers)), label="reader")
        return data.draw(st.sampled_from([0, *sorted(self.open_conns)]), label="conn")

    def _decide(self, thunk):
        code, events = rejection_code(thunk)
        if events is not None:
            self._append(events)
        return code, events

    def _known_allocation(self, data) -> str:
        ids = sorted(self.log.state.allocations) + ["missing"]
        return data.draw(st.sampled_from(ids), label="allocation_id")

    # -- connections --------------------------------------------------------

    @rule(lock=st.sampled_from(list(RequestedLockType)))
    def handshake(self, lock):
        conn = self.next_conn
        self.next_conn += 1
        self.open_conns.add(conn)
        self.waiting.append((conn, lock))
        self.model.queue.append((conn, lock.value))
        self._pump()

    @precondition(lambda self: self.open_conns)
    @rule(data=st.data())
    def disconnect(self, data):
        """A close, a crash, a dropped connection or a timed-out waiter."""
        conn = data.draw(st.sampled_from(sorted(self.open_conns)), label="conn")
        self.open_conns.discard(conn)
        self.waiting = [w for w in self.waiting if w[0] != conn]
        events = decide_disconnect(self.log.state, conn)
        self._append(events)
        expected = self.model.disconnect(conn)
        assert [e.KIND for e in events] == ([expected] if expected else [])
        self._pump()

    # -- layout requests ------------------------------------------------------
    # Each request has a checked core (decide, append, compare with the model),
    # reached by a rule open to any connection and arguments, and by a rule
    # that only runs while a writer holds RW and mostly draws valid arguments:
    # without it most layouts would never grow past their first request.

    def _allocate(self, conn, size, tag):
        alloc_id = f"a{self.next_alloc}"
        self.next_alloc += 1
        state = self.log.state
        code, _ = self._decide(
            lambda: decide_allocate(state, conn, alloc_id, size, aligned(size), tag, LIMITS)
        )
        assert code == self.model.allocate(conn, alloc_id, size, aligned(size), tag)

    def _free(self, conn, alloc_id):
        state = self.log.state
        code, _ = self._decide(lambda: decide_free(state, conn, alloc_id))
        assert code == self.model.free(conn, alloc_id)

    def _metadata_put(self, data, conn, key, alloc_id, value):
        allocation = self.log.state.allocations.get(alloc_id)
        size = allocation.size if allocation else 1
        offset = data.draw(
            st.sampled_from([-1, 0, size - 1, size, size + 1]) | st.integers(0, size - 1),
            label="offset",
        )
        state = self.log.state
        code, _ = self._decide(
            lambda: decide_metadata_put(state, conn, key, alloc_id, offset, value, LIMITS)
        )
        assert code == self.model.metadata_put(conn, key, alloc_id, offset, value)

    @precondition(has_connections)
    @rule(data=st.data(), role=WRITERISH, size=SIZES, tag=st.sampled_from(TAGS))
    def allocate(self, data, role, size, tag):
        self._allocate(self._pick_conn(data, role), size, tag)

    @precondition(has_writer)
    @rule(size=st.integers(1, 8 * MiB), tag=st.sampled_from(TAGS[:2]))
    def writer_allocates(self, size, tag):
        self._allocate(self.log.state.writer, size, tag)

    @precondition(has_connections)
    @rule(data=st.data(), role=WRITERISH)
    def free(self, data, role):
        self._free(self._pick_conn(data, role), self._known_allocation(data))

    @precondition(has_writer)
    @rule(data=st.data())
    def writer_frees(self, data):
        self._free(self.log.state.writer, self._known_allocation(data))

    @precondition(has_connections)
    @rule(
        data=st.data(),
        role=WRITERISH,
        key=st.sampled_from(KEYS),
        value=st.binary(max_size=LIMITS.max_metadata_value_bytes + 2),
    )
    def metadata_put(self, data, role, key, value):
        conn = self._pick_conn(data, role)
        self._metadata_put(data, conn, key, self._known_allocation(data), value)

    @precondition(lambda self: has_writer(self) and self.log.state.allocations)
    @rule(
        data=st.data(),
        key=st.sampled_from(KEYS[:5]),
        value=st.binary(max_size=LIMITS.max_metadata_value_bytes),
    )
    def writer_puts_metadata(self, data, key, value):
        alloc_id = data.draw(st.sampled_from(sorted(self.log.state.allocations)))
        self._metadata_put(data, self.log.state.writer, key, alloc_id, value)

    def _metadata_delete(self, conn, key):
        state = self.log.state
        code, events = self._decide(lambda: decide_metadata_delete(state, conn, key))
        assert (code, bool(events)) == self.model.metadata_delete(conn, key)

    @precondition(has_connections)
    @rule(data=st.data(), role=WRITERISH, key=st.sampled_from(KEYS))
    def metadata_delete(self, data, role, key):
        self._metadata_delete(self._pick_conn(data, role), key)

    @precondition(lambda self: has_writer(self) and self.log.state.metadata)
    @rule(data=st.data())
    def writer_deletes_metadata(self, data):
        key = data.draw(st.sampled_from(sorted(self.log.state.metadata)), label="key")
        self._metadata_delete(self.log.state.writer, key)

    @precondition(has_connections)
    @rule(data=st.data(), role=st.sampled_from(["writer", "any"]))
    def commit(self, data, role):
        conn = self._pick_conn(data, role)
        state = self.log.state
        code, _ = self._decide(lambda: decide_commit(state, conn))
        assert code == self.model.commit(conn)
        if code is None:
            # The shell closes a committed writer's connection.
            self.open_conns.discard(conn)
            self._append(decide_disconnect(self.log.state, conn))
            self._pump()

    # -- reads ----------------------------------------------------------------

    @precondition(has_connections)
    @rule(
        data=st.data(),
        role=READERISH,
        tag=st.sampled_from([None, *TAGS]),
        key=st.sampled_from(KEYS),
        prefix=st.sampled_from(["", "k", "k1", "x"]),
    )
    def read(self, data, role, tag, key, prefix):
        conn = self._pick_conn(data, role)
        alloc_id = self._known_allocation(data)
        state = self.log.state

        code, found = rejection_code(lambda: queries.get_allocation(state, conn, alloc_id))
        as_row = (found.size, found.aligned_size, found.tag, found.layout_slot) if found else None
        assert (code, as_row) == self.model.get_allocation(conn, alloc_id)

        code, rows = rejection_code(lambda: queries.list_allocations(state, conn, tag))
        ids = [a.allocation_id for a in rows] if rows is not None else None
        assert (code, ids) == self.model.list_allocations(conn, tag)

        code, entry = rejection_code(lambda: queries.get_metadata(state, conn, key))
        as_meta = (entry.allocation_id, entry.offset_bytes, entry.value) if entry else None
        assert (code, as_meta) == self.model.metadata_get(conn, key)

        code, keys = rejection_code(lambda: queries.list_metadata(state, conn, prefix))
        assert (code, keys) == self.model.metadata_list(conn, prefix)

    # -- after every step -----------------------------------------------------

    @invariant()
    def core_agrees_with_log_and_model(self):
        state = self.log.state
        check_invariants(state)
        assert self.log.replay() == state
        assert fold_all(self.events) == state
        model = self.model
        assert state.lock_state.value == model.state_name()
        assert (state.writer, set(state.readers), state.committed) == (
            model.writer,
            model.readers,
            model.committed,
        )
        assert {
            k: (a.size, a.aligned_size, a.tag, a.layout_slot) for k, a in state.allocations.items()
        } == model.allocs
        assert {
            k: (m.allocation_id, m.offset_bytes, m.value) for k, m in state.metadata.items()
        } == model.meta
        assert state.layout_hash == model.layout_hash
        assert state.next_layout_slot == model.next_slot
