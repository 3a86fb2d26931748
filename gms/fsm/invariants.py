"""``check_invariants(state)``: what must hold in every reachable state."""

from __future__ import annotations

from .errors import InvariantViolation
from .layout_hash import compute_layout_hash
from .state import State


def check_invariants(state: State) -> None:
    problems = list(_problems(state))
    if problems:
        raise InvariantViolation("; ".join(problems))


def _problems(state: State):
    if state.writer is not None and state.readers:
        yield f"writer {state.writer} and readers {sorted(state.readers)} together"
    if state.readers and not state.committed:
        yield "readers on an uncommitted layout"
    if state.writer is not None and state.committed:
        yield "a writer holds RW over a committed layout"
    if state.writer is None and not state.committed and (state.allocations or state.metadata):
        yield "layout left behind in EMPTY"
    hash_expected = state.committed and state.writer is None
    if (state.layout_hash is not None) != hash_expected:
        yield f"layout hash {'present' if state.layout_hash else 'missing'} in {state.lock_state.value}"
    slots = set()
    for allocation_id, a in state.allocations.items():
        if a.allocation_id != allocation_id:
            yield f"allocation filed under {allocation_id!r} is {a.allocation_id!r}"
        if not 0 < a.size <= a.aligned_size:
            yield f"allocation {allocation_id!r} has sizes {a.size}/{a.aligned_size}"
        if not 0 <= a.layout_slot < state.next_layout_slot or a.layout_slot in slots:
            yield f"allocation {allocation_id!r} has bad slot {a.layout_slot}"
        slots.add(a.layout_slot)
    for key, m in state.metadata.items():
        allocation = state.allocations.get(m.allocation_id)
        if m.key != key:
            yield f"metadata filed under {key!r} is {m.key!r}"
        if allocation is None:
            yield f"metadata {key!r} points to missing allocation {m.allocation_id!r}"
        elif not 0 <= m.offset_bytes < allocation.size:
            yield f"metadata {key!r} offset {m.offset_bytes} outside {allocation.size}"
    if state.layout_hash is not None:
        try:
            actual = compute_layout_hash(state.allocations.values(), state.metadata.values())
        except InvariantViolation as exc:
            yield str(exc)
        else:
            if actual != state.layout_hash:
                yield f"layout hash {state.layout_hash} does not match the layout ({actual})"
