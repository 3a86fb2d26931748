"""The rows of ``gms status``, from a node state: one per layout, one per tenant.

Shared by the server's runtime-state probe and by ``gms replay``, which
rebuilds a state offline from a log and prints the same table.
"""

from __future__ import annotations

from collections.abc import Callable

from ..fsm import NodeState
from ..wire import messages as m


def layout_rows(
    state: NodeState,
    waiting: Callable[[str], tuple[int, int]] = lambda name: (0, 0),
    seconds_since: Callable[[int], float | None] = lambda seq: None,
) -> list[m.LayoutStatus]:
    rows = []
    for name in sorted(state.layouts):
        layout = state.layouts[name]
        writers, others = waiting(name)
        rows.append(
            m.LayoutStatus(
                name=name,
                state=layout.lock_state.value,
                committed=layout.committed,
                residency=layout.residency.value,
                tier=layout.tier.value,
                bytes=layout.held_bytes,
                gpu_bytes=layout.gpu_bytes,
                host_bytes=layout.host_bytes,
                allocation_count=len(layout.allocations),
                metadata_count=len(layout.metadata),
                writer=layout.writer is not None,
                readers=len(layout.readers),
                restoring=layout.restorer is not None,
                waiting_writers=writers,
                waiting_readers=others,
                memory_layout_hash=layout.layout_hash or "",
                owner=layout.owner or "",
                last_use_s=seconds_since(layout.last_use) if layout.last_use else None,
                loads=layout.loads,
                restores=layout.restores,
                evictions=layout.evictions,
                disk_bytes=layout.disk_bytes,
                kept_bytes=layout.kept_bytes,
                save_error=layout.save_error,
                unserved=layout.unserved,
                persist=layout.persist,
            )
        )
    return rows


def tenant_rows(state: NodeState) -> list[m.TenantStatus]:
    return [
        m.TenantStatus(
            t.name, t.used_bytes, t.quota_bytes, t.sessions, t.metadata_bytes, t.metadata_quota, t.layouts,
            t.max_layouts, t.disk_bytes, t.disk_quota,
        )
        for t in sorted(state.tenants.values(), key=lambda t: t.name)
    ]
