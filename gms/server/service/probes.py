"""The probes: what the server is (runtime state) and what happened (the event log).

Who sees what is decided from the peer's credentials: admins (root, the
server's uid, a policy admin) everything, a tenant the layouts it may read
and its own row, a peer of no tenant nothing.  A tenant's history is its
own: events of layouts it may not read are left out, and so are other
peers' refused handshakes and connections dropped before a handshake; other
tenants' quotas are cut from SERVER_STARTED (and SERVER_RESUMED) and other peers' uid, gid and
pid from the events it does see.  The runtime state keeps the
seed's single-layout fields at the top level, describing the layout
``weights``, so a seed-era client or probe reads it unchanged.
"""

from __future__ import annotations

import os
import sys
import time

import attrs
import trio

from ...fsm import PermissionDenied
from ...fsm.events import (
    ConnectionDropped,
    ServerResumed,
    ServerStarted,
    SessionOpened,
    SessionRefused,
    kind_columns,
)
from ...operator.policy import Policy, TenantPolicy
from ...operator.status import layout_rows, tenant_rows
from ...store import LogEntry
from ...system.peer import Peer
from ...wire import messages as m
from ..tiers.host_memory import HostMemory
from ..tiers.memory import Memory
from .ledger import Ledger

SEED_LAYOUT = "weights"  # what the seed's single-layout clients read at the top level


_IDENTITY = ("uid", "gid", "pid")


@attrs.frozen
class View:
    """What a probe shows: everything (``tenant_policy`` None), or one tenant's share."""

    tenant_policy: TenantPolicy | None
    policy: Policy | None = None  # whose a refused peer is

    def layout(self, name: str) -> bool:
        return self.tenant_policy is None or not name or self.tenant_policy.may_read(name)

    def tenant(self, name: str) -> bool:
        return self.tenant_policy is None or self.tenant_policy.name == name

    def history_row(self, entry: LogEntry) -> dict | None:
        """The event as this viewer may see it; None: not at all."""
        event = entry.event
        row = history_entry(entry)
        if self.tenant_policy is None:
            return row
        if not self.layout(event.layout):
            return None
        if isinstance(event, SessionRefused):
            peer = self.policy.tenant_for(event.uid, event.gid) if self.policy is not None else None
            return row if peer is not None and self.tenant(peer.name) else None
        if isinstance(event, ConnectionDropped) and not event.layout:
            return None  # before a handshake: nobody's, so nobody's business
        if isinstance(event, ServerStarted | ServerResumed):  # a new server's configuration: the same
            mine = self.tenant_policy.name
            row["quotas"] = {k: v for k, v in event.quotas.items() if k == mine}
            row["tenant_limits"] = {k: v for k, v in event.tenant_limits.items() if k == mine}
        elif not (isinstance(event, SessionOpened) and self.tenant(event.tenant)):
            for key in _IDENTITY:
                if key in row:
                    row[key] = None  # another peer's: who it was is not this tenant's to know
        return row


def history_entry(entry: LogEntry) -> dict:
    """One event as the history probe shows it: in the seed's words (``kind_columns``),
    the logged kind in ``logged_as`` where they differ."""
    event = entry.event
    row = {"seq": entry.seq, **kind_columns(event.KIND), "time": entry.wall_ns / 1e9, "mono_ns": entry.mono_ns}
    row.update(attrs.asdict(event))
    return row


def keeper_status(keeper) -> dict:
    """The keeper's fields of the runtime state (``none``: the server runs without one)."""
    fields = {"keeper": "none", "service_pid": os.getpid()} if keeper is None else {
        "keeper": keeper.state.value, "keeper_backlog_bytes": keeper.backlog_bytes(),
        "keeper_behind_s": round(keeper.behind_s(), 3), "keepers_lost": keeper.lost,
        "keeper_pid": keeper.keeper_pid, "service_pid": keeper.service_pid,
    }
    return {**fields, "python_prefix": sys.prefix}


