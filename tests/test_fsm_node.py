"""The node's pure core: sessions, tenants, quotas, budgets, eviction and restore."""

from __future__ import annotations

import attrs
import pytest

from gms.fsm import (
    BudgetExceeded,
    InvalidArgument,
    InvariantViolation,
    PermissionDenied,
    QuotaExceeded,
    RequestedLockType,
    admit_allocation,
    admit_restore,
    check_invariants,
    decide_allocate,
    decide_disconnect,
    decide_evict,
    decide_host_copy,
    decide_pin,
    decide_session,
    fold_all,
    holders,
    plan_evictions,
    validate_layout_name,
)
from gms.fsm.errors import HostBudgetExceeded, HostCopyMissing, NotEvictable
from gms.fsm.events import RestoreClaimed, RestoreLoading, RoConnect, RwConnect

from .fsm_events import committed, opened, started, writer

MiB = 1 << 20
RW, RO, AUTO = RequestedLockType.RW, RequestedLockType.RO, RequestedLockType.RW_OR_RO


def build(state, conn, layout, sizes, tenant="default", residency="device", host=False):
    """A writer session on ``layout`` allocating ``sizes`` (MiB), committed with ``residency``."""
    state = fold_all(writer(conn, layout, tenant), state)
    for n, size in enumerate(sizes):
        state = fold_all(
            decide_allocate(state.layout(layout), conn, f"{layout}-{n}", size * MiB, size * MiB, "w"),
            state,
        )
        if host or residency == "system":
            state = fold_all(decide_host_copy(state.layout(layout), conn, f"{layout}-{n}"), state)
    from gms.fsm import decide_commit
    from gms.fsm.events import SessionClosed

    state = fold_all([*decide_commit(state.layout(layout), conn, residency), SessionClosed(conn, layout=layout)], state)
    check_invariants(state)
    return state


def allocation(state, conn, layout, size, name="x"):
    (event,) = decide_allocate(state.layout(layout), conn, name, size, size, "w")
    return event


def test_tenants_are_charged_what_they_build_and_quotas_are_checked_in_constant_time():
    state = fold_all([started({"a": 10 * MiB, "b": None})])
    state = build(state, 1, "m1", [4, 4], tenant="a")
    assert state.tenants["a"].used_bytes == 8 * MiB and state.gpu_bytes == 8 * MiB
    state = fold_all(writer(2, "m2", "a"), state)
    with pytest.raises(QuotaExceeded) as refused:
        admit_allocation(state, allocation(state, 2, "m2", 4 * MiB))
    assert (refused.value.scope, refused.value.used, refused.value.asked, refused.value.quota) == (
        "tenant", 8 * MiB, 4 * MiB, 10 * MiB,
    )
    assert admit_allocation(state, allocation(state, 2, "m2", 2 * MiB)) == 0  # fits; no budget to free
    # Another tenant is not limited by a's quota.
    state = fold_all(writer(3, "m3", "b"), state)
    assert admit_allocation(state, allocation(state, 3, "m3", 64 * MiB)) == 0


def test_a_session_limit_narrows_and_its_bytes_go_with_the_session():
    state = fold_all([started({"a": 10 * MiB}), opened(1, "kv", "RW", "a", limit=3 * MiB)])
    state = fold_all([RwConnect(1, layout="kv")], state)
    state = fold_all(decide_allocate(state.layout("kv"), 1, "k0", 2 * MiB, 2 * MiB, "kv"), state)
    with pytest.raises(QuotaExceeded) as refused:
        admit_allocation(state, allocation(state, 1, "kv", 2 * MiB))
    assert (refused.value.scope, refused.value.quota) == ("session", 3 * MiB)
    state = fold_all(decide_disconnect(state, 1), state)  # a crash: the socket is the lease
    check_invariants(state)
    assert state.tenants["a"].used_bytes == 0 and "kv" not in state.layouts and not state.sessions


def test_a_session_may_not_widen_its_tenants_quota():
    state = fold_all([started({"a": 4 * MiB})])
    events = decide_session(state, 1, "kv", RW, tenant="a", may_read=True, may_write=True, uid=1, gid=1, pid=1,
                            limit_bytes=5 * MiB)
    with pytest.raises(InvalidArgument, match="never widen"):
        fold_all(events, state)  # the rules refuse it when the shell appends it


