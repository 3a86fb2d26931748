"""Hypothesis stateful machine against a real server over real sockets.

The machine runs the pure core beside the server: every request it sends is
also decided locally (with the ids and sizes the server returned), and lock
grants are predicted with :func:`gms.fsm.schedule`.  After every step it
waits until the server has logged as many events as the local log, then
checks that

* the server's answers matched the local decisions (including error codes
  and which waiting handshake got which lock);
* replaying the server's event history through the pure fold gives the local
  state (ids of connections aside) and satisfies every invariant;
* the runtime-state probe agrees, and the server's live memory handles are
  exactly the allocations of the folded state (count and bytes);
* readers see the bytes the writer wrote into each allocation (a checksum
  pattern written through a real mapping right after it was created).
"""

from __future__ import annotations

import hashlib
import os

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gms.fsm import (
    EMPTY_STATE,
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
    fold,
    queries,
    schedule,
    validate_allocate,
)
from gms.cuda import open_mapper
from gms.store import EventLog
from gms.wire import messages as m

from ..helpers import MiB, RawConn, ServerProcess, wait_until

LIMITS = Limits(max_allocations=6, max_metadata_keys=5, max_metadata_value_bytes=16)
SERVER_ARGS = (
    "--max-allocations", "6", "--max-metadata-keys", "5", "--max-metadata-value-bytes", "16",
)
KEYS = ["a", "b", "c", "d", "e", "f", ""]


NO_ANSWER = object()


def pattern(allocation) -> bytes:
    seed = f"{allocation.layout_slot}:{allocation.size}".encode()
    return (hashlib.sha256(seed).digest() * 2)[: min(64, allocation.size)]


def projection(state):
    """The state without connection ids (the server numbers its own)."""
    return (
        state.lock_state,
        len(state.readers),
        state.committed,
        dict(state.allocations),
        dict(state.metadata),
        state.layout_hash,
        state.next_layout_slot,
    )


