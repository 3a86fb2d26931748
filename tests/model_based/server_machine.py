"""Hypothesis stateful machine against a real server over real sockets.

The machine runs the pure core beside the server: every request it sends is
also decided locally (with the ids and sizes the server returned), lock
grants are predicted with :func:`gms.fsm.schedule`, evictions under the GPU
budget with :func:`gms.fsm.plan_evictions`.  The server holds two layouts
for three tenants; as root, each tenant is a real uid (a forked child with
that uid connects and hands the socket back), so the server knows them from
the kernel's peer credentials, as in production.  After every step it waits
until the server has logged as many events as the local log, then checks that

* the server's answers matched the local decisions (error codes included,
  quota refusals, which waiting handshake got which lock or the restore);
* replaying the server's event history through the pure fold gives the local
  state (connection ids aside) and satisfies every invariant;
* the runtime-state probe agrees, and the server's live memory handles are
  exactly the folded layouts' GPU allocations and host copies (count and bytes);
* readers see the bytes the writer wrote into each allocation, also after
  the layout was evicted to the host tier and restored (a checksum pattern
  written through real mappings, of device memory and of the host copies).

With ``copier`` the server runs its copier (and a small pool of 2 MiB
chunks): a ``system`` commit with host copies missing is filled by the
server (the host copies are recorded with the commit), and a restore is done
by the server while the reader waits in its handshake (the same events, a
plain ``RO`` answer); the bytes readers see then went through the copier.
The disk tier too (issue 52): a commit may ask to persist (the machine waits
for the server's ``SNAPSHOT_SAVED`` and folds it), an unpinned saved layout
is evicted to disk, and a reboot (every gms process stopped, ``gms serve``
again on the same socket and folders) brings every saved layout back on the
disk tier (``LAYOUT_RECOVERED``), whose first reader restores it from the
snapshot: the bytes it reads are the writer's.  An admin deletes a layout
from every tier (``LAYOUT_DELETED``).  And once an example, a new server takes
the old one's place (``gms serve --take-over``, pre-copied: the node sent while
the old one serves, the events since at the pause) with connections holding
and waiting: the local state goes on with the core's ``SERVER_RESUMED`` and
every check holds on the new server (under a keeper too: the kept machine).
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import tempfile
from pathlib import Path

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from gms.cuda import open_mapper
from gms.fsm import (
    EMPTY_NODE,
    OverLimit,
    PermissionDenied,
    Rejection,
    RequestedLockType,
    admit_allocation,
    admit_restore,
    check_invariants,
    decide_allocate,
    decide_commit,
    decide_delete,
    decide_disconnect,
    decide_evict,
    decide_free,
    decide_host_copy,
    decide_metadata_delete,
    decide_metadata_put,
    decide_restore_finished,
    decide_restore_loading,
    decide_resume,
    decide_session,
    fold,
    fold_all,
    opening,
    plan_evictions,
    queries,
    schedule,
    shown_kind,
)
from gms.fsm.events import (
    AllocationOomGaveUp,
    AllocationOomWait,
    LayoutRecovered,
    RestoreLoading,
    RoConnect,
    SessionClosed,
    SessionRefused,
)
from gms.operator.postmortem import row_event
from gms.store import EventLog
from gms.wire import messages as m

from ..helpers import MiB, RawConn, ServerProcess, connect_as, wait_until

BUDGET = 16 * MiB
HOST_BUDGET = 12 * MiB
AS_ROOT = os.geteuid() == 0
# name: (uid, quota, writes, reads)
TENANTS = {
    "t1": (23001, 12 * MiB, ["a", "b", "c"], []),
    "t2": (23002, None, ["b", "c"], ["a"]),
    "t0": (23003, 0, [], ["a"]),
}
# name: the policy's metadata_quota and max_layouts (others: the server's defaults)
TENANT_LIMITS = {"t1": (40, 1), "t2": (None, 1)}
POLICY = "".join(
    f'[[tenant]]\nname = "{name}"\nuids = [{uid}]\n'
    + (f"quota = {quota}\n" if quota is not None else "")
    + "".join(
        f"{key} = {value}\n"
        for key, value in zip(("metadata_quota", "max_layouts"), TENANT_LIMITS.get(name, (None, None)))
        if value is not None
    )
    + f"write = {writes!r}\nread = {reads!r}\n\n".replace("'", '"')
    for name, (uid, quota, writes, reads) in TENANTS.items()
)
SERVER_ARGS = (
    "--max-allocations", "6", "--max-metadata-keys", "5", "--max-metadata-value-bytes", "16",
    "--max-layouts", "2", "--gpu-budget", str(BUDGET), "--host-budget", str(HOST_BUDGET),
    "--max-metadata-bytes", "64",  # three or four entries of up to 19 bytes
    # Out of memory with nothing to evict: the server gives up soon instead of waiting.
    "--alloc-retry-timeout", "0.05", "--socket-mode", "666",
)
KEYS = ["a", "b", "c", "d", "e", "f", ""]
NO_ANSWER = object()


def same_figures(response: m.ErrorResponse, rejection: Rejection) -> None:
    """A named limit's refusal carries the same figures on the wire as in the core."""
    if isinstance(rejection, OverLimit):
        got = (response.limit, response.scope, response.used, response.asked, response.quota)
        assert got == (rejection.limit, rejection.scope, rejection.used, rejection.asked, rejection.bound), (
            response, rejection,
        )


