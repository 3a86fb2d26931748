"""Byte admission: session limits, tenant quotas, the GPU and host budgets.

Every check reads running totals kept by the fold (O(1), no scan).  A quota
refusal is final and typed (``QuotaExceeded`` names used, asked and quota
bytes); a request that can never fit the budget is refused too
(``BudgetExceeded``); a request that fits the budget only once other memory
goes returns the shortfall, which the shell covers by evicting idle layouts
or waits out (backpressure).
"""

from __future__ import annotations

from .errors import BudgetExceeded, HostBudgetExceeded, InvariantViolation, QuotaExceeded
from .node import NodeState, SessionInfo
from .state import LayoutState


def _session(node: NodeState, conn: int) -> SessionInfo:
    session = node.sessions.get(conn)
    if session is None:
        raise InvariantViolation(f"conn {conn} allocates without a session")
    return session


def admit_allocation(node: NodeState, conn: int, aligned: int) -> int:
    """Check the writer's limits for ``aligned`` more bytes; return the GPU
    bytes that must be freed first (0: it fits the budget now)."""
    session = _session(node, conn)
    layout = node.layout(session.layout)
    if session.limit_bytes is not None and layout.held_bytes + aligned > session.limit_bytes:
        raise QuotaExceeded("session", layout.held_bytes, aligned, session.limit_bytes)
    tenant = node.tenants[session.tenant]
    if tenant.quota_bytes is not None and tenant.used_bytes + aligned > tenant.quota_bytes:
        raise QuotaExceeded("tenant", tenant.used_bytes, aligned, tenant.quota_bytes)
    _must_fit(node, layout, layout.held_bytes + aligned)
    return _shortfall(node, aligned)


def admit_restore(node: NodeState, layout: LayoutState) -> int:
    """GPU bytes to free before an evicted layout can come back."""
    _must_fit(node, layout, layout.held_bytes)
    return _shortfall(node, layout.held_bytes)


def _must_fit(node: NodeState, layout: LayoutState, total: int) -> None:
    budget = node.budget_bytes
    if budget is not None and total > budget:
        raise BudgetExceeded(
            f"layout {layout.name!r} would hold {total} bytes, more than the GPU budget of "
            f"{budget} bytes: it can never fit"
        )


def _shortfall(node: NodeState, more: int) -> int:
    budget = node.budget_bytes
    return 0 if budget is None else max(0, node.gpu_bytes + more - budget)


def admit_host_copy(node: NodeState, aligned: int) -> None:
    budget = node.host_budget_bytes
    if budget is not None and node.host_bytes + aligned > budget:
        raise HostBudgetExceeded(
            f"host tier full: {node.host_bytes} bytes used + {aligned} asked > "
            f"the host budget of {budget} bytes"
        )
