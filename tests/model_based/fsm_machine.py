"""Hypothesis stateful machine over the pure core: one node, several layouts, several tenants.

Drives many connections, as three tenants with different quotas, metadata
quotas, layout bounds and rights, through random handshakes (RW, RO, RW_OR_RO, with and without a session
limit) on two layouts (and a third the layout cap refuses), crashes,
allocations (evicting under a GPU budget the way the shell does), frees,
metadata puts and deletes, host copies, commits with each residency (and
persisting or not), snapshots saved (within the disk budget and quotas, or
refused), evictions (an unpinned layout with a snapshot to the disk tier), admin deletes,
pins, restores from the host tier or the disk (finished or abandoned), reads,
and reboots (a new log: every snapshot recovered, or refused by the policy in
force), the way the shell does: decide, append to the log, fold.  After every
step it checks:

* the node's invariants (the fold's running totals against the tables);
* that replaying the log (from its snapshot, and from the first event)
  gives the live state;
* that an independent reference model agrees on every layout's lock table,
  tables, residency and tier, on every answer and refusal code, on who is
  granted what, on each tenant's charge (bytes, metadata bytes, layouts) and
  the GPU, host and metadata totals, and on which layouts LRU eviction picks.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gms.fsm import (
    RULES,
    Limits,
    Rejection,
    RequestedLockType,
    admit_allocation,
    admit_restore,
    check_invariants,
    decide_allocate,
    decide_commit,
    decide_disconnect,
    decide_delete,
    decide_evict,
    decide_free,
    decide_host_copy,
    decide_metadata_delete,
    decide_metadata_put,
    decide_pin,
    decide_restore_finished,
    decide_restore_loading,
    decide_resume,
    decide_session,
    decide_spill,
    fold,
    fold_all,
    opening,
    plan_evictions,
    queries,
    schedule,
    turned_away,
)
from gms.fsm.events import (
    LayoutRecovered,
    LockTimeout,
    ReaderJoined,
    ReaderLeft,
    RestoreClaimed,
    RestoreLoading,
    RoDisconnect,
    RwConnect,
    ServerResumed,
    ServerStarted,
    SessionClosed,
    SnapshotFailed,
    SnapshotSaved,
    SnapshotSetAside,
)
from gms.fsm.folding import layout_recovered
from gms.fsm.state import LayoutState
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
    max_layouts=2,
    max_metadata_bytes=28,  # two or three entries of up to 16 bytes (6-byte keys, 8-byte values, 2 each)
    metadata_entry_bytes=2,  # an entry's own charge, besides its bytes
)
BUDGET = 16 * MiB
HOST_BUDGET = 12 * MiB
# name: (quota, layouts it may write, layouts it may read)
TENANTS = {
    "t1": (12 * MiB, {"a", "b", "c"}, set()),
    "t2": (None, {"b", "c"}, {"a"}),
    "t0": (0, set(), {"a"}),
}
# name: (metadata quota, max layouts); None: unbounded
TENANT_LIMITS = {"t1": (18, 2), "t2": (None, 1), "t0": (0, 0)}
DISK_BUDGET = 24 * MiB
DISK_QUOTAS = {"t1": 8 * MiB, "t2": None, "t0": 0}
LAYOUTS = ["a", "b"]
KEYS = ["k0", "k1", "k2", "k3", "k4", "", "too-long-key"]
TAGS = ["weights", "kv_cache", "", "much-too-long"]
RESIDENCIES = ["device", "system", "unpinned"]
WRITERISH = st.sampled_from(["writer", "writer", "writer", "any"])
READERISH = st.sampled_from(["reader", "reader", "writer", "any"])
SIZES = st.sampled_from([-1, 0, 1, 4096, GRANULARITY - 1, GRANULARITY, 3 * GRANULARITY]) | (
    st.integers(1, 8 * MiB)
)


def aligned(size: int) -> int:
    return -(-size // GRANULARITY) * GRANULARITY if size > 0 else 0


def rejection_code(thunk):
    try:
        return None, thunk()
    except Rejection as rejection:
        return rejection.code, None


def has_connections(machine) -> bool:
    return bool(machine.sessions)


def has_writer(machine) -> bool:
    return any(machine.log.state.layout(name).writer is not None for name in LAYOUTS)


class FsmMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        # The policy in force: a new server's (``new_policy``) replaces it.
        self.quotas = {name: quota for name, (quota, _, _) in TENANTS.items()}
        self.tenant_limits = dict(TENANT_LIMITS)
        self.snapshots: dict[str, LayoutRecovered] = {}  # each saved file: what a cold start recovers of it
        self._start()
        self.clock = 0

    def _start(self) -> None:
        """A node that starts with nothing (the first, and after each reboot).
        Tiny retention, so replay goes through snapshots and cut chunks."""
        self.totals: dict[str, tuple[int, int, int]] = {}  # each tenant's bytes, metadata, layouts after the last step
        self.log = EventLog(retain=24, chunk_size=4)
        self.events = []
        self._append([
            ServerStarted(
                0, 64 * MiB, BUDGET, HOST_BUDGET, self.quotas, LIMITS.as_dict(), layout="",
                tenant_limits=self._limits_field(), disk_budget_bytes=DISK_BUDGET,
            )
        ])
        self.refs = {
            name: ReferenceModel(
                LIMITS.max_allocations,
                LIMITS.max_metadata_keys,
                LIMITS.max_metadata_value_bytes,
                LIMITS.max_key_bytes,
                LIMITS.max_tag_bytes,
            )
            for name in [*LAYOUTS, "c"]
        }
        self.sessions: dict[int, tuple[str, str, int | None]] = {}  # conn -> layout, tenant, limit
        self.locks: dict[int, str] = {}  # conn -> the lock its session waits for or holds (RW, RO, RW_OR_RO)
        self.waiting: dict[str, list[tuple[int, RequestedLockType]]] = {name: [] for name in self.refs}
        self.next_conn = getattr(self, "next_conn", 1)
        self.next_alloc = getattr(self, "next_alloc", 0)

    # -- helpers ----------------------------------------------------------

    def _limits_field(self) -> dict:
        return {
            name: {"metadata_quota": meta, "max_layouts": most, "disk_quota": DISK_QUOTAS[name]}
            for name, (meta, most) in self.tenant_limits.items()
        }

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _append(self, events) -> None:
        """Append atomically, as the shell does; each event moves its layout only
        along a move its rule declares (the table is the whole truth)."""
        events = list(events)
        before = self.log.state
        self.log.extend(events)
        self.events.extend(events)
        for event in events:
            after = fold(before, event)
            rule = RULES.get(type(event))
            if rule is not None and event.layout:
                was, now = before.layout(event.layout), after.layout(event.layout)
                assert (was.lock_state, now.lock_state) in {(m.before, m.after) for m in rule.moves}, event
                assert (was.tier, now.tier) in {(m.before, m.after) for m in rule.tier_moves}, event
            before = after

    def _tenant_layouts(self, tenant: str) -> set[str]:
        """Restated from docs/operations.md: the layouts a tenant owns, and those
        its sessions may write (RW, RW_OR_RO) from their handshake on."""
        owned = {name for name, ref in self.refs.items() if ref.owner == tenant}
        writing = {
            self.sessions[c][0] for c, lock in self.locks.items() if lock != "RO" and self.sessions[c][1] == tenant
        }
        return owned | writing

    def _metadata_used(self, tenant: str | None = None) -> int:
        return sum(
            len(key.encode()) + len(value) + LIMITS.metadata_entry_bytes
            for ref in self.refs.values() if tenant is None or ref.owner == tenant
            for key, (_, _, value) in ref.meta.items()
        )

    def _layout_of(self, conn: int) -> str:
        return self.sessions[conn][0] if conn in self.sessions else "a"

    def _pump(self, layout: str) -> None:
        """Grant what can be granted, and answer the readers nothing will grant (their
        handshakes end: LOCK_TIMEOUT saying why, as the shell records it)."""
        state = self.log.state.layout(layout)
        grants = schedule(state, self.waiting[layout])
        away = turned_away(state, self.waiting[layout])
        self._append([g.event for g in grants])
        ended = {g.conn for g in grants} | set(away)
        self.waiting[layout] = [w for w in self.waiting[layout] if w[0] not in ended]
        got = [(g.conn, "RESTORE" if g.restore else g.granted.value) for g in grants]
        assert got == self.refs[layout].pump(self._tick, lambda c: self.sessions[c][1])
        assert away == self.refs[layout].turn_away(), (layout, away)
        self._append([LockTimeout(conn, "RO", 0, state.unserved, layout=layout) for conn in away])

    def _pick_conn(self, data, role: str = "any") -> int:
        """``any`` also picks connections that hold no lock (0 never handshakes)."""
        state = self.log.state
        if role == "writer":
            writers = [state.layout(n).writer for n in LAYOUTS if state.layout(n).writer is not None]
            if writers:
                return data.draw(st.sampled_from(writers), label="writer")
        if role == "reader":
            readers = sorted(r for n in LAYOUTS for r in state.layout(n).readers)
            if readers:
                return data.draw(st.sampled_from(readers), label="reader")
        return data.draw(st.sampled_from([0, *sorted(self.sessions)]), label="conn")

    def _decide(self, thunk):
        """Decide, then append: a refusal may come from either (the rules run in the fold)."""
        def decide_and_append():
            events = thunk()
            self._append(events)
            return events

        return rejection_code(decide_and_append)

    def _known_allocation(self, data, layout: str) -> str:
        ids = sorted(self.log.state.layout(layout).allocations) + ["missing"]
        return data.draw(st.sampled_from(ids), label="allocation_id")

    def _busy(self) -> set[str]:
        return {name for name, queue in self.waiting.items() if queue}

    def _expected_evictions(self, needed: int) -> list[str] | None:
        """LRU over idle evictable layouts, restated from the docs."""
        candidates = sorted(
            (ref.last_use, name) for name, ref in self.refs.items()
            if name not in self._busy() and ref.evictable() is None
        )
        chosen = []
        for _, name in candidates:
            if needed <= 0:
                break
            chosen.append(name)
            needed -= self.refs[name].gpu_bytes()
        return chosen if needed <= 0 else None

    def _make_room(self, needed: int) -> bool:
        """The shell's response to a shortfall: evict LRU idle layouts, or wait."""
        plan = plan_evictions(self.log.state, needed, self._busy())
        assert plan == self._expected_evictions(needed)
        if plan is None:
            return False  # the shell waits for memory (backpressure)
        for name in plan:
            self._append(decide_evict(self.log.state, 0, name, "budget"))
            assert self.refs[name].evict() is None
        return True

    # -- connections --------------------------------------------------------

    def _open(self, conn, layout, lock, tenant, may_read, may_write, limit, older) -> list:
        """The handshake's events as the core records them: its session, and its
        grant when nobody waits ahead (a reader's in one event; ``older``: in the
        two an older server recorded, which a log may still hold)."""
        (opened,) = decide_session(
            self.log.state, conn, layout, lock, tenant=tenant, may_read=may_read,
            may_write=may_write, uid=1000, gid=1000, pid=conn, limit_bytes=limit,
        )
        grant = None
        if not self.waiting[layout]:
            grant = next(iter(schedule(self.log.state.layout(layout), [(conn, RequestedLockType(opened.lock_type))])),
                         None)
        events, _ = opening(opened, grant)
        return [opened, grant.event] if older and type(events[0]) is ReaderJoined else events

    @rule(
        layout=st.sampled_from(["a", "a", "b", "b", "c"]),
        lock=st.sampled_from(list(RequestedLockType)),
        tenant=st.sampled_from(sorted(TENANTS)),
        limit=st.sampled_from([None, None, None, 0, 4 * MiB, 20 * MiB]),
        older=st.booleans(),
    )
    def handshake(self, layout, lock, tenant, limit, older):
        conn = self.next_conn
        self.next_conn += 1
        _, writes, reads = TENANTS[tenant]
        quota = self.quotas[tenant]
        may_write, may_read = layout in writes, layout in reads | writes
        code, events = self._decide(lambda: self._open(conn, layout, lock, tenant, may_read, may_write, limit, older))
        effective = "RO" if lock is RequestedLockType.RW_OR_RO and not may_write else lock.value
        expected = None
        if (effective == "RW" and not may_write) or (effective == "RO" and not may_read):
            expected = "PERMISSION_DENIED"
        elif limit is not None and quota is not None and limit > quota:
            expected = "INVALID_ARGUMENT"
        elif (
            effective != "RO"
            and self.tenant_limits[tenant][1] is not None
            and layout not in self._tenant_layouts(tenant)
            and len(self._tenant_layouts(tenant)) >= self.tenant_limits[tenant][1]
        ):
            expected = "LIMIT_EXCEEDED"  # the tenant's max_layouts
        elif effective != "RO" and self.refs[layout].vacant() and sum(
            not ref.vacant() for ref in self.refs.values()
        ) >= LIMITS.max_layouts:
            expected = "LIMIT_EXCEEDED"
        assert code == expected
        if code is not None:
            return
        opened, *granted = events
        assert opened.lock_type == effective
        self.sessions[conn] = (layout, tenant, limit)
        self.locks[conn] = effective
        self.refs[layout].queue.append((conn, effective))
        if type(opened) is ReaderJoined or granted:  # granted at once: the reference grants it too
            event = granted[0] if granted else opened
            got = {RestoreClaimed: "RESTORE", RwConnect: "RW"}.get(type(event), "RO")
            assert [(conn, got)] == self.refs[layout].pump(self._tick, lambda c: self.sessions[c][1])
        else:
            self.waiting[layout].append((conn, RequestedLockType(effective)))
            self._pump(layout)

    @precondition(has_connections)
    @rule(data=st.data(), older=st.booleans())
    def disconnect(self, data, older):
        """A close, a crash, a dropped connection, a timed-out waiter or a revoke
        (a reader's in one event; ``older``: in the two an older server recorded)."""
        self._disconnect(data.draw(st.sampled_from(sorted(self.sessions)), label="conn"), older)

    def _disconnect(self, conn, older=False):
        layout = self.sessions[conn][0]
        self.waiting[layout] = [w for w in self.waiting[layout] if w[0] != conn]
        events = decide_disconnect(self.log.state, conn)
        if older and [type(e) for e in events] == [ReaderLeft]:
            events = [RoDisconnect(conn, layout=layout), SessionClosed(conn, layout=layout)]
        self._append(events)
        expected = self.refs[layout].disconnect(conn, self._tick)
        kinds = ["READER_LEFT"] if expected == "RO_DISCONNECT" and not older else (
            ([expected] if expected else []) + ["SESSION_CLOSED"])
        assert [e.KIND for e in events] == kinds
        del self.sessions[conn]
        del self.locks[conn]
        self._pump(layout)

    # -- layout requests ------------------------------------------------------

    def _allocate(self, conn, size, tag):
        alloc_id = f"a{self.next_alloc}"
        self.next_alloc += 1
        layout = self._layout_of(conn)
        ref = self.refs[layout]
        expected = ref.allocate(conn, alloc_id, size, aligned(size), tag)
        if expected is None:
            del ref.allocs[alloc_id]  # decided below, after the node's checks
            ref.next_slot -= 1
            _, tenant, limit = self.sessions[conn]
            quota = self.quotas[tenant]
            used = sum(r.bytes() for r in self.refs.values() if r.owner == tenant)
            if limit is not None and ref.bytes() + aligned(size) > limit:
                expected = "QUOTA_EXCEEDED"
            elif quota is not None and used + aligned(size) > quota:
                expected = "QUOTA_EXCEEDED"
            elif ref.bytes() + aligned(size) > BUDGET:
                expected = "BUDGET_EXCEEDED"
        state = self.log.state
        (proposed,) = decide_allocate(state.layout(layout), conn, alloc_id, size, aligned(size), tag)
        code, shortfall = rejection_code(lambda: admit_allocation(state, proposed))
        assert code == expected
        if code is not None or not self._make_room(shortfall):
            return
        # As the shell: decided again after the wait (here, the evictions).
        self._append(decide_allocate(self.log.state.layout(layout), conn, alloc_id, size, aligned(size), tag))
        assert ref.allocate(conn, alloc_id, size, aligned(size), tag) is None

    def _free(self, conn, alloc_id):
        layout = self._layout_of(conn)
        code, _ = self._decide(lambda: decide_free(self.log.state.layout(layout), conn, alloc_id))
        assert code == self.refs[layout].free(conn, alloc_id)

    def _metadata_put(self, data, conn, key, alloc_id, value):
        layout = self._layout_of(conn)
        allocation = self.log.state.layout(layout).allocations.get(alloc_id)
        size = allocation.size if allocation else 1
        offset = data.draw(
            st.sampled_from([-1, 0, size - 1, size, size + 1]) | st.integers(0, size - 1),
            label="offset",
        )
        state = self.log.state.layout(layout)
        code, _ = self._decide(lambda: decide_metadata_put(state, conn, key, alloc_id, offset, value))
        ref = self.refs[layout]
        old = ref.meta.get(key)
        expected = ref.metadata_put(conn, key, alloc_id, offset, value)
        if expected is None:
            more = len(key.encode()) + len(value) - (
                len(key.encode()) + len(old[2]) if old else -LIMITS.metadata_entry_bytes
            )
            meta_quota = self.tenant_limits[ref.owner][0]
            if more > 0:  # judged with the entry taken back out
                if old is None:
                    del ref.meta[key]
                else:
                    ref.meta[key] = old
                if meta_quota is not None and self._metadata_used(ref.owner) + more > meta_quota:
                    expected = "LIMIT_EXCEEDED"  # the tenant's metadata quota
                elif self._metadata_used() + more > LIMITS.max_metadata_bytes:
                    expected = "LIMIT_EXCEEDED"  # the node's metadata bound
                else:
                    ref.meta[key] = (alloc_id, offset, value)
        assert code == expected

    @precondition(has_connections)
    @rule(data=st.data(), role=WRITERISH, size=SIZES, tag=st.sampled_from(TAGS))
    def allocate(self, data, role, size, tag):
        conn = self._pick_conn(data, role)
        if conn in self.sessions:
            self._allocate(conn, size, tag)

    @precondition(has_writer)
    @rule(data=st.data(), size=st.integers(1, 6 * MiB), tag=st.sampled_from(TAGS[:2]))
    def writer_allocates(self, data, size, tag):
        self._allocate(self._pick_conn(data, "writer"), size, tag)

    @precondition(has_connections)
    @rule(data=st.data(), role=WRITERISH)
    def free(self, data, role):
        conn = self._pick_conn(data, role)
        self._free(conn, self._known_allocation(data, self._layout_of(conn)))

    @precondition(has_connections)
    @rule(
        data=st.data(),
        role=WRITERISH,
        key=st.sampled_from(KEYS),
        value=st.binary(max_size=LIMITS.max_metadata_value_bytes + 2),
    )
    def metadata_put(self, data, role, key, value):
        conn = self._pick_conn(data, role)
        self._metadata_put(data, conn, key, self._known_allocation(data, self._layout_of(conn)), value)

    @precondition(has_writer)
    @rule(
        data=st.data(),
        key=st.sampled_from(KEYS[:5]),
        value=st.binary(max_size=LIMITS.max_metadata_value_bytes),
        fill=st.sampled_from([0, 0, 2, 3]),
    )
    def writer_puts_metadata(self, data, key, value, fill):
        """``fill``: that many full-size values too, so the metadata quotas and
        the node's bound are reached."""
        conn = self._pick_conn(data, "writer")
        allocations = sorted(self.log.state.layout(self._layout_of(conn)).allocations)
        if allocations:
            alloc_id = data.draw(st.sampled_from(allocations), label="allocation")
            self._metadata_put(data, conn, key, alloc_id, value)
            for n in range(fill):
                self._metadata_put(data, conn, KEYS[n], allocations[0], b"v" * LIMITS.max_metadata_value_bytes)

    @precondition(has_connections)
    @rule(data=st.data(), role=WRITERISH, key=st.sampled_from(KEYS))
    def metadata_delete(self, data, role, key):
        conn = self._pick_conn(data, role)
        layout = self._layout_of(conn)
        state = self.log.state.layout(layout)
        code, events = self._decide(lambda: decide_metadata_delete(state, conn, key))
        assert (code, bool(events)) == self.refs[layout].metadata_delete(conn, key)

    @precondition(has_writer)
    @rule(data=st.data(), everything=st.booleans())
    def host_copies(self, data, everything):
        conn = self._pick_conn(data, "writer")
        layout = self._layout_of(conn)
        ids = sorted(self.log.state.layout(layout).allocations)
        chosen = ids if everything else ids[:1] + ["missing"]
        for alloc_id in chosen:
            allocation = self.log.state.layout(layout).allocations.get(alloc_id)
            fresh = allocation is not None and alloc_id not in self.log.state.layout(layout).host_copies
            host_used = sum(r.host_bytes() for r in self.refs.values())
            code, _ = self._decide(lambda: decide_host_copy(self.log.state.layout(layout), conn, alloc_id))
            if fresh and host_used + allocation.aligned_size > HOST_BUDGET:
                assert code == "HOST_MEMORY_EXHAUSTED"
                continue
            assert code == self.refs[layout].host_copy(conn, alloc_id)

    @precondition(
        lambda self: any(self.log.state.layout(n).writer is not None and self.log.state.layout(n).allocations
                         for n in LAYOUTS)
    )
    @rule(data=st.data(), persist=st.booleans())
    def writer_publishes_evictable(self, data, persist):
        """What ``commit(residency="system")`` does: a host copy of every
        allocation, then the commit.  Evictions and restores need both: by
        chance alone they would be rare."""
        state = self.log.state
        writers = sorted(state.layout(n).writer for n in LAYOUTS
                         if state.layout(n).writer is not None and state.layout(n).allocations)
        conn = data.draw(st.sampled_from(writers), label="writer")
        layout = self._layout_of(conn)
        for alloc_id in sorted(self.log.state.layout(layout).allocations):
            host_used = sum(r.host_bytes() for r in self.refs.values())
            fresh = alloc_id not in self.log.state.layout(layout).host_copies
            size = self.log.state.layout(layout).allocations[alloc_id].aligned_size
            code, _ = self._decide(lambda: decide_host_copy(self.log.state.layout(layout), conn, alloc_id))
            if fresh and host_used + size > HOST_BUDGET:
                assert code == "HOST_MEMORY_EXHAUSTED"
                return  # no room for the copies: the writer goes on building
            assert code == self.refs[layout].host_copy(conn, alloc_id)
        code, _ = self._decide(lambda: decide_commit(self.log.state.layout(layout), conn, "system", persist))
        assert code == self.refs[layout].commit(conn, "system", self._tick, persist)
        if code is None:  # the shell closes a committed writer's connection
            self._append([SessionClosed(conn, layout=layout)])
            del self.sessions[conn]
            del self.locks[conn]
            self._pump(layout)

    @precondition(has_connections)
    @rule(
        data=st.data(), role=st.sampled_from(["writer", "writer", "any"]), residency=st.sampled_from(RESIDENCIES),
        persist=st.booleans(),
    )
    def commit(self, data, role, residency, persist):
        conn = self._pick_conn(data, role)
        layout = self._layout_of(conn)
        state = self.log.state.layout(layout)
        code, _ = self._decide(lambda: decide_commit(state, conn, residency, persist))
        assert code == self.refs[layout].commit(conn, residency, self._tick, persist)
        if code is None:
            # The shell closes a committed writer's connection.
            self._append([SessionClosed(conn, layout=layout)])
            del self.sessions[conn]
            del self.locks[conn]
            self._pump(layout)
            if persist and data.draw(st.booleans(), label="saved at once"):  # the saver is quick, mostly
                self.save(data, 4096)

    # -- a new policy -------------------------------------------------------------

    @precondition(lambda self: any(t.used_bytes or t.metadata_bytes for t in self.log.state.tenants.values()))
    @rule(
        quotas=st.fixed_dictionaries({name: st.sampled_from([None, 0, 2 * MiB, 6 * MiB, 12 * MiB]) for name in TENANTS}),
        meta=st.fixed_dictionaries({name: st.sampled_from([None, 0, 10, 18]) for name in TENANTS}),
        most=st.fixed_dictionaries({name: st.sampled_from([None, 0, 1, 2]) for name in TENANTS}),
    )
    def new_policy(self, quotas, meta, most):
        """A take-over by a server with another policy (every session goes on).  A
        tenant's bound lowered under what it holds is applied, never refused: it
        keeps what it holds and cannot grow past the bound (issue 48)."""
        self.quotas = quotas
        self.tenant_limits = {name: (meta[name], most[name]) for name in TENANTS}
        resumed = ServerResumed(
            0, "take-over", 1, "a new policy", 2, 64 * MiB, BUDGET, HOST_BUDGET, quotas, LIMITS.as_dict(),
            layout="", tenant_limits=self._limits_field(), disk_budget_bytes=DISK_BUDGET,
        )
        self._append(decide_resume(self.log.state, resumed))
        assert {n: t.quota_bytes for n, t in self.log.state.tenants.items()} == quotas

    # -- residency ----------------------------------------------------------------

    @rule(layout=st.sampled_from(LAYOUTS))
    def evict(self, layout):
        """An admin's ``gms evict``."""
        code, _ = self._decide(lambda: decide_evict(self.log.state, 0, layout, "admin"))
        expected = self.refs[layout].evict() if not self.refs[layout].vacant() else "UNKNOWN_LAYOUT"
        assert code == expected
        self._pump(layout)

    @rule(layout=st.sampled_from(LAYOUTS))
    def delete(self, layout):
        """An admin's ``gms delete``: every tier, the snapshot too."""
        code, _ = self._decide(lambda: decide_delete(self.log.state, 0, 0, layout))
        expected = self.refs[layout].delete() if not self.refs[layout].vacant() else "UNKNOWN_LAYOUT"
        assert code == expected
        self._pump(layout)

    @rule(layout=st.sampled_from(LAYOUTS))
    def spill(self, layout):
        """The shell's spill of a saved layout on a full host tier."""
        code, _ = self._decide(lambda: decide_spill(self.log.state, 0, layout, "host budget"))
        expected = self.refs[layout].spill() if not self.refs[layout].vacant() else "UNKNOWN_LAYOUT"
        assert code == expected

    @rule(layout=st.sampled_from(LAYOUTS), residency=st.sampled_from(RESIDENCIES))
    def pin(self, layout, residency):
        code, _ = self._decide(lambda: decide_pin(self.log.state, 0, layout, residency))
        expected = self.refs[layout].pin(residency) if not self.refs[layout].vacant() else "UNKNOWN_LAYOUT"
        assert code == expected

    @precondition(lambda self: any(self.refs[n].restorer is not None for n in LAYOUTS))
    @rule(data=st.data())
    def restore(self, data):
        """The restorer gets its GPU memory (evicting, or waiting) and fills it."""
        layout = data.draw(st.sampled_from([n for n in LAYOUTS if self.refs[n].restorer is not None]))
        ref = self.refs[layout]
        conn = ref.restorer
        if ref.tier in ("host", "disk"):
            shortfall = admit_restore(self.log.state, RestoreLoading(conn, layout=layout))
            if not self._make_room(shortfall):
                return
            self._append(decide_restore_loading(self.log.state, conn, layout))
            ref.tier = "restoring"
            return
        self._append(decide_restore_finished(self.log.state, conn, layout))
        ref.tier, ref.restorer = "device", None
        ref.readers.add(conn)
        ref.last_use = self._tick()
        self._pump(layout)

    # -- the disk tier ------------------------------------------------------------

    @rule(data=st.data(), extra=st.sampled_from([4096, 4096, 4096, 2 * MiB, 9 * MiB]))
    def save(self, data, extra):
        """The saver's SNAPSHOT_SAVED: the layout's bytes and a manifest (``extra``).
        Mostly of a layout waiting for one (as the saver picks), else of any."""
        waiting = [n for n in LAYOUTS if self.refs[n].persist and self.refs[n].committed and not self.refs[n].disk]
        layout = data.draw(st.sampled_from(waiting if waiting and data.draw(st.integers(0, 3)) else LAYOUTS))
        ref = self.refs[layout]
        size = ref.bytes() + extra
        state = self.log.state.layout(layout)
        event = SnapshotSaved(0, state.layout_hash or "0" * 64, size, f"{'ab' * 12}-{self._tick():016x}.gsnap",
                              layout=layout)
        code, _ = rejection_code(lambda: self._append([event]))
        owner_used = self._disk_used(ref.owner)
        used = self._disk_used()
        assert code == ref.save(size, used, DISK_BUDGET, owner_used, DISK_QUOTAS.get(ref.owner))
        if code is None:  # what a cold start would find in the file
            allocations, metadata = queries.snapshot_rows(self.log.state.layout(layout))
            self.snapshots[event.file] = LayoutRecovered(
                0, ref.owner, ref.layout_hash, allocations, metadata, size, event.file, ref.residency, layout=layout)

    @rule(layout=st.sampled_from(LAYOUTS), other=st.booleans())
    def save_fails(self, layout, other):
        """The saver's SNAPSHOT_FAILED (a full disk): of the layout's commit, or of another
        (a save that ended after a newer commit, which it does not touch)."""
        state = self.log.state.layout(layout)
        layout_hash = "0" * 64 if other or state.layout_hash is None else state.layout_hash
        self._append([SnapshotFailed(0, layout_hash, "no space left on device", layout=layout)])
        self.refs[layout].save_fails(layout_hash)
        assert bool(self.log.state.layout(layout).save_error) == self.refs[layout].save_failed

    def _disk_used(self, tenant: str | None = None) -> int:
        """Bytes of snapshots on disk (``tenant``'s: those charged to it), kept ones too."""
        return sum(r.disk * (tenant is None or r.owner == tenant) + r.kept * (tenant is None or r.kept_owner == tenant)
                   for r in self.refs.values())

    @precondition(lambda self: any(ref.disk or ref.kept for ref in self.refs.values()))
    @rule()
    def reboot(self):
        """Every process gone, the node started again with nothing: each snapshot
        comes back as a layout on disk, with its residency (the manifest's: the
        shell writes the layout's at its save), unless the policy in force refuses it;
        a layout in the middle of a rebuild as its kept snapshot had it (issue 60)."""
        files = [layout.disk_file or layout.kept_file for _, layout in sorted(self.log.state.layouts.items())]
        self._start()
        for event in (self.snapshots[file] for file in files if file):
            name = event.layout
            recovered = layout_recovered(LayoutState(name), event)
            expected = self._recovery_refusal(recovered)
            code, _ = rejection_code(lambda: self._append([event]))
            assert code == expected, (name, code, expected)
            if code is None:
                _recovered_into(self.refs[name], event)

    @precondition(lambda self: any(ref.readers and ref.writer is None for ref in self.refs.values()))
    @rule(data=st.data())
    def another_reader_comes_and_one_leaves(self, data):
        """A second reader of a layout read now, then one of them leaves: the other reads on
        (the lock stays RO with the reader left)."""
        layout = data.draw(st.sampled_from(sorted(n for n, r in self.refs.items() if r.readers and r.writer is None)))
        conn = self.next_conn
        self.handshake(layout, RequestedLockType.RO, self.refs[layout].owner, None, False)
        readers = sorted(self.refs[layout].readers)
        if conn in readers and len(readers) > 1:
            self._disconnect(data.draw(st.sampled_from(readers), label="leaves"))

    @precondition(lambda self: any(
        ref.disk and ref.committed and ref.writer is None and not ref.readers and ref.restorer is None
        for ref in self.refs.values()))
    @rule(data=st.data(), leaves=st.booleans())
    def rebuild(self, data, leaves):
        """Its owner writes a saved layout again (the snapshot is kept till a newer one
        is whole, or comes back if the rebuild ends with none: issue 60); the writer
        may leave at once (``leaves``: its RW_ABORT keeps the snapshot to come back)."""
        layout = data.draw(st.sampled_from(sorted(
            n for n, r in self.refs.items()
            if r.disk and r.committed and r.writer is None and not r.readers and r.restorer is None)))
        conn = self.next_conn
        self.handshake(layout, RequestedLockType.RW, self.refs[layout].owner, None, False)
        if leaves and self.refs[layout].writer == conn:
            self._disconnect(conn)

    @precondition(lambda self: any(r.kept and not r.committed and r.writer is None for r in self.refs.values()))
    @rule(data=st.data(), reads=st.booleans())
    def rebuild_ended(self, data, reads):
        """A rebuild ended with no new commit: the disk tier brings the layout back from
        the snapshot kept through it (LAYOUT_RECOVERED, checked as at a cold start), or
        sets it aside where it does not read (``reads``) or the rules refuse it."""
        layout = data.draw(st.sampled_from(sorted(
            n for n, r in self.refs.items() if r.kept and not r.committed and r.writer is None)))
        ref = self.refs[layout]
        file = self.log.state.layout(layout).kept_file
        assert queries.reverting(self.log.state) and layout in queries.reverting(self.log.state)
        event = self.snapshots[file]
        expected = self._recovery_refusal(layout_recovered(LayoutState(layout), event), ref) if reads else "UNREAD"
        code, _ = rejection_code(lambda: self._append([event])) if expected != "UNREAD" else ("UNREAD", None)
        assert code == expected, (layout, code, expected)
        if code is None:
            _recovered_into(ref, event)
            self._pump(layout)
            return
        self._append([SnapshotSetAside(0, file, "does not read", file + ".corrupt" if not reads else "",
                                       layout=layout)])
        ref.kept, ref.kept_owner, ref.unserved = 0, None, "does not read"
        self._pump(layout)  # (the ledger asks again of a layout an event touched: its readers are told)

    @precondition(lambda self: any(self.refs[n].tier == "disk" and self.refs[n].restorer is None for n in LAYOUTS))
    @rule(data=st.data(), lock=st.sampled_from([RequestedLockType.RO, RequestedLockType.RW_OR_RO]))
    def engine_after_reboot(self, data, lock):
        """An engine asks for a layout only its snapshot holds (as t1 may); a restore
        of a small layout is finished at once, a large one left to the other rules."""
        layout = data.draw(st.sampled_from([n for n in LAYOUTS if self.refs[n].tier == "disk"]))
        self.handshake(layout, lock, "t1", None, data.draw(st.booleans(), label="older"))
        if self.refs[layout].restorer is not None and data.draw(st.booleans(), label="finish now"):
            self.restore(data)
            if self.refs[layout].restorer is not None:
                self.restore(data)

    def _recovery_refusal(self, layout, reverting: ReferenceModel | None = None) -> str | None:
        """Restated from docs/operations.md: a recovered layout is charged as if its
        owner had built it again (bytes, metadata, layouts), and its snapshot too
        (``reverting``: a layout coming back from the snapshot kept through its
        rebuild, already charged for that file, and already counted as a layout)."""
        owner = layout.owner
        freed = reverting.kept if reverting is not None else 0
        owner_freed = freed if reverting is not None and reverting.kept_owner == owner else 0
        owned = [r for r in self.refs.values() if r.owner == owner]
        quota = self.quotas[owner]
        if quota is not None and sum(r.bytes() for r in owned) + layout.held_bytes > quota:
            return "QUOTA_EXCEEDED"
        meta = sum(len(k.encode()) + len(m.value) + LIMITS.metadata_entry_bytes for k, m in layout.metadata.items())
        meta_quota, most = self.tenant_limits[owner]
        disk_quota = DISK_QUOTAS[owner]
        over = (
            (meta_quota is not None and self._metadata_used(owner) + meta > meta_quota)
            or self._metadata_used() + meta > LIMITS.max_metadata_bytes
            or (most is not None and len(owned) + 1 > most)
            or sum(not r.vacant() for r in self.refs.values()) - (reverting is not None) >= LIMITS.max_layouts
            or (disk_quota is not None and self._disk_used(owner) - owner_freed + layout.disk_bytes > disk_quota)
            or self._disk_used() - freed + layout.disk_bytes > DISK_BUDGET
        )
        return "LIMIT_EXCEEDED" if over else None

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
        layout = self._layout_of(conn)
        ref = self.refs[layout]
        alloc_id = self._known_allocation(data, layout)
        state = self.log.state.layout(layout)

        code, found = rejection_code(lambda: queries.get_allocation(state, conn, alloc_id))
        as_row = (found.size, found.aligned_size, found.tag, found.layout_slot) if found else None
        assert (code, as_row) == ref.get_allocation(conn, alloc_id)

        code, rows = rejection_code(lambda: queries.list_allocations(state, conn, tag))
        ids = [a.allocation_id for a in rows] if rows is not None else None
        assert (code, ids) == ref.list_allocations(conn, tag)

        code, entry = rejection_code(lambda: queries.get_metadata(state, conn, key))
        as_meta = (entry.allocation_id, entry.offset_bytes, entry.value) if entry else None
        assert (code, as_meta) == ref.metadata_get(conn, key)

        code, keys = rejection_code(lambda: queries.list_metadata(state, conn, prefix))
        assert (code, keys) == ref.metadata_list(conn, prefix)

    # -- after every step -----------------------------------------------------

    @invariant()
    def core_agrees_with_log_and_model(self):
        state = self.log.state
        check_invariants(state)
        assert self.log.replay() == state
        assert fold_all(self.events) == state
        for name, ref in self.refs.items():
            layout = state.layout(name)
            assert (name in state.layouts) == (not ref.vacant() or bool(ref.allocs))
            assert layout.lock_state.value == ref.state_name()
            assert (layout.writer, set(layout.readers), layout.restorer, layout.committed) == (
                ref.writer, ref.readers, ref.restorer, ref.committed,
            )
            assert {
                k: (a.size, a.aligned_size, a.tag, a.layout_slot) for k, a in layout.allocations.items()
            } == ref.allocs
            assert {
                k: (m.allocation_id, m.offset_bytes, m.value) for k, m in layout.metadata.items()
            } == ref.meta
            assert (layout.layout_hash, layout.next_layout_slot) == (ref.layout_hash, ref.next_slot)
            assert (layout.residency.value, layout.tier.value, set(layout.host_copies), layout.owner) == (
                ref.residency, ref.tier, ref.host, ref.owner,
            )
            assert (layout.persist, layout.disk_bytes, layout.kept_bytes) == (ref.persist, ref.disk, ref.kept)
            assert layout.unserved == ref.unserved
        for name, tenant in state.tenants.items():  # a total over its bound never grew (the fold's hold)
            now = (tenant.used_bytes, tenant.metadata_bytes, tenant.layouts)
            bounds = (tenant.quota_bytes, tenant.metadata_quota, tenant.max_layouts)
            for total, before, bound in zip(now, self.totals.get(name, now), bounds):
                assert bound is None or total <= bound or total <= before, (name, now, bounds)
            self.totals[name] = now
        for tenant in TENANTS:
            charged = sum(ref.bytes() for ref in self.refs.values() if ref.owner == tenant)
            sessions = sum(1 for _, t, _ in self.sessions.values() if t == tenant)
            assert (state.tenants[tenant].used_bytes, state.tenants[tenant].sessions) == (charged, sessions)
            assert state.tenants[tenant].metadata_bytes == self._metadata_used(tenant)
            assert set(state.tenants[tenant].layout_refs) == self._tenant_layouts(tenant)
        assert state.metadata_bytes == self._metadata_used() <= LIMITS.max_metadata_bytes
        assert state.gpu_bytes == sum(ref.gpu_bytes() for ref in self.refs.values()) <= BUDGET
        assert state.host_bytes == sum(ref.host_bytes() for ref in self.refs.values()) <= HOST_BUDGET
        assert state.disk_bytes == self._disk_used() <= DISK_BUDGET
        for tenant, quota in DISK_QUOTAS.items():
            disk = self._disk_used(tenant)
            assert state.tenants[tenant].disk_bytes == disk and (quota is None or disk <= quota)
        assert set(state.sessions) == set(self.sessions)


def _recovered_into(ref: ReferenceModel, event: LayoutRecovered) -> None:
    """The reference model of a layout ``LAYOUT_RECOVERED`` brought back: committed, on disk."""
    ref.committed, ref.layout_hash, ref.owner = True, event.layout_hash, event.owner
    ref.allocs = {a[0]: tuple(a[1:]) for a in event.allocations}
    ref.meta = {m[0]: tuple(m[1:]) for m in event.metadata}
    ref.next_slot = 1 + max((a[4] for a in event.allocations), default=-1)
    ref.residency, ref.tier, ref.persist, ref.disk = event.residency, "disk", True, event.bytes
    ref.kept, ref.kept_owner, ref.unserved = 0, None, ""