class Probes:
    def __init__(
        self,
        ledger: Ledger,
        gpu: Memory,
        host: HostMemory | None,
        policy: Policy,
        server_uid: int,
        *,
        history_max_events: int,
        history_max_bytes: int,
        keeper=None,
        disk=None,
    ) -> None:
        """``keeper``: the server's ``KeeperLink`` (None: it runs without one);
        ``disk``: the disk tier's ``DiskStore`` (None: no disk tier)."""
        self.disk = disk
        self.ledger = ledger
        self.gpu = gpu
        self.host = host
        self.keeper = keeper
        self.policy = policy
        self.server_uid = server_uid
        self.history_max_events = history_max_events
        self.history_max_bytes = history_max_bytes
        self.started_monotonic = time.monotonic()

    def view_for(self, peer: Peer) -> View:
        if self.policy.is_admin(peer.uid, peer.gid, self.server_uid):
            return View(None)
        tenant = self.policy.tenant_for(peer.uid, peer.gid)
        if tenant is None:
            raise PermissionDenied(f"uid {peer.uid} is no tenant of this server's policy")
        return View(tenant, self.policy)

    def _seconds_since(self, seq: int) -> float | None:
        entry = self.ledger.log.entry(seq)
        return None if entry is None else (time.monotonic_ns() - entry.mono_ns) / 1e9

    async def runtime_state(self, view: View = View(None)) -> m.GetRuntimeStateResponse:
        info = await self.gpu.device_info()  # NVML, on the lane
        disk_free = await trio.to_thread.run_sync(self.disk.free_bytes) if self.disk is not None else None
        state = self.ledger.state  # after the awaits: the state as it is now
        log = self.ledger.log
        queues = self.ledger.queues
        handles, handle_bytes = self.gpu.live()
        host = self.host
        host_handles, host_handle_bytes = host.live() if host is not None else (0, 0)
        link = host.link if host is not None else None
        copier, copier_pid = link.status() if link is not None else ("off", 0)
        rows = [row for row in layout_rows(state, queues.counts, self._seconds_since) if view.layout(row.name)]
        writers, others = queues.counts()
        seed = next((row for row in rows if row.name == SEED_LAYOUT), None) or m.LayoutStatus.empty(SEED_LAYOUT)
        return m.GetRuntimeStateResponse(
            backend=self.gpu.name,
            device=self.gpu.backend.device,
            device_name=info.name,
            device_uuid=info.uuid,
            capacity_bytes=state.capacity_bytes,
            budget_bytes=state.budget_bytes,
            used_bytes=state.gpu_bytes,
            host_budget_bytes=state.host_budget_bytes,
            host_used_bytes=state.host_bytes,
            disk_budget_bytes=state.disk_budget_bytes,
            disk_used_bytes=state.disk_bytes,
            disk_loose_bytes=self.disk.loose_bytes if self.disk is not None else 0,
            disk_dir=self.disk.directory if self.disk is not None else "",
            disk_free_bytes=disk_free,
            device_free_bytes=info.free_bytes,
            server_handle_count=handles,
            server_handle_bytes=handle_bytes,
            host_handle_count=host_handles,
            host_handle_bytes=host_handle_bytes,
            allocations_cleared=self.gpu.released,
            sessions=len(state.sessions),
            waiting=writers + others,
            first_event_seq=log.first_seq,
            last_event_seq=log.last_seq,
            event_log_bytes=log.bytes,
            uptime_s=time.monotonic() - self.started_monotonic,
            pid=os.getpid(),
            metadata_bytes=state.metadata_bytes,
            max_metadata_bytes=state.limits.max_metadata_bytes,
            layouts=rows,
            tenants=[row for row in tenant_rows(state) if view.tenant(row.name)],
            state=seed.state,
            has_rw_session=seed.writer,
            ro_session_count=seed.readers,
            waiting_writers=seed.waiting_writers,
            waiting_readers=seed.waiting_readers,
            committed=seed.committed,
            allocation_count=seed.allocation_count,
            total_bytes=seed.bytes,
            memory_layout_hash=seed.memory_layout_hash,
            copier=copier,
            copier_pid=copier_pid,
            host_pool_bytes=host.pool.bytes if host is not None else 0,
            **keeper_status(self.keeper),
        )

    def history(
        self,
        since_seq: int | None,
        limit: int | None,
        layout: str | None = None,
        view: View = View(None),
    ) -> m.GetEventHistoryResponse:
        """Events after ``since_seq``, capped by count and (roughly) by bytes.

        A filtered page skips other layouts' events; the scan is bounded too,
        and ``scanned_seq`` says where the next page starts."""
        log = self.ledger.log
        cap = self.history_max_events if limit is None else max(0, min(limit, self.history_max_events))
        filtered = layout is not None or view.tenant_policy is not None
        rows: list[dict] = []
        budget = self.history_max_bytes
        scanned = max(since_seq or 0, log.first_seq - 1)
        for entry in log.since(scanned, cap * 16 + 1024 if filtered else cap):
            row = view.history_row(entry) if layout is None or entry.event.layout == layout else None
            if row is not None:
                budget -= 96 + sum(len(v) for v in row.values() if isinstance(v, str | bytes))
                if len(rows) >= cap or (rows and budget < 0):
                    break
                rows.append(row)
            scanned = entry.seq
        return m.GetEventHistoryResponse(rows, log.first_seq, log.last_seq, scanned)