@pytest.mark.parametrize(
    "requested, may_read, may_write, outcome",
    [
        (RW, True, False, PermissionDenied),
        (RO, False, False, PermissionDenied),
        (AUTO, True, False, "RO"),  # a reader-only tenant never rebuilds a layout
        (AUTO, True, True, "RW_OR_RO"),
        (RO, False, True, "RO"),  # writing implies reading
    ],
)
def test_what_a_tenant_may_do_with_a_layout(requested, may_read, may_write, outcome):
    state = fold_all([started({"a": None})])
    decide = lambda: decide_session(  # noqa: E731
        state, 1, "m", requested, tenant="a", may_read=may_read, may_write=may_write,
        uid=1, gid=1, pid=1, limit_bytes=None,
    )
    if isinstance(outcome, type):
        with pytest.raises(outcome):
            decide()
    else:
        (event,) = decide()
        assert event.lock_type == outcome


def test_expect_hash_asks_for_exactly_one_committed_layout_and_never_waits():
    from gms.fsm import StaleLayout

    def ask(state, requested, expect):
        events = decide_session(
            state, 9, "m", requested, tenant="default", may_read=True, may_write=True,
            uid=1, gid=1, pid=1, limit_bytes=None, expect_hash=expect,
        )
        fold_all(events, state)  # the rules judge it when the shell appends it
        return events

    empty = fold_all([started({"default": None})])
    with pytest.raises(StaleLayout) as refused:
        ask(empty, RO, "a" * 64)  # nothing committed: refused now, not waited for
    assert refused.value.code == "STALE_LAYOUT"
    state = build(empty, 1, "m", [2])
    current = state.layout("m").layout_hash
    with pytest.raises(StaleLayout, match=current[:12]):
        ask(state, AUTO, "b" * 64)
    with pytest.raises(InvalidArgument, match="readers"):
        ask(state, RW, current)
    assert ask(state, RO, current)[0].lock_type == "RO"
    assert ask(state, AUTO, current)[0].lock_type == "RW_OR_RO"  # granted RO: it is committed
    building = fold_all(writer(2, "m"), state)  # a writer cleared the layout to rebuild it
    with pytest.raises(StaleLayout):
        ask(building, RO, current)


@pytest.mark.parametrize("name", ["", "a" * 129, "../etc", "bad name", "x\x00y", "é", "-lead", 7])
def test_odd_layout_names_are_refused(name):
    with pytest.raises(InvalidArgument):
        validate_layout_name(name)


@pytest.mark.parametrize("name", ["weights", "kv_cache", "llama-3.1-8b/tp0", "team:a@v2+x"])
def test_ordinary_layout_names_are_fine(name):
    assert validate_layout_name(name) == name


def test_budget_evicts_least_recently_used_idle_layouts_never_pinned_ones():
    state = fold_all([started({"default": None}, budget=16 * MiB)])
    state = build(state, 1, "old", [4], residency="system")
    state = build(state, 2, "pinned", [4], residency="device")
    state = build(state, 3, "newer", [4], residency="unpinned")
    state = build(state, 4, "newest", [2], residency="system")
    assert state.gpu_bytes == 14 * MiB
    state = fold_all(writer(5, "incoming"), state)
    assert admit_allocation(state, allocation(state, 5, "incoming", 4 * MiB)) == 2 * MiB
    assert plan_evictions(state, 2 * MiB) == ["old"]
    assert plan_evictions(state, 6 * MiB) == ["old", "newer"]
    assert plan_evictions(state, 12 * MiB) is None, "pinned and in-use layouts are never evicted"
    assert plan_evictions(state, 2 * MiB, busy={"old"}) == ["newer"], "nobody's waited-for layout"
    with pytest.raises(BudgetExceeded):
        admit_allocation(state, allocation(state, 5, "incoming", 17 * MiB))


def test_eviction_keeps_the_host_copy_or_drops_an_unpinned_layout():
    state = fold_all([started(budget=64 * MiB)])
    state = build(state, 1, "sys", [4], residency="system")
    state = build(state, 2, "unp", [4], residency="unpinned")
    before = state.layout("sys").layout_hash
    state = fold_all(decide_evict(state, 0, "sys", "budget") + decide_evict(state, 0, "unp", "budget"), state)
    check_invariants(state)
    sys_layout = state.layout("sys")
    assert (sys_layout.tier.value, sys_layout.layout_hash, sys_layout.evictions) == ("host", before, 1)
    assert len(sys_layout.metadata) == len(state.layout("sys").metadata)
    assert "unp" not in state.layouts, "unpinned: its next user reloads it"
    assert state.gpu_bytes == 0 and state.host_bytes == 4 * MiB
    assert state.tenants["default"].used_bytes == 4 * MiB, "a tenant keeps paying for its evicted layout"