class ServerMachine(RuleBasedStateMachine):
    # Set by the test: where servers are started, on which backend.
    tmp_path = None
    backend = "host"

    def __init__(self) -> None:
        super().__init__()
        self.server = ServerProcess(self.tmp_path, *SERVER_ARGS, backend=self.backend)
        self.expected = EventLog(retain=None)
        self.conns: dict[int, RawConn] = {}
        self.waiting: list[tuple[int, RequestedLockType]] = []
        self.next_conn = 1
        self.replica = EMPTY_STATE  # the server's history, folded here
        self.replica_seq = 0
        self.mapper = open_mapper(self.backend, 0)

    def teardown(self) -> None:
        for conn in self.conns.values():
            conn.close()
        self.server.kill()

    # -- helpers ---------------------------------------------------------------

    def _record(self, events) -> None:
        for event in events:
            self.expected.append(event)

    def _grant(self) -> list:
        grants = schedule(self.expected.state, self.waiting)
        for grant in grants:
            self._record([grant.event])
            self.waiting = [w for w in self.waiting if w[0] != grant.conn]
            response, _ = self.conns[grant.conn].recv(timeout=10)
            assert response.success and response.granted_lock_type == grant.granted.value
        return grants

    def _holder(self, data, role: str) -> int | None:
        state = self.expected.state
        if role == "writer" and state.writer is not None:
            return state.writer
        holders = sorted(c for c in self.conns if state.holds_lock(c))
        idle = sorted(c for c in self.conns if not state.holds_lock(c) and c not in dict(self.waiting))
        choices = holders + idle
        return data.draw(st.sampled_from(choices), label="conn") if choices else None

    def _agree(self, response, local):
        """Run the local decision or query and check the server agreed: both
        refused it with one code (NO_ANSWER), or both answered (the local result)."""
        try:
            result = local()
        except Rejection as rejection:
            assert isinstance(response, m.ErrorResponse), (response, rejection)
            assert response.code == rejection.code, (response, rejection)
            return NO_ANSWER
        assert not isinstance(response, m.ErrorResponse), (response, result)
        return result

    def _expect(self, response, decide) -> object:
        """Check the server's answer against a local decision; record its events (None if refused)."""
        events = self._agree(response, decide)
        if events is NO_ANSWER:
            return None
        self._record(events)
        return events

    def _through_mapping(self, fd: int, allocation, writable: bool, action):
        """Map an exported fd in this process, run ``action(va)``, unmap."""
        va = self.mapper.reserve(allocation.aligned_size)
        try:
            handle = self.mapper.map(fd, va, allocation.aligned_size, writable)
            try:
                return action(va)
            finally:
                self.mapper.unmap(va, allocation.aligned_size, handle)
        finally:
            self.mapper.free(va, allocation.aligned_size)

    # -- connections --------------------------------------------------------------

    @initialize()
    def first_writer(self):
        self.handshake(RequestedLockType.RW)

    @rule(lock=st.sampled_from(list(RequestedLockType)))
    def handshake(self, lock):
        conn = self.next_conn
        self.next_conn += 1
        self.conns[conn] = RawConn(self.server.socket)
        self.conns[conn].send(m.HandshakeRequest(lock.value))
        self.waiting.append((conn, lock))
        if not self._grant():
            # Queue order matters: let the server queue this one before the next.
            self._sync()

    @precondition(lambda self: self.conns)
    @rule(data=st.data())
    def close(self, data):
        conn = data.draw(st.sampled_from(sorted(self.conns)), label="conn")
        self.conns.pop(conn).close()
        self.waiting = [w for w in self.waiting if w[0] != conn]
        self._record(decide_disconnect(self.expected.state, conn))
        self._grant()

    # -- requests -------------------------------------------------------------------

    def _allocate(self, conn, size, tag):
        response = self.conns[conn].call(m.AllocateRequest(size, tag))
        state = self.expected.state
        if isinstance(response, m.ErrorResponse):
            self._expect(response, lambda: validate_allocate(state, conn, size, tag, LIMITS))
            return
        assert response.aligned_size >= size and response.aligned_size % (2 * MiB) == 0
        self._expect(
            response,
            lambda: decide_allocate(state, conn, response.allocation_id, size, response.aligned_size, tag, LIMITS),
        )
        allocation = self.expected.state.allocations[response.allocation_id]
        self.conns[conn].send(m.ExportAllocationRequest(allocation.allocation_id))
        _, (fd,) = self.conns[conn].recv()
        self._through_mapping(fd, allocation, True, lambda va: self.mapper.write(va, pattern(allocation)))

    @rule(data=st.data(), size=st.integers(-1, 6 * MiB), tag=st.sampled_from(["weights", "kv", ""]))
    def allocate(self, data, size, tag):
        conn = self._holder(data, "any")
        if conn is not None:
            self._allocate(conn, size, tag)

    # Writer-only rules with mostly valid arguments: without them most layouts
    # would be committed or dropped before they grew.
    @precondition(lambda self: self.expected.state.writer is not None)
    @rule(size=st.integers(1, 6 * MiB), tag=st.sampled_from(["weights", "kv"]))
    def writer_allocates(self, size, tag):
        self._allocate(self.expected.state.writer, size, tag)

    def _by_slot(self) -> list[str]:
        # Ids are random per run: draw by slot, so replays draw the same way.
        ordered = sorted(self.expected.state.allocations.values(), key=lambda a: a.layout_slot)
        return [a.allocation_id for a in ordered]

    def _allocation_id(self, data) -> str:
        return data.draw(st.sampled_from(self._by_slot() + ["missing"]), label="allocation")

    @rule(data=st.data())
    def free(self, data):
        conn = self._holder(data, "writer")
        if conn is None:
            return
        alloc_id = self._allocation_id(data)
        response = self.conns[conn].call(m.FreeAllocationRequest(alloc_id))
        state = self.expected.state
        self._expect(response, lambda: decide_free(state, conn, alloc_id))

    def _metadata_put(self, data, conn, key, alloc_id, value):
        allocation = self.expected.state.allocations.get(alloc_id)
        size = allocation.size if allocation else 1
        offset = data.draw(st.sampled_from([0, size - 1, size]) | st.integers(0, size - 1))
        response = self.conns[conn].call(m.MetadataPutRequest(key, alloc_id, offset, value))
        state = self.expected.state
        self._expect(response, lambda: decide_metadata_put(state, conn, key, alloc_id, offset, value, LIMITS))

    @rule(data=st.data(), key=st.sampled_from(KEYS), value=st.binary(max_size=18))
    def metadata_put(self, data, key, value):
        conn = self._holder(data, "writer")
        if conn is not None:
            self._metadata_put(data, conn, key, self._allocation_id(data), value)

    @precondition(lambda self: self.expected.state.writer is not None and self.expected.state.allocations)
    @rule(data=st.data(), key=st.sampled_from(KEYS[:-1]), value=st.binary(max_size=16))
    def writer_puts_metadata(self, data, key, value):
        alloc_id = data.draw(st.sampled_from(self._by_slot()), label="allocation")
        self._metadata_put(data, self.expected.state.writer, key, alloc_id, value)

    @rule(data=st.data(), key=st.sampled_from(KEYS))
    def metadata_delete(self, data, key):
        conn = self._holder(data, "writer")
        if conn is None:
            return
        response = self.conns[conn].call(m.MetadataDeleteRequest(key))
        state = self.expected.state
        events = self._expect(response, lambda: decide_metadata_delete(state, conn, key))
        if events is not None:
            assert response.deleted == bool(events)

    @rule(data=st.data())
    def commit(self, data):
        conn = self._holder(data, "writer")
        if conn is None:
            return
        response = self.conns[conn].call(m.CommitRequest())
        state = self.expected.state
        if self._expect(response, lambda: decide_commit(state, conn)) is not None:
            assert response.memory_layout_hash == self.expected.state.layout_hash
            assert self.conns.pop(conn).closed_by_peer()
            self._grant()

    @rule(data=st.data(), key=st.sampled_from(KEYS), prefix=st.sampled_from(["", "a", "z"]))
    def read(self, data, key, prefix):
        conn = self._holder(data, "reader")
        if conn is None:
            return
        c, state = self.conns[conn], self.expected.state
        alloc_id = self._allocation_id(data)

        entry = self._agree(
            c.call(m.MetadataGetRequest(key)), lambda: queries.get_metadata(state, conn, key)
        )
        if entry is not NO_ANSWER:
            expected = m.MetadataGetResponse(False)
            if entry is not None:
                expected = m.MetadataGetResponse(True, entry.allocation_id, entry.offset_bytes, entry.value)
            assert c.call(m.MetadataGetRequest(key)) == expected

        response = c.call(m.MetadataListRequest(prefix))
        keys = self._agree(response, lambda: queries.list_metadata(state, conn, prefix))
        if keys is not NO_ANSWER:
            assert response.keys == keys

        c.send(m.ExportAllocationRequest(alloc_id))
        response, fds = c.recv()
        try:
            allocation = self._agree(
                response, lambda: queries.get_allocation(state, conn, alloc_id)
            )
            if allocation is not NO_ANSWER:
                (fd,) = fds
                fds = []
                assert (response.size, response.aligned_size, response.layout_slot) == (
                    allocation.size, allocation.aligned_size, allocation.layout_slot,
                )
                if self.backend == "host":
                    assert os.fstat(fd).st_size == allocation.aligned_size
                seen = self._through_mapping(
                    fd, allocation, conn == state.writer,
                    lambda va: self.mapper.read(va, len(pattern(allocation))),
                )
                assert seen == pattern(allocation), "a reader must see the writer's bytes"
        finally:
            for fd in fds:
                os.close(fd)

    # -- after every step -------------------------------------------------------------

    def _waiting_counts(self) -> tuple[int, int]:
        writers = sum(1 for _, lock in self.waiting if lock is RequestedLockType.RW)
        return writers, len(self.waiting) - writers

    def _sync(self):
        """Wait until the server has logged and queued what the local model holds."""

        def caught_up():
            state = self.server.state()
            in_step = (state.waiting_writers, state.waiting_readers) == self._waiting_counts()
            return state if in_step and state.last_event_seq >= self.expected.last_seq else None

        return wait_until(caught_up, timeout=10, what=f"server to reach event {self.expected.last_seq}")

    @invariant()
    def server_agrees_with_the_pure_core(self):
        state = self._sync()
        for event in self.server.events(self.replica_seq):
            self.replica = fold(self.replica, event.to_event())
            self.replica_seq = event.seq
        expected = self.expected.state
        check_invariants(self.replica)
        assert self.replica_seq == self.expected.last_seq
        assert projection(self.replica) == projection(expected)
        assert (state.state, state.ro_session_count, state.committed) == (
            expected.lock_state.value, len(expected.readers), expected.committed,
        )
        assert (state.allocation_count, state.total_bytes, state.memory_layout_hash) == (
            len(expected.allocations), expected.total_bytes, expected.layout_hash or "",
        )
        assert (state.server_handle_count, state.server_handle_bytes) == (
            len(expected.allocations), expected.total_bytes,
        ), "server-owned memory must be exactly the folded layout"
