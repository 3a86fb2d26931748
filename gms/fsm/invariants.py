"""``check_invariants(node)``: what must hold in every reachable state.

The running totals the fold keeps are recomputed here the slow way, so a
drift between them and the tables is caught, not trusted.  A tenant may hold
more than a bound a new server lowered under it (``TenantState.over_bounds``),
and the node more metadata than its bound: that neither ever grows past one
is the fold's to hold, step by step (``hold``), and the model-based machine
checks it across steps.
"""

from __future__ import annotations

from collections import Counter

from .errors import InvariantViolation
from .folding import entry_bytes
from .layout_hash import compute_layout_hash
from .state import LayoutState, NodeState, Residency, Tier, charged_metadata
from .tier_accounts import ACCOUNTS


def check_invariants(node: NodeState) -> None:
    problems = list(_node_problems(node))
    for layout in node.layouts.values():
        problems += [f"layout {layout.name!r}: {p}" for p in layout_problems(layout)]
    if problems:
        raise InvariantViolation("; ".join(problems))


def layout_problems(state: LayoutState):
    if state.writer is not None and (state.readers or state.restorer is not None):
        yield f"writer {state.writer} beside readers {sorted(state.readers)} or a restorer"
    if (state.readers or state.restorer is not None) and not state.committed:
        yield "readers on an uncommitted layout"
    if state.writer is not None and state.committed:
        yield "a writer holds RW over a committed layout"
    if state.readers and state.tier is not Tier.GPU:
        yield f"readers of a layout whose bytes are on tier {state.tier.value}"
    if state.restorer is not None and state.tier is Tier.GPU:
        yield "a restorer of a resident layout"
    if state.tier is Tier.HOST and state.residency is not Residency.SYSTEM:
        yield f"in the host tier with residency {state.residency.value}"
    if state.tier is Tier.DISK and (not state.saved or state.host_copies):
        yield "on the disk tier without a snapshot alone"
    if state.tier is Tier.RESTORING and state.residency is not Residency.SYSTEM and not state.saved:
        yield "restoring with neither host copies nor a snapshot"
    if state.saved and not (state.committed and state.persist and state.disk_file):
        yield "a snapshot of a layout not committed to persist, or with no file"
    if state.save_error and not state.unsaved:
        yield "a save error on a layout saved, or not committed to persist"
    if bool(state.kept_file) != (state.kept_bytes > 0) or bool(state.kept_file) != (state.kept_owner is not None):
        yield "a kept snapshot without its file, size or owner"
    if state.kept_file and (state.saved or state.committed and not state.persist):
        yield "a snapshot kept beside a newer one, or beside a commit that asks for none"
    if state.unserved and (state.committed or state.writer is not None or state.kept_file):
        yield "a snapshot said not served beside a commit, a writer or a kept snapshot"
    if state.tier is Tier.RESTORING and state.restorer is None:
        yield "restoring with no restorer"
    if state.writer is None and not state.committed and (state.allocations or state.metadata):
        yield "layout left behind in EMPTY"
    hash_expected = state.committed and state.writer is None
    if (state.layout_hash is not None) != hash_expected:
        yield f"layout hash {'present' if state.layout_hash else 'missing'} in {state.lock_state.value}"
    if state.held_bytes != sum(a.aligned_size for a in state.allocations.values()):
        yield f"held_bytes {state.held_bytes} is not the sum of its allocations"
    if state.host_bytes != sum(state.host_copies.values()):
        yield f"host_bytes {state.host_bytes} is not the sum of its host copies"
    for allocation_id, size in state.host_copies.items():
        allocation = state.allocations.get(allocation_id)
        if allocation is None or allocation.aligned_size != size:
            yield f"host copy of {allocation_id!r} matches no allocation"
    if state.residency is Residency.SYSTEM and len(state.host_copies) != len(state.allocations) and not state.saved:
        yield "residency system without a host copy of every allocation, nor a snapshot"
    slots = set()
    for allocation_id, a in state.allocations.items():
        if a.allocation_id != allocation_id:
            yield f"allocation filed under {allocation_id!r} is {a.allocation_id!r}"
        if not 0 < a.size <= a.aligned_size:
            yield f"allocation {allocation_id!r} has sizes {a.size}/{a.aligned_size}"
        if not 0 <= a.layout_slot < state.next_layout_slot or a.layout_slot in slots:
            yield f"allocation {allocation_id!r} has bad slot {a.layout_slot}"
        slots.add(a.layout_slot)
    yield from _metadata_problems(state)
    if state.layout_hash is not None:
        try:
            actual = compute_layout_hash(state.allocations.values(), state.metadata.values())
        except InvariantViolation as exc:
            yield str(exc)
        else:
            if actual != state.layout_hash:
                yield f"layout hash {state.layout_hash} does not match the layout ({actual})"


