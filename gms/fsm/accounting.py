"""Byte admission before memory is spent: is the event legal, and what must go first?

Creating memory precedes the event that records it, so the shell asks before
it spends: :func:`admit_allocation` and :func:`admit_restore` run the rules
on the event it will record (session limit, tenant quota, a request that can
never fit the budget: typed refusals) and return the GPU bytes that must be
freed first (0: it fits now), which the shell covers by evicting idle
layouts or waits out (backpressure).  Every check reads running totals kept
by the fold (O(1), no scan).  The fold holds the same bounds when the event
is appended, after the shell's await: whatever changed meanwhile, no log
breaks a budget.
"""

from __future__ import annotations

from . import rules
from .events import AllocationCreated, RestoreLoading
from .state import NodeState


def gpu_shortfall(node: NodeState, more: int) -> int:
    budget = node.budget_bytes
    return 0 if budget is None else max(0, node.gpu_bytes + more - budget)


def host_room(node: NodeState) -> int | None:
    """What the host budget leaves beyond the recorded host copies (None: no budget)."""
    budget = node.host_budget_bytes
    return None if budget is None else budget - node.host_bytes


def admit_allocation(node: NodeState, event: AllocationCreated) -> int:
    rules.check(node, event)
    return gpu_shortfall(node, event.aligned_size)


def admit_restore(node: NodeState, event: RestoreLoading) -> int:
    rules.check(node, event)
    return gpu_shortfall(node, node.layout(event.layout).held_bytes)
