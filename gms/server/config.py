"""Everything one server (one device, one socket, many layouts) is configured with."""

from __future__ import annotations

import attrs

from ..fsm import Limits
from ..operator.policy import OPEN_POLICY, Policy
from ..wire import DEFAULT_MAX_FRAME_BYTES

DEFAULT_STOCK_BYTES = 64 << 20


@attrs.frozen
class ServerConfig:
    socket_path: str
    device: int = 0
    backend: str = "auto"
    host_capacity: int | None = None  # host backend: the "device" size
    gpu_budget: str | None = None  # bytes or a fraction of the device; None: no budget
    host_budget: str | None = None  # bytes for host copies; None: no budget
    host_tier: bool = True
    # The copier (gms.copier): a process that moves host-tier bytes for clients;
    # off: clients copy themselves (today's protocol, always understood).
    copier: bool = True
    host_pool_bytes: int | None = None  # pinned host memory made ahead of need (needs the copier); None: sized by the builds
    host_chunk_bytes: int = 64 << 20  # the pool's unit
    # The disk tier (gms.disk): snapshots of layouts committed to persist, found again at a cold start.
    disk_tier: bool = True
    disk_dir: str | None = None  # None: gms.system.paths.disk_dir (beside the state, kept across reboots)
    disk_budget: str | None = None  # bytes of snapshots; None: what the disk holds
    restore_at_start: bool = False  # a cold start restores what it recovered onto the GPU before serving
    policy: Policy = OPEN_POLICY
    policy_file: str | None = None  # where ``policy`` was read: read again by a spare taking a node
    alloc_retry_interval: float = 0.05
    alloc_retry_timeout: float | None = None
    # Small allocations made ahead of need (memory.Stock); None: 64 MiB on CUDA,
    # none on the host backend, whose memfds are cheap and named by allocation.
    alloc_stock_bytes: int | None = None
    socket_mode: int = 0o600
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    limits: Limits = Limits()
    event_log_retain: int | None = 1_000_000
    event_log_bytes: int | None = 64 << 20
    history_max_events: int = 10_000
    history_max_bytes: int = 8 << 20
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    # Restarts and take-overs (gms.keeper, gms.server.restart.takeover):
    keeper_fd: int | None = None  # the channel to the keeper that started this server
    keeper_socket: str | None = None  # or the socket of a keeper in another container
    take_over: bool = False  # take the place of a server live on socket_path (else start as usual)
    handover_timeout: float = 30.0  # for a quiet point, and for the other side of a take-over
    state_dir: str | None = None  # where a state that does not rebuild is saved (default: the socket's folder)
    ready_file: str | None = None  # created once serving, removed on exit (a readiness probe's)
    # Connections (gms.server.edge.admission): a deadline for the first request, a
    # cap per peer uid (None: none), fds kept for admins (None: the default).
    handshake_timeout: float = 10.0
    max_connections_per_uid: int | None = 256
    fd_reserve: int | None = None
    scan_cache_bytes: int = 64 << 20