def _metadata_problems(state: LayoutState):
    # One pass over the entries (a restart runs this before it serves: 200,000
    # entries in about a tenth of a second on the 2-core host).  The index is
    # checked by counting: every entry found under its allocation, and the index
    # holding as many keys as the metadata, make the two the same set.
    sizes = {allocation_id: a.size for allocation_id, a in state.allocations.items()}
    index = state.keys_by_allocation
    if state.committed:  # no writer will free an allocation of it: no index (see LayoutState)
        if index:
            yield "a committed layout keeps an allocation -> metadata keys index"
        index = None
    unindexed = 0
    total = 0
    for key, (entry_key, allocation_id, offset, value) in state.metadata.items():
        total += entry_bytes(key, value)
        size = sizes.get(allocation_id)
        if entry_key != key:
            yield f"metadata filed under {key!r} is {entry_key!r}"
        if size is None:
            yield f"metadata {key!r} points to missing allocation {allocation_id!r}"
        elif not 0 <= offset < size:
            yield f"metadata {key!r} offset {offset} outside {size}"
        if index is not None:
            keys = index.get(allocation_id)
            if keys is None or key not in keys:
                unindexed += 1
    if index is not None:
        if unindexed or sum(map(len, index.values())) != len(state.metadata):
            yield "the allocation -> metadata keys index does not match the metadata"
        if any(not keys for keys in index.values()):
            yield "the allocation -> metadata keys index keeps an empty entry"
    if state.metadata_bytes != total:
        yield f"metadata_bytes {state.metadata_bytes} is not the sum of its entries"


def _node_problems(node: NodeState):
    used: Counter[str] = Counter()
    metadata_used: Counter[str] = Counter()
    refs: dict[str, Counter[str]] = {name: Counter() for name in node.tenants}
    metadata = 0
    totals = dict.fromkeys((account.total for account in ACCOUNTS), 0)
    disk_used: Counter[str] = Counter()
    for name, layout in node.layouts.items():
        if layout.name != name:
            yield f"layout filed under {name!r} is {layout.name!r}"
        if layout.vacant:
            yield f"vacant layout {name!r} kept"
        if layout.owner is None and layout.held_bytes:
            yield f"layout {name!r} holds bytes but has no owner"
        charged = charged_metadata(layout, node.limits.metadata_entry_bytes)
        if layout.owner is not None:
            used[layout.owner] += layout.held_bytes
            metadata_used[layout.owner] += charged
            refs.setdefault(layout.owner, Counter())[name] += 1
        elif layout.metadata_bytes:
            yield f"layout {name!r} holds metadata but has no owner"
        for account in ACCOUNTS:
            totals[account.total] += account.held(layout)
        if layout.owner is not None:
            disk_used[layout.owner] += layout.disk_bytes
        if layout.kept_owner is not None:
            disk_used[layout.kept_owner] += layout.kept_bytes
        metadata += charged
        for conn in [layout.writer, layout.restorer, *layout.readers]:
            if conn is None:
                continue
            session = node.sessions.get(conn)
            if session is None or session.layout != name:
                yield f"conn {conn} holds a lock on {name!r} without a session on it"
        if layout.writer is not None:
            session = node.sessions.get(layout.writer)
            if session is not None:
                if session.tenant != layout.owner:
                    yield f"layout {name!r} is owned by {layout.owner!r}, its writer is {session.tenant!r}"
                if session.limit_bytes is not None and layout.held_bytes > session.limit_bytes:
                    yield f"layout {name!r} holds {layout.held_bytes} > its writer's limit"
    for session in node.sessions.values():
        if session.lock_type != "RO":
            refs.setdefault(session.tenant, Counter())[session.layout] += 1
    if metadata != node.metadata_bytes:
        yield f"metadata_bytes {node.metadata_bytes} != {metadata} in the layouts"
    for account in ACCOUNTS:  # every tier alike
        kept, held, budget = getattr(node, account.total), totals[account.total], getattr(node, account.budget)
        if kept != held:
            yield f"{account.total} {kept} != {held}, {account.what} in the layouts"
        if account.strict and budget is not None and kept > budget:
            yield f"{account.what}, {kept}, exceed the budget of {budget}"
    sessions: Counter[str] = Counter(s.tenant for s in node.sessions.values())
    for name, tenant in node.tenants.items():
        if tenant.used_bytes != used[name]:
            yield f"tenant {name!r} is charged {tenant.used_bytes}, owns {used[name]}"
        if tenant.sessions != sessions[name]:
            yield f"tenant {name!r} counts {tenant.sessions} sessions, has {sessions[name]}"
        if tenant.disk_bytes != disk_used[name]:
            yield f"tenant {name!r} is charged {tenant.disk_bytes} disk bytes, owns {disk_used[name]}"
        if tenant.metadata_bytes != metadata_used[name]:
            yield f"tenant {name!r} is charged {tenant.metadata_bytes} metadata bytes, owns {metadata_used[name]}"
        if dict(tenant.layout_refs) != dict(refs[name]):
            yield f"tenant {name!r} counts layouts {dict(tenant.layout_refs)}, has {dict(refs[name])}"
    for owner in refs:
        if owner not in node.tenants:
            yield f"layouts owned by unknown tenant {owner!r}"