def test_evict_refuses_pinned_busy_and_unknown_layouts_with_reasons():
    state = fold_all([started()])
    state = build(state, 1, "dev", [2], residency="device")
    state = build(state, 2, "sys", [2], residency="system")
    state = fold_all([opened(3, "sys", "RO"), RoConnect(3, layout="sys")], state)
    with pytest.raises(NotEvictable, match="pinned"):
        fold_all(decide_evict(state, 0, "dev", "admin"), state)
    with pytest.raises(NotEvictable, match="while it is RO"):
        fold_all(decide_evict(state, 0, "sys", "admin"), state)
    with pytest.raises(Exception, match="no layout"):
        decide_evict(state, 0, "nope", "admin")


def test_system_residency_needs_every_host_copy():
    state = fold_all([started()])
    state = build(state, 1, "m", [2, 2], residency="device")
    with pytest.raises(HostCopyMissing):
        fold_all(decide_pin(state, 0, "m", "system"), state)
    assert [e.residency for e in decide_pin(state, 0, "m", "unpinned")] == ["unpinned"]


def test_host_budget_is_a_clear_refusal():
    state = fold_all([started(host_budget=4 * MiB)])
    state = build(state, 1, "m", [4], residency="system")
    state = fold_all(writer(2, "n") + [allocation(state, 2, "n", 2 * MiB)], state)
    with pytest.raises(HostBudgetExceeded):
        fold_all(decide_host_copy(state.layout("n"), 2, "x"), state)


def test_restore_needs_room_and_counts_on_the_gpu_when_loading():
    state = fold_all([started(budget=8 * MiB)])
    state = build(state, 1, "a", [6], residency="system")
    state = fold_all(decide_evict(state, 0, "a", "budget"), state)
    state = build(state, 2, "b", [4], residency="system")
    state = fold_all([opened(3, "a", "RO"), RestoreClaimed(3, layout="a")], state)
    assert admit_restore(state, RestoreLoading(3, layout="a")) == 2 * MiB  # b must go first
    state = fold_all(decide_evict(state, 0, "b", "budget") + [RestoreLoading(3, layout="a")], state)
    check_invariants(state)
    assert state.gpu_bytes == 6 * MiB
    # The restorer dies: nothing half-copied is served, the GPU bytes are released.
    state = fold_all(decide_disconnect(state, 3), state)
    check_invariants(state)
    assert state.layout("a").tier.value == "host" and state.gpu_bytes == 0


def test_revoke_takes_every_holder():
    state = fold_all([started()])
    state = build(state, 1, "w", [2])
    state = fold_all([opened(2, "w", "RO"), RoConnect(2, layout="w"), opened(3, "w", "RO"), RoConnect(3, layout="w")], state)
    state = fold_all(writer(4, "kv"), state)
    assert holders(state, "w") == [2, 3] and holders(state, "kv") == [4]
    for conn in holders(state, "w"):
        state = fold_all(decide_disconnect(state, conn), state)
    check_invariants(state)
    assert state.layout("w").lock_state.value == "COMMITTED" and len(state.sessions) == 1


def test_invariants_catch_accounting_drift():
    state = build(fold_all([started()]), 1, "m", [2])
    drifted = attrs.evolve(state, gpu_bytes=state.gpu_bytes + 1)
    with pytest.raises(InvariantViolation, match="gpu_bytes"):
        check_invariants(drifted)
    tenant = state.tenants["default"]
    drifted = attrs.evolve(state, tenants=state.tenants.set("default", attrs.evolve(tenant, used_bytes=0)))
    with pytest.raises(InvariantViolation, match="charged"):
        check_invariants(drifted)


def test_a_commit_and_its_session_close_settle_the_owner():
    state = fold_all([started({"a": None, "b": None})])
    state = build(state, 1, "m", [2], tenant="a")
    state = fold_all(writer(2, "m", "b"), state)  # b rebuilds m: a is no longer charged
    assert (state.tenants["a"].used_bytes, state.layout("m").owner) == (0, "b")
    state = fold_all(committed(state, 2, "m"), state)
    check_invariants(state)


# -- the bounds hold in the fold itself, whatever the shell asks ------------------------------


def test_the_fold_refuses_to_break_the_gpu_budget():
    state = fold_all([started(budget=8 * MiB)])
    state = build(state, 1, "a", [6], residency="system")
    state = fold_all(writer(2, "b"), state)
    over = allocation(state, 2, "b", 4 * MiB)
    assert admit_allocation(state, over) == 2 * MiB  # the shell must evict a first
    with pytest.raises(InvariantViolation, match="past its bound"):
        fold_all([over], state)  # a shell that forgot to: no log can hold it
    state = fold_all(decide_evict(state, 0, "a", "budget") + [over], state)
    check_invariants(state)


