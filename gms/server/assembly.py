"""One node's service, built in one place: its tiers, the copier's supervisor, the
disk tier's folder, the log, the one write path and the rooms that answer requests,
through their constructors, in the order they need each other.  A cold start, a
restart and a take-over all build here (``Server.serve``), from the configuration
whole.  Three links go back up the order, each said where it is made: the saver
hears every event the ledger stores (``Ledger.observe``), the host table asks
the disk tier for room (``HostMemory.spill_to``), both made before the saver, and
a copier that starts maps the host table's chunks (``CopierLink.remap_with``), made
before the table.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import attrs
import trio

from ..cuda import MemoryBackend
from ..disk.store import DiskStore
from ..fsm import MemoryTier, host_room
from ..fsm.events import Event
from ..store import EventLog
from ..system import paths
from ..units import parse_budget
from .config import ServerConfig
from .edge.admission import FdBudget
from .service.core import Rooms, ServiceCore
from .service.durability import IN_MEMORY
from .service.host_tier import HostTier
from .service.ledger import Ledger
from .service.lock_queues import LockQueues
from .service.placement import Placement
from .service.probes import Probes
from .service.requests import Requests
from .service.settings import Settings
from .service.snapshots import Snapshots
from .service.transfers import Transfers
from .tiers.copier_link import CopierLink
from .tiers.disk_files import DiskFiles
from .tiers.host_memory import HostMemory
from .tiers.lanes import Lane
from .tiers.memory import Memory
from .tiers.memory_signal import MemorySignal
from .tiers.pool_sizing import PoolSizing
from .tiers.table import tier_table

logger = logging.getLogger("gms.server")


def effective_limits(config: ServerConfig, total_bytes: int | None):
    """Cap single allocations at the device's size unless configured."""
    limits = config.limits
    if limits.max_allocation_bytes is None and total_bytes is not None:
        limits = attrs.evolve(limits, max_allocation_bytes=total_bytes)
    return limits


def settings_for(config: ServerConfig, capacity: int, server_uid: int) -> Settings:
    """The configuration resolved against a device of ``capacity`` bytes.  Pure."""
    def budget(text: str | None, whole: int | None) -> int | None:
        return None if text is None else parse_budget(text, whole)

    return Settings(
        server_uid=server_uid,
        policy=config.policy,
        limits=effective_limits(config, capacity),
        budget_bytes=budget(config.gpu_budget, capacity),
        host_budget_bytes=budget(config.host_budget, None),
        disk_budget_bytes=budget(config.disk_budget, None),
        history_max_events=config.history_max_events,
        history_max_bytes=config.history_max_bytes,
        alloc_retry_interval=config.alloc_retry_interval,
        alloc_retry_timeout=config.alloc_retry_timeout,
        scan_cache_bytes=config.scan_cache_bytes,
    )


@attrs.frozen
class Node:
    """What the server holds before its core: the GPU's table, the host tier's
    backend, the memory-released signal, the fd budget, the keeper link, and what
    the host pool sizes itself by and the host budget leaves (asked of the core,
    once there is one)."""

    gpu: Memory
    host_backend: MemoryBackend | None
    signal: MemorySignal
    fds: FdBudget | None
    keeper: object  # the keeper link (gms.server.restart.mirror), None without a keeper
    on_event: Callable[[Event], None]  # the metrics
    state: Callable[[], object]  # the node's state, once the core is made (the pool's sizing)
    host_room: Callable[[], int | None]