def pattern(allocation) -> bytes:
    seed = f"{allocation.layout_slot}:{allocation.size}".encode()
    return (hashlib.sha256(seed).digest() * 2)[: min(64, allocation.size)]


def projection(state):
    """The state without connection ids (the server numbers its own)."""
    layouts = {
        name: (
            layout.lock_state, len(layout.readers), layout.restorer is not None, layout.committed,
            dict(layout.allocations), dict(layout.metadata), layout.layout_hash, layout.next_layout_slot,
            layout.residency, layout.tier, dict(layout.host_copies), layout.owner,
        )
        for name, layout in state.layouts.items()
    }
    tenants = {
        name: (t.used_bytes, t.sessions, t.metadata_bytes, t.layouts) for name, t in state.tenants.items()
    }
    return layouts, tenants, state.gpu_bytes, state.host_bytes, state.metadata_bytes, len(state.sessions)


class ServerMachine(RuleBasedStateMachine):
    # Set by the test: where servers are started, on which backend.
    tmp_path = None
    backend = "host"
    keeper = False  # under a keeper (test_kept_server_machine.py kills the server)
    copier = False

    def __init__(self) -> None:
        super().__init__()
        args = list(SERVER_ARGS)
        if AS_ROOT:
            policy = self.tmp_path / "policy.toml"
            policy.write_text(POLICY)
            args += ["--policy", str(policy)]
        if self.backend == "host":
            args += ["--host-capacity", "64MiB"]
        args += ["--host-pool", "4MiB", "--host-chunk", "2MiB"] if self.copier else ["--no-copier"]
        self.args = args
        self.conns: dict[int, RawConn] = {}
        self.tenant_of: dict[int, str] = {}
        self.waiting: dict[str, list[tuple[int, RequestedLockType]]] = {}
        self.next_conn = 1
        self.rebooted = False
        self.taken_over = False
        self.snapshots: dict[str, LayoutRecovered] = {}  # each saved file: what a cold start recovers of it
        self._serve()
        self.mapper = open_mapper(self.backend, 0)

    def _serve(self, socket_path: str | None = None) -> None:
        """A server (again on ``socket_path``: its disk tier's folder too), its log and replica from the start."""
        self.server = ServerProcess(
            self.tmp_path, *self.args, backend=self.backend, keeper=self.keeper, socket_path=socket_path,
        )
        self.expected = EventLog(retain=None)
        started = self.server.events()[0]
        self.expected.append(row_event(started.fields | {"kind": started.kind, "conn": started.conn}))
        self.replica = EMPTY_NODE  # the server's history, folded here
        self.replica_seq = 0
        self.replica_trail = [(0, EMPTY_NODE)]  # (seq, the replica after it): a restart may go back

    def teardown(self) -> None:
        for conn in self.conns.values():
            conn.close()
        self.server.kill()

    # -- helpers ---------------------------------------------------------------

    @property
    def state(self):
        return self.expected.state

    def _record(self, events) -> None:
        for event in events:
            self.expected.append(event)

    def _layout_of(self, conn: int) -> str:
        session = self.state.sessions.get(conn)
        return session.layout if session else "a"

    def _busy(self) -> set[str]:
        return {name for name, queue in self.waiting.items() if queue}

    def _grant(self, layout: str) -> None:
        """Predict the server's grants on ``layout`` and read each granted handshake's answer."""
        while True:
            queue = self.waiting.get(layout, [])
            grants = schedule(self.state.layout(layout), queue)
            if not grants and layout in queries.reverting(self.state):
                self._revert(layout)  # then its readers are granted
                continue
            if not grants:
                return
            for grant in grants:
                self._record([grant.event])
                self.waiting[layout] = [w for w in self.waiting[layout] if w[0] != grant.conn]
                if grant.restore and not self._load_restore(grant.conn, layout):
                    break  # the restorer gave up and left: schedule again
                response, _ = self.conns[grant.conn].recv(timeout=10)
                assert response.success and response.granted_lock_type == grant.granted.value
                assert response.restore == (grant.restore and not self.copier), "the copier restores"

    def _revert(self, layout: str) -> None:
        """A rebuild ended with no new commit and no writer waits: the server brings the
        layout back from the snapshot kept through it (off the request path: its event is
        waited for here), or leaves that snapshot on disk where the rules refuse it."""
        file = self.state.layout(layout).kept_file
        recovered = self.snapshots[file]

        def found():
            rows = [e for e in self.server.events(self.expected.last_seq) if e.layout == layout]
            return next((e for e in rows if e.kind in ("LAYOUT_RECOVERED", "SNAPSHOT_SET_ASIDE")), None)

        row = wait_until(found, timeout=30, what=f"{layout}'s kept snapshot brought back\n{self.server.log}")
        try:
            fold_all([recovered], self.state)
        except Rejection:
            assert (row.kind, row.fields["file"], row.fields["aside"]) == ("SNAPSHOT_SET_ASIDE", file, ""), row
            event("a rebuild ended with no new commit: its kept snapshot refused, left on disk")
            self._record([row_event(row.fields | {"kind": row.kind, "conn": row.conn})])
            return
        assert row.kind == "LAYOUT_RECOVERED", row
        event("a rebuild ended with no new commit: its kept snapshot came back")
        self._record([recovered])

    def _make_room(self, needed: int) -> bool:
        plan = plan_evictions(self.state, needed, self._busy())
        if plan is None:
            return False
        for name in plan:
            self._record(decide_evict(self.state, 0, name, "budget"))
        return True

    def _gave_up(self, conn: int, size: int, tag: str) -> None:
        layout = self._layout_of(conn)
        self._record([
            AllocationOomWait(conn, size, tag, layout=layout),
            AllocationOomGaveUp(conn, size, tag, "timeout", 50, layout=layout),
        ])

    def _load_restore(self, conn: int, layout: str) -> bool:
        """The server makes the restore's GPU memory, or gives up and closes."""
        size = self.state.layout(layout).held_bytes
        if self._make_room(admit_restore(self.state, RestoreLoading(conn, layout=layout))):
            self._record(decide_restore_loading(self.state, conn, layout))
            if self.copier:  # filled by the server's copier before the reader is answered
                self._record(decide_restore_finished(self.state, conn, layout))
            return True
        self._gave_up(conn, size, "restore")
        response, _ = self.conns[conn].recv(timeout=10)
        assert response.code == "OUT_OF_MEMORY"
        assert self.conns.pop(conn).closed_by_peer()
        self._record(decide_disconnect(self.state, conn))
        return False

    def _holder(self, data, role: str) -> int | None:
        state = self.state
        writers = [l.writer for l in state.layouts.values() if l.writer is not None]
        if role == "writer" and writers:
            return data.draw(st.sampled_from(sorted(writers)), label="writer")
        queued = {c for queue in self.waiting.values() for c, _ in queue}
        usable = sorted(c for c in self.conns if c not in queued)
        return data.draw(st.sampled_from(usable), label="conn") if usable else None

    def _agree(self, response, local):
        """Run the local decision or query and check the server agreed: both
        refused it with one code (NO_ANSWER), or both answered (the local result)."""
        try:
            result = local()
        except Rejection as rejection:
            assert isinstance(response, m.ErrorResponse), (response, rejection)
            assert response.code == rejection.code, (response, rejection)
            same_figures(response, rejection)
            return NO_ANSWER
        assert not isinstance(response, m.ErrorResponse), (response, result)
        return result

    def _expect(self, response, decide) -> object:
        """Check the server's answer against a local decision and the rules' verdict
        on it; record its events (None if refused)."""
        def judged():
            events = decide()
            fold_all(events, self.state)  # the rules refuse in the fold, as in the server
            return events

        events = self._agree(response, judged)
        if events is NO_ANSWER:
            return None
        self._record(events)
        return events

    def _through_mapping(self, fd: int, size: int, writable: bool, action, host: bool = False):
        """Map an exported fd in this process, run ``action(va)``, unmap."""
        va = self.mapper.reserve(size)
        try:
            handle = self.mapper.map_host(fd, va, size) if host else self.mapper.map(fd, va, size, writable)
            try:
                return action(va)
            finally:
                self.mapper.unmap(va, size, handle)
        finally:
            self.mapper.free(va, size)

    def _by_slot(self, layout: str) -> list[str]:
        # Ids are random per run: draw by slot, so replays draw the same way.
        ordered = sorted(self.state.layout(layout).allocations.values(), key=lambda a: a.layout_slot)
        return [a.allocation_id for a in ordered]

    def _allocation_id(self, data, layout: str) -> str:
        return data.draw(st.sampled_from(self._by_slot(layout) + ["missing"]), label="allocation")

    # -- connections --------------------------------------------------------------

    @initialize()
    def first_writer(self):
        self.handshake(RequestedLockType.RW, "a", "t1", None)

    @rule(
        lock=st.sampled_from(list(RequestedLockType)),
        layout=st.sampled_from(["a", "a", "b", "c"]),
        tenant=st.sampled_from(sorted(TENANTS)),
        limit=st.sampled_from([None, None, 4 * MiB, 20 * MiB]),
    )
    def handshake(self, lock, layout, tenant, limit):
        if not AS_ROOT:
            tenant = "default"
        uid, _, writes, reads = TENANTS.get(tenant, (None, None, ["a", "b", "c"], []))
        conn = self.next_conn
        self.next_conn += 1
        self.conns[conn] = connect_as(self.server.socket, uid)
        self.conns[conn].send(m.HandshakeRequest(lock.value, None, layout, limit))
        try:
            events = decide_session(
                self.state, conn, layout, lock, tenant=tenant,
                may_read=layout in writes + reads, may_write=layout in writes,
                uid=uid or 0, gid=uid or 0, pid=0, limit_bytes=limit,
            )
            fold_all(events, self.state)
        except Rejection as rejection:
            response, _ = self.conns[conn].recv()
            assert response.code == rejection.code, (response, rejection)
            same_figures(response, rejection)
            if isinstance(rejection, PermissionDenied):
                self._record([SessionRefused(conn, uid, uid, 0, rejection.message, layout="")])
            self.conns.pop(conn).close()
            return
        self.tenant_of[conn] = tenant
        requested = RequestedLockType(events[0].lock_type)
        first = None if self.waiting.get(layout) else next(
            iter(schedule(self.state.layout(layout), [(conn, requested)])), None)
        if first is not None and type(first.event) is RoConnect:  # a reader granted at once: one event
            joined, _ = opening(events[0], first)
            self._record(joined)
            response, _ = self.conns[conn].recv(timeout=10)
            assert response.success and response.granted_lock_type == "RO" and not response.restore
            return
        self._record(events)
        self.waiting.setdefault(layout, []).append((conn, requested))
        self._grant(layout)
        if any(conn in {c for c, _ in q} for q in self.waiting.values()):
            self._sync()  # queue order matters: let the server queue this one before the next

    @precondition(lambda self: _idle_saved(self.state))
    @rule(data=st.data())
    def rebuild(self, data):
        """Its owner writes a saved layout again: the seed's RW_CONNECT clears it, its
        snapshot stays until the new commit's is whole (issue 60)."""
        self._rebuild(data, data.draw(st.sampled_from(_idle_saved(self.state)), label="saved layout"))

    def _rebuild(self, data, name: str) -> None:
        owner, writer = self.state.layout(name).owner, self.next_conn
        self.handshake(RequestedLockType.RW, name, owner, None)
        then = data.draw(st.sampled_from(["builds on", "the node stops", "the writer leaves"]), label="then")
        if then == "the node stops" and not self.rebooted:
            self.reboot(data.draw(st.booleans(), label="read"))
        elif then == "the writer leaves" and self.state.layout(name).writer == writer:
            if data.draw(st.booleans(), label="a reader waits for its commit"):
                self.handshake(RequestedLockType.RO, name, owner, None)
            if data.draw(st.booleans(), label="after an allocation"):
                self._allocate(writer, 2 * MiB, "weights")
            self.close_conn(writer)  # RW_ABORT: its snapshot comes back (_revert), then the reader's grant

    @precondition(lambda self: self.conns)
    @rule(data=st.data())
    def close(self, data):
        conn = data.draw(st.sampled_from(sorted(self.conns)), label="conn")
        layout = self._layout_of(conn)
        self.conns.pop(conn).close()
        if layout in self.waiting:
            self.waiting[layout] = [w for w in self.waiting[layout] if w[0] != conn]
        self._record(decide_disconnect(self.state, conn))
        self._grant(layout)

    # -- requests -------------------------------------------------------------------

    def _allocate(self, conn, size, tag):
        self._check_allocation(conn, size, tag, self.conns[conn].call(m.AllocateRequest(size, tag)))

    def _check_allocation(self, conn, size, tag, response):
        """The local decision for an allocation the server answered with ``response``."""
        layout = self._layout_of(conn)
        aligned = -(-size // (2 * MiB)) * 2 * MiB if size > 0 else size
        allocation_id = getattr(response, "allocation_id", "refused")
        (proposed,) = decide_allocate(self.state.layout(layout), conn, allocation_id, size, aligned, tag)
        try:
            shortfall = admit_allocation(self.state, proposed)
        except Rejection as rejection:
            assert isinstance(response, m.ErrorResponse) and response.code == rejection.code, (response, rejection)
            return
        if not self._make_room(shortfall):
            assert response.code == "OUT_OF_MEMORY", response
            self._gave_up(conn, size, tag)
            return
        assert response.aligned_size == aligned, response
        self._record(decide_allocate(self.state.layout(layout), conn, allocation_id, size, aligned, tag))
        allocation = self.state.layout(layout).allocations[response.allocation_id]
        self.conns[conn].send(m.ExportAllocationRequest(allocation.allocation_id))
        _, (fd,) = self.conns[conn].recv()
        self._through_mapping(fd, allocation.aligned_size, True, lambda va: self.mapper.write(va, pattern(allocation)))

    @rule(data=st.data(), size=st.integers(-1, 6 * MiB), tag=st.sampled_from(["weights", "kv", ""]))
    def allocate(self, data, size, tag):
        conn = self._holder(data, "any")
        if conn is not None:
            self._allocate(conn, size, tag)

    # Writer-only rules with mostly valid arguments: without them most layouts
    # would be committed or dropped before they grew.
    @precondition(lambda self: any(l.writer is not None for l in self.state.layouts.values()))
    @rule(data=st.data(), size=st.integers(1, 6 * MiB), tag=st.sampled_from(["weights", "kv"]))
    def writer_allocates(self, data, size, tag):
        self._allocate(self._holder(data, "writer"), size, tag)

    @precondition(lambda self: sum(l.writer is not None for l in self.state.layouts.values()) >= 2)
    @rule(sizes=st.tuples(st.integers(1, 6 * MiB), st.integers(1, 6 * MiB)))
    def two_writers_allocate_at_once(self, sizes):
        """Two sessions' allocations in flight together: the server serves them
        interleaved across its awaits (each waits for the lane that makes its
        memory, and decides again after), so budget, quota and evictions must
        come out as one serial order of the two would have them."""
        writers = sorted(l.writer for l in self.state.layouts.values() if l.writer is not None)[:2]
        for conn, size in zip(writers, sizes):
            self.conns[conn].send(m.AllocateRequest(size, "kv"))
        responses = {conn: self.conns[conn].recv(timeout=10)[0] for conn in writers}
        # The server's log says which went first (conn numbers are its own: match by id).
        created = {
            e.fields["allocation_id"]: e.seq
            for e in self.server.events(self.expected.last_seq)
            if e.kind == "ALLOCATION_CREATED"
        }
        order = sorted(
            zip(writers, sizes), key=lambda w: created.get(getattr(responses[w[0]], "allocation_id", None), math.inf)
        )
        for conn, size in order:
            self._check_allocation(conn, size, "kv", responses[conn])

    @rule(data=st.data())
    def free(self, data):
        conn = self._holder(data, "writer")
        if conn is None:
            return
        alloc_id = self._allocation_id(data, self._layout_of(conn))
        response = self.conns[conn].call(m.FreeAllocationRequest(alloc_id))
        state = self.state.layout(self._layout_of(conn))
        self._expect(response, lambda: decide_free(state, conn, alloc_id))

    def _metadata_put(self, data, conn, key, alloc_id, value):
        allocation = self.state.layout(self._layout_of(conn)).allocations.get(alloc_id)
        size = allocation.size if allocation else 1
        offset = data.draw(st.sampled_from([0, size - 1, size]) | st.integers(0, size - 1))
        response = self.conns[conn].call(m.MetadataPutRequest(key, alloc_id, offset, value))
        state = self.state.layout(self._layout_of(conn))
        self._expect(response, lambda: decide_metadata_put(state, conn, key, alloc_id, offset, value))

    @rule(data=st.data(), key=st.sampled_from(KEYS), value=st.binary(max_size=18))
    def metadata_put(self, data, key, value):
        conn = self._holder(data, "writer")
        if conn is not None:
            self._metadata_put(data, conn, key, self._allocation_id(data, self._layout_of(conn)), value)

    @precondition(lambda self: any(l.writer is not None and l.allocations for l in self.state.layouts.values()))
    @rule(data=st.data(), count=st.integers(1, 3))
    def writer_fills_metadata(self, data, count):
        """Full-size values: the metadata quota and the node's bound are reached."""
        conn = self._holder(data, "writer")
        layout = self._layout_of(conn)
        for key in KEYS[:count]:
            if self.state.layout(layout).allocations:
                self._metadata_put(data, conn, key, self._by_slot(layout)[0], b"v" * 16)

    @rule(data=st.data(), key=st.sampled_from(KEYS))
    def metadata_delete(self, data, key):
        conn = self._holder(data, "writer")
        if conn is None:
            return
        response = self.conns[conn].call(m.MetadataDeleteRequest(key))
        state = self.state.layout(self._layout_of(conn))
        events = self._expect(response, lambda: decide_metadata_delete(state, conn, key))
        if events is not None:
            assert response.deleted == bool(events)

    @precondition(lambda self: any(l.writer is not None and l.allocations for l in self.state.layouts.values()))
    @rule(data=st.data())
    def writer_publishes_evictable(self, data):
        """What ``commit(residency="system")`` does: host copies, filled, then the commit."""
        conn = self._holder(data, "writer")
        self.host_copies(data, conn)
        self.commit(data, "system", conn=conn)

    @precondition(lambda self: self.copier and any(l.writer is not None for l in self.state.layouts.values()))
    @rule(data=st.data(), size=st.integers(1, 5 * MiB))
    def writer_publishes_through_the_copier(self, data, size):
        """One more allocation, then ``commit(residency="system")`` with host copies
        missing: the copier makes and fills them (the pool's 2 MiB chunks and the rest)."""
        conn = self._holder(data, "writer")
        self._allocate(conn, size, "weights")
        if conn in self.conns:
            self.commit(data, "system", conn=conn)

    @precondition(lambda self: any(l.writer is not None for l in self.state.layouts.values()))
    @rule(data=st.data())
    def host_copies(self, data, conn=None):
        """The writer asks for host copies of every allocation and fills them with the pattern."""
        conn = conn or self._holder(data, "writer")
        layout = self.state.layout(self._layout_of(conn))
        ids = self._by_slot(layout.name)
        if not ids:
            return
        self.conns[conn].send(m.ExportHostCopiesRequest(ids))
        response, fds = self.conns[conn].recv()
        new = [layout.allocations[i] for i in ids if i not in layout.host_copies]

        def decide():
            return [e for a in new for e in decide_host_copy(layout, conn, a.allocation_id)]

        if self._expect(response, decide) is None:
            return
        for info, fd in zip(response.allocations, fds):
            allocation = layout.allocations[info.allocation_id]
            self._through_mapping(
                fd, info.aligned_size, True, lambda va: self.mapper.write(va, pattern(allocation)), host=True
            )

    @rule(data=st.data(), residency=st.sampled_from(["device", "system", "unpinned"]), persist=st.booleans())
    def commit(self, data, residency, persist=False, conn=None):
        conn = conn or self._holder(data, "writer")
        if conn is None:
            return
        # Saved only through the copier; and not ``system``: a saved layout on the host
        # tier may spill to disk when host copies need room, which this machine does not model.
        persist = persist and self.copier and residency != "system"
        layout = self._layout_of(conn)
        response = self.conns[conn].call(m.CommitRequest(residency, True if persist else None))
        state = self.state.layout(layout)
        if self._expect(response, lambda: self._decide_commit(state, conn, residency, persist)) is not None:
            assert response.memory_layout_hash == self.state.layout(layout).layout_hash
            assert self.conns.pop(conn).closed_by_peer()
            self._record([SessionClosed(conn, layout=layout)])
            committed = self.state.layout(layout).loads
            self._grant(layout)
            if persist and self.state.layout(layout).loads == committed and self.state.layout(layout).committed:
                self._saved(layout)  # (a writer granted at once cleared it: the saver finds nothing to save)
                if layout in _idle_saved(self.state) and data.draw(st.booleans(), label="written again at once"):
                    self._rebuild(data, layout)

    def _saved(self, layout: str) -> None:
        """The server's saver, off the commit's path: wait for its SNAPSHOT_SAVED and fold it here."""
        def found():
            rows = [e for e in self.server.events(self.expected.last_seq) if e.layout == layout]
            return next((e for e in rows if e.kind in ("SNAPSHOT_SAVED", "SNAPSHOT_FAILED")), None)

        event = wait_until(found, timeout=30, what=f"{layout}'s snapshot\n{self.server.log}")
        assert event.kind == "SNAPSHOT_SAVED", event.fields
        self._record([row_event(event.fields | {"kind": event.kind, "conn": event.conn})])
        state = self.state.layout(layout)
        allocations, metadata = queries.snapshot_rows(state)
        self.snapshots[state.disk_file] = LayoutRecovered(
            0, state.owner, state.layout_hash, allocations, metadata, state.disk_bytes, state.disk_file,
            state.residency.value, layout=layout,
        )

    # One reboot an example at most: each costs a server's stop and start (about 2 s).
    @precondition(lambda self: not self.rebooted and any(
        layout.saved or layout.kept_file for layout in self.state.layouts.values()))
    @rule(read=st.booleans())
    def reboot(self, read):
        """Every gms process stopped, then ``gms serve`` again with the same socket and
        folders: each saved layout comes back committed on the disk tier, and one being
        rebuilt (or whose new commit is not saved yet) as its last whole snapshot had it
        (issue 60), nothing else; then (``read``) its owner reads the first of them,
        restored from its snapshot.  The stop comes before the clients leave: a stop
        lets no file go, whatever the sessions it ends."""
        self.rebooted = True
        before = self.state
        assert self.server.stop() == 0, self.server.log
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()
        self.waiting.clear()
        self.tenant_of.clear()
        self._serve(self.server.socket)
        for name, layout in sorted(before.layouts.items()):
            file = layout.disk_file or layout.kept_file
            if not file:
                continue
            if not layout.disk_file:
                event("a reboot in the middle of a rebuild: its last whole snapshot comes back")
            recovered = self.snapshots[file]
            try:
                fold_all([recovered], self.state)
            except Rejection:  # (the server leaves that snapshot on disk for a later start)
                continue
            self._record([recovered])
        recovered = sorted(self.state.layouts)
        if read and recovered:
            name = recovered[0]
            self.handshake(RequestedLockType.RO, name, self.state.layout(name).owner, None)

    # One take-over an example at most (each costs a server's start, about 1 s), once
    # connections hold or wait for something to carry.
    @precondition(lambda self: not self.taken_over and len(self.conns) > 1 and self.state.layouts)
    @rule()
    def take_over(self):
        """``gms serve --take-over`` between any two steps: every connection goes on,
        in whatever state it is, on a server that starts from the node the old one
        sent while serving and the events it logged since, sent at the pause (issue 59)."""
        self.taken_over = True
        self.server_agrees_with_the_pure_core()  # the replica at the old server's last event
        old = self.server
        old_pid = old.server_pid()
        self.server = ServerProcess(
            self.tmp_path, "--take-over", *self.args, backend=self.backend, keeper=self.keeper,
            socket_path=old.socket,
        )
        assert old.proc.wait(30) == 0, old.log
        wait_until(lambda: self.server.server_pid() != old_pid, what="the new server serving")
        (row,) = [e for e in self.server.events(self.expected.last_seq) if e.kind == "SERVER_RESUMED"]
        resumed = row_event(row.fields | {"kind": row.kind, "conn": row.conn})
        assert (resumed.mode, resumed.old_pid, row.seq) == ("take-over", old_pid, self.expected.last_seq + 1)
        self._record(decide_resume(self.state, resumed))

    def _decide_commit(self, state, conn, residency, persist=False):
        """The commit; with a copier, a ``system`` one makes the missing host copies
        first (``gms.server.service.transfers``: recorded with it, all or nothing)."""
        (commit,) = decide_commit(state, conn, residency, persist)
        if not (self.copier and residency == "system"):
            return [commit]
        missing = [i for i in self._by_slot(state.name) if i not in state.host_copies]
        return [e for i in missing for e in decide_host_copy(state, conn, i)] + [commit]

    @rule(layout=st.sampled_from(["a", "b"]))
    def evict(self, layout):
        """An admin's ``gms evict`` (this process is root or the server's uid)."""
        response = RawConn(self.server.socket).call(m.EvictRequest(layout))
        self._expect(response, lambda: decide_evict(self.state, 0, layout, "admin"))
        self._grant(layout)

    @rule(layout=st.sampled_from(["a", "b"]))
    def delete(self, layout):
        """An admin's ``gms delete``: the layout from every tier, its snapshot too."""
        response = RawConn(self.server.socket).call(m.DeleteRequest(layout))
        self._expect(response, lambda: decide_delete(self.state, 0, os.getuid(), layout))
        self._grant(layout)

    @precondition(
        lambda self: any(
            l.residency.value == "system" and l.tier.value == "device" and not l.readers
            for l in self.state.layouts.values()
        )
    )
    @rule(data=st.data())
    def evict_then_read(self, data):
        """An evictable layout goes to the host tier; a reader then brings it back."""
        names = sorted(
            n for n, l in self.state.layouts.items()
            if l.residency.value == "system" and l.tier.value == "device" and not l.readers
        )
        name = data.draw(st.sampled_from(names), label="layout")
        self.evict(name)
        self.handshake(RequestedLockType.RO, name, "t1", None)

    @precondition(lambda self: any(l.restorer is not None and l.tier.value == "restoring" for l in self.state.layouts.values()))
    @rule(data=st.data(), finish=st.booleans())
    def restore(self, data, finish):
        """The restorer copies every host copy into the new GPU memory and says so, or leaves."""
        restoring = sorted(l.restorer for l in self.state.layouts.values() if l.restorer is not None)
        conn = data.draw(st.sampled_from(restoring), label="restorer")
        layout = self._layout_of(conn)
        if not finish:
            self.close_conn(conn)
            return
        c = self.conns[conn]
        ids = self._by_slot(layout)
        c.send(m.ExportAllocationsRequest(ids))
        gpu, gpu_fds = c.recv()
        c.send(m.ExportHostCopiesRequest(ids))
        host, host_fds = c.recv()
        for g, h, gfd, hfd in zip(gpu.allocations, host.allocations, gpu_fds, host_fds):
            data_ = self._through_mapping(hfd, h.aligned_size, False, lambda va, g=g: self.mapper.read(va, g.aligned_size), host=True)
            self._through_mapping(gfd, g.aligned_size, True, lambda va, d=data_: self.mapper.write(va, d))
        response = c.call(m.RestoreDoneRequest())
        self._expect(response, lambda: decide_restore_finished(self.state, conn, layout))
        self._grant(layout)

    def close_conn(self, conn: int) -> None:
        layout = self._layout_of(conn)
        self.conns.pop(conn).close()
        self._record(decide_disconnect(self.state, conn))
        self._grant(layout)

    @rule(data=st.data(), key=st.sampled_from(KEYS), prefix=st.sampled_from(["", "a", "z"]))
    def read(self, data, key, prefix):
        conn = self._holder(data, "reader")
        if conn is None:
            return
        c = self.conns[conn]
        state = self.state.layout(self._layout_of(conn))
        alloc_id = self._allocation_id(data, state.name)

        entry = self._agree(c.call(m.MetadataGetRequest(key)), lambda: queries.get_metadata(state, conn, key))
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
            allocation = self._agree(response, lambda: queries.get_allocation(state, conn, alloc_id))
            if allocation is not NO_ANSWER and conn != state.restorer:
                (fd,) = fds
                fds = []
                assert (response.size, response.aligned_size, response.layout_slot) == (
                    allocation.size, allocation.aligned_size, allocation.layout_slot,
                )
                if self.backend == "host":
                    assert os.fstat(fd).st_size == allocation.aligned_size
                seen = self._through_mapping(
                    fd, allocation.aligned_size, conn == state.writer,
                    lambda va: self.mapper.read(va, len(pattern(allocation))),
                )
                assert seen == pattern(allocation), "a reader must see the writer's bytes"
        finally:
            for fd in fds:
                os.close(fd)

    # -- after every step -------------------------------------------------------------

    def _sync(self):
        """Wait until the server has logged and queued what the local model holds."""
        waiting = sum(len(q) for q in self.waiting.values())

        def caught_up():
            state = self.server.state()
            return state if state.waiting == waiting and state.last_event_seq >= self.expected.last_seq else None

        return wait_until(caught_up, timeout=10, what=f"server to reach event {self.expected.last_seq}")

    @invariant()
    def server_agrees_with_the_pure_core(self):
        runtime = self._sync()
        events = self.server.events(self.replica_seq)
        replica = self.replica
        for event in events:
            # Each row in the seed's words, the kind the log holds beside it where they differ;
            # folding what it was logged as rebuilds the state (below).
            assert event.kind == shown_kind(event.logged_as or event.kind) != event.logged_as, event
            replica = fold(replica, event.to_event())
            self.replica_seq = event.seq
            self.replica_trail.append((event.seq, replica))
        self.replica = replica
        expected = self.state
        check_invariants(replica)
        assert self.replica_seq == self.expected.last_seq
        assert projection(replica) == projection(expected)
        for name, layout in expected.layouts.items():
            row = runtime.layout(name)
            assert (row.state, row.readers, row.committed, row.tier, row.residency) == (
                layout.lock_state.value, len(layout.readers), layout.committed, layout.tier.value,
                layout.residency.value,
            )
            assert (row.allocation_count, row.bytes, row.memory_layout_hash) == (
                len(layout.allocations), layout.held_bytes, layout.layout_hash or "",
            )
        gpu = [a for l in expected.layouts.values() if l.gpu_bytes for a in l.allocations.values()]
        host = [s for l in expected.layouts.values() for s in l.host_copies.values()]
        assert (runtime.server_handle_count, runtime.server_handle_bytes) == (
            len(gpu), sum(a.aligned_size for a in gpu),
        ), "server-owned device memory must be exactly the folded layouts'"
        assert (runtime.host_handle_count, runtime.host_handle_bytes) == (len(host), sum(host))
        assert runtime.used_bytes == expected.gpu_bytes <= BUDGET


def _idle_saved(state) -> list[str]:
    return sorted(name for name, layout in state.layouts.items() if layout.saved and layout.lock_state.value == "COMMITTED")


def run_machine(machine: type[ServerMachine], backend: str, copier: bool, examples: int, steps: int) -> None:
    """Run a server machine in a folder tenants of other uids may enter
    (pytest's own folders are private to root)."""
    folder = tempfile.mkdtemp(prefix="gms-machine-", dir="/tmp")
    os.chmod(folder, 0o755)
    try:
        bound = type("Machine", (machine,), {"tmp_path": Path(folder), "backend": backend, "copier": copier})
        run_state_machine_as_test(
            bound, settings=settings(max_examples=examples, stateful_step_count=steps, deadline=None)
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