def test_the_fold_refuses_to_break_the_host_budget_between_two_writers():
    """Both writers' host copies pass the check alone; appended together, the second
    is refused (the overshoot two writers could reach across an await)."""
    state = fold_all([started(host_budget=3 * MiB)])
    state = fold_all(writer(1, "a") + writer(2, "b"), state)
    state = fold_all([allocation(state, 1, "a", 2 * MiB, "x"), allocation(state, 2, "b", 2 * MiB, "y")], state)
    first = decide_host_copy(state.layout("a"), 1, "x")
    second = decide_host_copy(state.layout("b"), 2, "y")
    fold_all(second, state)  # alone it fits
    with pytest.raises(HostBudgetExceeded):
        fold_all(first + second, state)


def test_a_commit_trusts_its_hash_and_the_invariants_check_it():
    state = fold_all([started()])
    state = fold_all(writer(1, "m") + [allocation(state, 1, "m", 2 * MiB)], state)
    (commit,) = decide_commit_for(state, 1, "m")
    forged = attrs.evolve(commit, layout_hash="0" * 64)
    state = fold_all([forged], state)  # checked once (where it is computed), then trusted
    with pytest.raises(InvariantViolation, match="does not match"):
        check_invariants(state)


def decide_commit_for(state, conn, layout):
    from gms.fsm import decide_commit

    return decide_commit(state.layout(layout), conn)


def test_freeing_finds_its_metadata_through_the_index():
    from gms.fsm import decide_free, decide_metadata_put

    state = fold_all([started()])
    state = fold_all(writer(1, "m"), state)
    state = fold_all([allocation(state, 1, "m", 2 * MiB, "x")], state)
    state = fold_all([allocation(state, 1, "m", 2 * MiB, "y")], state)
    layout = state.layout("m")
    puts = [*decide_metadata_put(layout, 1, "k1", "x", 0, b"v"), *decide_metadata_put(layout, 1, "k2", "y", 0, b"w")]
    puts += decide_metadata_put(layout, 1, "k3", "x", 1, b"abc")
    state = fold_all(puts + decide_metadata_put(layout, 1, "k2", "x", 2, b"moved"), state)
    check_invariants(state)
    layout = state.layout("m")
    assert set(layout.keys_by_allocation["x"]) == {"k1", "k2", "k3"} and "y" not in layout.keys_by_allocation
    assert layout.metadata_bytes == len("k1v") + len("k2moved") + len("k3abc")
    events = decide_free(layout, 1, "x")
    assert sorted(e.KIND for e in events) == ["ALLOCATION_FREED"] + ["METADATA_DELETED"] * 3
    state = fold_all(events, state)
    check_invariants(state)
    assert not state.layout("m").metadata and state.layout("m").metadata_bytes == 0


def test_a_committed_layout_keeps_no_index():
    """No writer frees an allocation of a committed layout (RW_CONNECT starts it
    afresh): the commit drops the index, which a restart then never rebuilds."""
    from gms.fsm import decide_metadata_put

    state = fold_all([started(), *writer(1, "m")])
    state = fold_all([allocation(state, 1, "m", 2 * MiB, "x")], state)
    state = fold_all(decide_metadata_put(state.layout("m"), 1, "k", "x", 0, b"v"), state)
    index = state.layout("m").keys_by_allocation
    state = fold_all(decide_commit_for(state, 1, "m"), state)
    check_invariants(state)
    assert not state.layout("m").keys_by_allocation and state.layout("m").metadata
    kept = attrs.evolve(state, layouts=state.layouts.set("m", attrs.evolve(state.layout("m"), keys_by_allocation=index)))
    with pytest.raises(InvariantViolation, match="committed layout keeps"):
        check_invariants(kept)


def test_the_layout_cap_holds_in_the_fold():
    """Two first writers of new layouts both pass the session check; the fold refuses
    the grant that would break the cap (the shell grants at once, so it never asks)."""
    state = fold_all([attrs.evolve(started(), limits={"max_layouts": 2}), *writer(1, "a")])
    state = fold_all([opened(2, "b"), opened(3, "c"), RwConnect(2, layout="b")], state)
    with pytest.raises(InvariantViolation, match="more than 2 layouts"):
        fold_all([RwConnect(3, layout="c")], state)