async def assemble(config: ServerConfig, node: Node, log: EventLog | None = None) -> ServiceCore:
    """The node's core, from its configuration; ``log``: one handed over (a restart, a
    take-over), else a fresh one.  A disk folder that will not do raises FolderRefused:
    the server does not start."""
    files = None
    if config.disk_tier:
        folder = config.disk_dir or paths.disk_dir(config.socket_path, config.state_dir)
        files = DiskFiles(await trio.to_thread.run_sync(DiskStore, folder))
    copier = None
    if config.copier and (node.host_backend is not None or files is not None):
        level = logging.getLevelName(logger.getEffectiveLevel()).lower()
        copier = CopierLink(node.gpu.backend.name, config.device, log_level=level)
    auto = config.host_pool_bytes is None
    host = host_table(node, copier, pool_bytes=config.host_pool_bytes or 0, chunk_bytes=config.host_chunk_bytes,
                      sizing=PoolSizing(node.state) if auto else None)
    device = await node.gpu.device_info()  # on the lane, like every call into a backend
    settings = settings_for(config, device.total_bytes, os.getuid())
    if log is None:
        log = EventLog(retain=config.event_log_retain, max_bytes=config.event_log_bytes)
    return build_core(node, host, copier, files, log, device, settings)


def host_table(node: Node, copier: CopierLink | None, **pool) -> HostMemory | None:
    """The host tier's table, where the node has a host backend (``pool``: its size,
    its chunks' size, or the sizing by the builds under way)."""
    if node.host_backend is None:
        return None
    host = HostMemory(Memory(node.host_backend, Lane("host")), link=copier, observer=node.keeper, fds=node.fds,
                      room=node.host_room, **pool)
    if copier is not None:
        copier.remap_with(host.live_chunks)  # a copier that starts maps the chunks first
    return host


def build_core(node: Node, host: HostMemory | None, copier: CopierLink | None, files: DiskFiles | None,
               log: EventLog, device, settings: Settings) -> ServiceCore:
    """The write path, then the rooms over it, then the core (constructors only)."""
    gpu, policy = node.gpu, settings.policy
    present = {MemoryTier.GPU: gpu, MemoryTier.HOST: host, MemoryTier.DISK: files}
    ledger = Ledger(
        log, tier_table({tier: store for tier, store in present.items() if store is not None}), LockQueues(),
        on_event=node.on_event, on_released=node.signal.released,
        durability=node.keeper if node.keeper is not None else IN_MEMORY,
    )
    snapshots = None
    if files is not None:
        snapshots = Snapshots(ledger, gpu, files, copier, policy.may_write)
        ledger.observe(snapshots.notice)  # a commit that asks for a snapshot wakes the saver
        if host is not None:
            host.spill_to(snapshots.spill)
    requests = Requests(
        ledger, gpu, settings.scan_cache_bytes, persists=lambda tenant: files is not None and policy.persists(tenant),
    )
    rooms = Rooms(
        ledger=ledger, gpu=gpu, host=host, copier=copier, snapshots=snapshots, requests=requests,
        placement=Placement(ledger, gpu, node.signal, retry_interval=settings.alloc_retry_interval,
                            retry_timeout=settings.alloc_retry_timeout),
        host_tier=HostTier(ledger, host),
        transfers=None if copier is None or host is None else Transfers(ledger, gpu, host, copier, requests),
        probes=Probes(ledger, gpu, host, policy, settings.server_uid, history_max_events=settings.history_max_events,
                      history_max_bytes=settings.history_max_bytes, keeper=node.keeper,
                      disk=files.store if files is not None else None),
        keeper=node.keeper,
    )
    return ServiceCore(rooms, device=device, settings=settings)


async def open_core(gpu: MemoryBackend, host: MemoryBackend | None = None, *, log: EventLog | None = None,
                    settings: Settings | None = None, stock_bytes: int = 0) -> ServiceCore:
    """A core over these backends without a server (no keeper, no copier, no disk
    tier), each table on its lane, inside Trio: for tests and benchmarks of the core."""
    core: ServiceCore | None = None
    gpu_memory = Memory(gpu, Lane("gpu"), stock_bytes)
    node = Node(gpu_memory, host, MemorySignal(), None, None, on_event=lambda event: None,
                state=lambda: core.state, host_room=lambda: None if core is None else host_room(core.state))
    device = await gpu_memory.device_info()
    settings = settings or Settings(server_uid=os.getuid())
    core = build_core(node, host_table(node, None), None, None, log if log is not None else EventLog(), device, settings)
    return core
