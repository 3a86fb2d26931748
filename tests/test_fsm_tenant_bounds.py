"""The pure core's bounds on what a tenant makes the daemon hold, besides GPU bytes:
metadata bytes (its metadata quota, and the node's bound) and layouts (its
``max_layouts``, counted from the handshake of every session that may write).

Each refusal is an OverLimit naming the limit, the scope, used, asked and the
bound; the fold holds every bound for any log (InvariantViolation), and an old
log (no ``tenant_limits``, no ``max_metadata_bytes``) folds unbounded.
"""

from __future__ import annotations

import pytest

from gms.fsm import (
    EMPTY_NODE,
    InvariantViolation,
    Limits,
    OverLimit,
    RequestedLockType,
    check_invariants,
    decide_disconnect,
    decide_session,
    fold,
    fold_all,
)
from gms.fsm.events import (
    AllocationCreated,
    MetadataDeleted,
    MetadataPut,
    RwConnect,
    ServerStarted,
    SessionOpened,
)
from gms.operator.policy import OPEN_POLICY, parse_policy

from .fsm_events import committed, opened

MiB = 1 << 20


def start(meta=None, layouts=None, node_meta=None, max_layouts=4096, tenants=("a", "b"), entry=0) -> ServerStarted:
    """``entry``: the charge per metadata entry (0 here but where a test is about it)."""
    limits = Limits(max_layouts=max_layouts, max_metadata_bytes=node_meta, metadata_entry_bytes=entry).as_dict()
    return ServerStarted(
        0, None, None, None, {t: None for t in tenants}, limits, layout="",
        tenant_limits={t: {"metadata_quota": meta, "max_layouts": layouts} for t in tenants},
    )


def built(conn: int, layout: str, tenant: str = "a") -> list:
    return [
        opened(conn, layout, "RW", tenant),
        RwConnect(conn, layout=layout),
        AllocationCreated(conn, f"x{conn}", 4096, 2 * MiB, "w", 0, layout=layout),
    ]


def put(conn: int, layout: str, key: str, size: int, alloc: str | None = None) -> MetadataPut:
    return MetadataPut(conn, key, alloc or f"x{conn}", 0, b"v" * size, layout=layout)


def refusal(state, event) -> OverLimit:
    with pytest.raises(OverLimit) as caught:
        fold(state, event)
    return caught.value


# -- metadata ---------------------------------------------------------------------------


def test_metadata_is_charged_to_the_owner_and_refused_past_its_quota():
    state = fold_all([start(meta=1000), *built(1, "m"), put(1, "m", "k1", 600)])
    assert (state.tenants["a"].metadata_bytes, state.metadata_bytes) == (602, 602)
    over = refusal(state, put(1, "m", "k2", 400))
    assert (over.code, over.limit, over.scope, over.used, over.asked, over.bound) == (
        "LIMIT_EXCEEDED", "metadata_quota", "tenant", 602, 402, 1000,
    )
    assert "metadata quota" in over.message and "602 used + 402 asked > 1000 allowed" in over.message
    # Replacing a value charges the difference only; a smaller one always fits.
    state = fold(state, put(1, "m", "k1", 990))
    assert state.tenants["a"].metadata_bytes == 992
    state = fold(state, put(1, "m", "k1", 10))
    state = fold(state, MetadataDeleted(1, "k1", layout="m"))
    assert (state.tenants["a"].metadata_bytes, state.metadata_bytes) == (0, 0)
    check_invariants(state)


def test_each_entry_is_charged_its_own_cost_besides_its_bytes():
    """Issue 48: 2 million 6-byte entries passed as 12 MB (18% of a default quota)
    and made the daemon 1.3 GiB: an entry costs its tuple, its maps' nodes, its
    index, whatever its size.  The charge (Limits.metadata_entry_bytes) counts
    against the quota and the node's bound; deleting or replacing gives it back."""
    state = fold_all([start(meta=1000, node_meta=2000, entry=100), *built(1, "m")])
    for n in range(9):  # 9 entries of "kN" + 6 bytes: (2 + 6 + 100) each = 972
        state = fold(state, put(1, "m", f"k{n}", 6))
    assert (state.tenants["a"].metadata_bytes, state.metadata_bytes) == (972, 972)
    over = refusal(state, put(1, "m", "k9", 6))
    assert (over.limit, over.used, over.asked, over.bound) == ("metadata_quota", 972, 108, 1000)
    state = fold(state, put(1, "m", "k0", 10))  # a new value for a key: only its bytes more
    assert state.tenants["a"].metadata_bytes == 976
    state = fold(state, MetadataDeleted(1, "k0", layout="m"))
    assert state.tenants["a"].metadata_bytes == 976 - 112
    check_invariants(state)