def test_a_fold_step_that_leaves_its_rule_s_moves_stops_the_fold(monkeypatch):
    """Each rule's moves are enforced, not only drawn: a step whose outcome its
    row does not list (here an abort that leaves the writer in place) is a
    broken invariant."""
    from gms.fsm import rules
    from gms.fsm.events import RwAbort

    state = fold_all([started(), *writer(1, "w")])
    assert fold_all([RwAbort(1, layout="w")], state).layout("w").writer is None  # the real step: RW -> EMPTY
    monkeypatch.setitem(rules.RULES, RwAbort, attrs.evolve(rules.RULES[RwAbort], step=lambda layout, event: layout))
    with pytest.raises(InvariantViolation, match="RW_ABORT took layout .w. from RW/device to RW/device"):
        fold_all([RwAbort(1, layout="w")], state)


def test_every_event_declares_what_it_releases_and_whether_a_restart_keeps_it():
    """Issue 50: what an event releases and whether a restart must keep it are
    columns of its rule, declared by every row (a row that leaves one out does
    not load), not sets kept elsewhere: forgetting ``lasting`` would let an
    answer leave before the keeper holds the change."""
    from gms.fsm import EVENT_TYPES, LASTING
    from gms.fsm import folding as steps
    from gms.fsm.events import RwConnect
    from gms.fsm.rules import ANY_LOCK, NODE_ONLY, RULES, Rule, Who

    assert set(EVENT_TYPES.values()) == set(RULES) | set(NODE_ONLY)
    for kind, rule in RULES.items():
        assert isinstance(rule.lasting, bool), kind
        assert rule.releases is None or callable(rule.releases), kind
    with pytest.raises(TypeError, match="releases|lasting"):
        Rule(Who.ANYONE, ANY_LOCK, step=steps.unchanged)
    assert LASTING == {
        "SERVER_STARTED", "SERVER_RESUMED", "STATE_DISCARDED", "RW_CONNECT", "RW_COMMIT", "RESIDENCY_SET",
        "LAYOUT_EVICTED", "RESTORE_FINISHED", "LAYOUT_LOST", "LAYOUT_DELETED", "SNAPSHOT_SAVED", "LAYOUT_RECOVERED", "LAYOUT_SPILLED",
        "LAYOUT_FELL_TO_DISK", "SNAPSHOT_SET_ASIDE",
    }
    assert [kind for kind, rule in RULES.items() if rule.owns] == [RwConnect]
    assert {kind.KIND: rule.releases.__name__ for kind, rule in RULES.items() if rule.releases} == {
        "RW_CONNECT": "cleared", "RW_COMMIT": "kept_unasked", "SNAPSHOT_SAVED": "kept_snapshot", "RW_ABORT": "aborted", "ALLOCATION_FREED": "one_allocation",
        "LAYOUT_EVICTED": "gpu_copy", "RESTORE_ABORTED": "half_restored", "LAYOUT_LOST": "dropped", "LAYOUT_DELETED": "everything",
        "LAYOUT_SPILLED": "host_copies", "LAYOUT_FELL_TO_DISK": "memory_copies",
    }


# -- a restart is the same node (issue 59) -------------------------------------------------


def test_a_resumed_node_carries_every_setting_of_its_first_event():
    """Every field of SERVER_STARTED but the connection and layout is node configuration;
    SERVER_RESUMED has each, and ``resumed_from`` fills each from the new server's first
    event.  A setting added to SERVER_STARTED alone fails here (the disk budget once
    did: every restart turned the disk tier off)."""
    from gms.fsm import EMPTY_NODE, fold
    from gms.fsm.events import NODE_CONFIG_FIELDS, ServerResumed, ServerStarted, resumed_from

    assert set(NODE_CONFIG_FIELDS) <= {f.name for f in attrs.fields(ServerResumed)}
    values = {"capacity_bytes": 1 << 40, "budget_bytes": 1 << 39, "host_budget_bytes": 1 << 38,
              "quotas": {"a": 1 << 30}, "limits": {"max_layouts": 7}, "backend": "host", "device": 3,
              "device_uuid": "u", "tenant_limits": {"a": {"metadata_quota": 5, "max_layouts": 6, "disk_quota": 9}},
              "disk_budget_bytes": 5 << 30}
    assert set(values) == set(NODE_CONFIG_FIELDS), "a new setting: give it a value here"
    first = ServerStarted(0, layout="", **values)
    resumed = resumed_from(first, mode="restart", old_pid=1, reason="signal SIGKILL", state_version=3,
                           follows_seq=10)
    assert {name: getattr(resumed, name) for name in NODE_CONFIG_FIELDS} == values
    # Folded onto a node started otherwise, it leaves the node exactly as a fresh start would.
    other = ServerStarted(0, None, None, None, {}, {}, layout="")
    assert attrs.evolve(fold(fold(EMPTY_NODE, other), resumed), tick=0) == attrs.evolve(fold(EMPTY_NODE, first), tick=0)