def test_the_node_bound_holds_across_tenants():
    state = fold_all([start(node_meta=1000), *built(1, "m1", "a"), *built(2, "m2", "b"), put(1, "m1", "k", 700)])
    over = refusal(state, put(2, "m2", "k", 400))
    assert (over.limit, over.scope, over.used, over.asked, over.bound) == ("max_metadata_bytes", "node", 701, 401, 1000)
    state = fold(state, put(2, "m2", "k", 200))
    assert (state.tenants["a"].metadata_bytes, state.tenants["b"].metadata_bytes, state.metadata_bytes) == (
        701, 201, 902,
    )
    check_invariants(state)


def test_a_batch_is_checked_event_by_event_and_refused_whole():
    from gms.store import EventLog

    log = EventLog()
    log.extend([start(meta=1000), *built(1, "m")])
    with pytest.raises(OverLimit):
        log.extend([put(1, "m", f"k{n}", 300) for n in range(4)])  # the 4th passes 1000
    assert log.state.tenants["a"].metadata_bytes == 0, "all or nothing"


def test_an_abort_or_a_rebuild_gives_the_metadata_back():
    state = fold_all([start(meta=1000), *built(1, "m"), put(1, "m", "k", 900)])
    state = fold_all(decide_disconnect(state, 1), state)
    assert (state.tenants["a"].metadata_bytes, state.metadata_bytes) == (0, 0)
    state = fold_all([*built(2, "m"), put(2, "m", "k", 900)], state)
    state = fold_all(committed(state, 2, "m"), state)
    assert state.tenants["a"].metadata_bytes == 901, "committed: still charged"
    # Another tenant rebuilding the layout takes it over: the charge moves, and clears.
    state = fold_all([opened(3, "m", "RW", "b"), RwConnect(3, layout="m")], state)
    assert (state.tenants["a"].metadata_bytes, state.tenants["b"].metadata_bytes) == (0, 0)
    check_invariants(state)


def test_the_fold_holds_the_metadata_bounds_for_any_log():
    """A log that passes a bound (written by a broken shell) is refused by the fold."""
    from gms.fsm import rules

    state = fold_all([start(meta=100), *built(1, "m")])
    event = put(1, "m", "k", 200)
    check = rules.check
    rules.check = lambda node, e: (rules.RULES[type(e)], node.layout(e.layout))  # as if the rules were skipped
    try:
        with pytest.raises(InvariantViolation, match="metadata"):
            fold(state, event)
    finally:
        rules.check = check


# -- layouts ------------------------------------------------------------------------------


def test_a_tenant_is_refused_its_layout_past_max_layouts_and_others_are_not():
    state = fold_all([start(layouts=2), *built(1, "l1"), *built(2, "l2")])
    state = fold_all(committed(state, 1, "l1") + committed(state, 2, "l2"), state)
    assert state.tenants["a"].layouts == 2
    over = refusal(state, opened(3, "l3", "RW", "a"))
    assert (over.limit, over.scope, over.used, over.asked, over.bound) == ("max_layouts", "tenant", 2, 1, 2)
    assert "tenant 'a'" in over.message
    # RW_OR_RO might write: it counts too; RO does not; its own layouts cost nothing more.
    assert refusal(state, opened(3, "l3", "RW_OR_RO", "a")).limit == "max_layouts"
    state = fold(state, opened(3, "l3", "RO", "a"))
    state = fold(state, opened(4, "l1", "RW", "a"))
    # Another tenant is not held to a's count.
    state = fold_all(built(5, "l3", "b"), state)
    assert (state.tenants["a"].layouts, state.tenants["b"].layouts) == (2, 1)
    check_invariants(state)


def test_a_waiting_writer_holds_its_count_from_the_handshake():
    """The grant may come long after the handshake: the layout is counted at the
    handshake, so the grant never takes the tenant past its bound (a tenant could
    otherwise crash the server by building layouts while its writer waits)."""
    state = fold_all([start(layouts=2), *built(1, "shared", "b")])
    state = fold(state, opened(2, "shared", "RW", "a"))  # waits behind b's writer
    assert state.tenants["a"].layouts == 1
    state = fold_all(built(3, "mine", "a"), state)
    assert refusal(state, opened(4, "third", "RW", "a")).used == 2
    # b's writer leaves; a's waiter is granted and owns "shared": still 2.
    state = fold_all(decide_disconnect(state, 1), state)
    state = fold(state, RwConnect(2, layout="shared"))
    assert dict(state.tenants["a"].layout_refs) == {"shared": 2, "mine": 2}
    assert state.tenants["b"].layouts == 0
    check_invariants(state)
    # The writer leaving uncommitted drops it; a committed layout stays counted.
    state = fold_all(decide_disconnect(state, 2), state)
    assert dict(state.tenants["a"].layout_refs) == {"mine": 2}


def test_the_node_cap_is_an_over_limit_too():
    state = fold_all([start(max_layouts=1), *built(1, "l1")])
    over = refusal(state, opened(2, "l2", "RW", "b"))
    assert (over.limit, over.scope, over.used, over.bound) == ("max_layouts", "node", 1, 1)
    assert "the server already holds 1 layouts" in over.message


def test_the_fold_holds_max_layouts_for_any_log():
    from gms.fsm import rules

    state = fold_all([start(layouts=1), *built(1, "l1")])
    check = rules.check
    rules.check = lambda node, e: (rules.RULES[type(e)], None)  # as if the rules were skipped
    try:
        with pytest.raises(InvariantViolation, match="layouts"):
            fold(state, opened(2, "l2", "RW", "a"))
    finally:
        rules.check = check


def test_decide_session_then_the_rules_refuse_with_the_figures():
    state = fold_all([start(layouts=0)])
    with pytest.raises(OverLimit) as caught:
        fold_all(
            decide_session(
                state, 1, "x", RequestedLockType.RW, tenant="a", may_read=True, may_write=True,
                uid=1, gid=1, pid=1, limit_bytes=None,
            ),
            state,
        )
    assert caught.value.bound == 0


# -- old logs, the policy ----------------------------------------------------------------


def test_a_log_from_before_these_limits_folds_unbounded():
    old = ServerStarted(0, None, None, None, {"a": None}, {"max_layouts": 4096}, layout="")
    state = fold(EMPTY_NODE, old)
    assert state.limits.max_metadata_bytes is None
    assert (state.tenants["a"].metadata_quota, state.tenants["a"].max_layouts) == (None, None)
    events = [SessionOpened(1, "a", 1, 1, 1, "RW", layout="m"), RwConnect(1, layout="m"),
              AllocationCreated(1, "x", 1, 2 * MiB, "w", 0, layout="m")]
    events += [put(1, "m", f"k{n}", MiB, "x") for n in range(100)]  # past today's default quota
    state = fold_all(events, state)
    assert state.metadata_bytes == 100 * MiB + 10 * 2 + 90 * 3
    state = fold_all(decide_disconnect(state, 1), state)
    assert state.metadata_bytes == 0 and 1 not in state.sessions
    check_invariants(state)


def test_the_policy_resolves_each_tenants_limits_with_the_servers_defaults():
    policy = parse_policy(
        """
[[tenant]]
name = "a"
uids = [1]
metadata_quota = "1MiB"
max_layouts = 3

[[tenant]]
name = "b"
uids = [2]
"""
    )
    assert policy.tenant_limits(64 * MiB, 256) == {
        "a": {"metadata_quota": MiB, "max_layouts": 3, "disk_quota": None},
        "b": {"metadata_quota": 64 * MiB, "max_layouts": 256, "disk_quota": None},
    }
    assert OPEN_POLICY.tenant_limits(64 * MiB, 256) == {
        "default": {"metadata_quota": None, "max_layouts": None, "disk_quota": None},
    }


@pytest.mark.parametrize(
    "line, message",
    [('metadata_quota = "lots"', "metadata_quota: not a byte count"), ("max_layouts = -1", "non-negative")],
)
def test_the_policy_refuses_bad_limits_naming_the_line(line, message):
    from gms.operator.policy import PolicyError

    with pytest.raises(PolicyError, match=message) as caught:
        parse_policy(f'[[tenant]]\nname = "a"\nuids = [1]\n{line}\n', "p.toml")
    assert str(caught.value).startswith("p.toml:4:")
