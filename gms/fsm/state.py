"""The folded state of one layout: who holds its lock, its tables, its residency.

States are immutable values.  The tables are persistent maps
(:class:`immutables.Map`), so a fold step shares everything it does not
change and costs O(log n) instead of a copy of the layout.  Byte totals are
kept as running sums by the fold, so accounting never scans a table.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import attrs
from immutables import Map

from .limits import Limits


class LockState(enum.Enum):
    """Derived from the state, never stored (the seed's four states)."""

    EMPTY = "EMPTY"
    RW = "RW"
    COMMITTED = "COMMITTED"
    RO = "RO"


# Tags of allocations an engine never publishes (its KV cache, its CUDA graphs):
# the server's host pool pins nothing for them (gms.server.tiers.pool_sizing).
KV_CACHE, CUDA_GRAPH = "kv_cache", "cuda_graph"
SCRATCH_TAGS = frozenset({KV_CACHE, CUDA_GRAPH})


class Residency(str, enum.Enum):
    """Where a committed layout's bytes must live (set by its writer or an admin)."""

    DEVICE = "device"  # on the GPU for good: never evicted
    SYSTEM = "system"  # a host copy is kept; the GPU copy is evictable and restored on use
    UNPINNED = "unpinned"  # no host copy; evicting drops the layout (its next user reloads)


class Tier(str, enum.Enum):
    """Where a layout's bytes are now.  The first tier is called ``device`` to
    users on both backends (the GPU's memory, or the host backend's stand-in)."""

    GPU = "device"
    HOST = "host"  # evicted: only the host copy holds the bytes
    RESTORING = "restoring"  # GPU memory exists again and is being filled (from the host copy or the disk)
    DISK = "disk"  # evicted or recovered: only the layout's snapshot on disk holds the bytes


@attrs.frozen(slots=False)  # dict-backed: made at three quarters of a slotted one's cost, once per allocation
class Allocation:
    allocation_id: str
    size: int
    aligned_size: int
    tag: str
    layout_slot: int


class MetadataEntry(NamedTuple):
    """One metadata entry.  A named tuple, not attrs: a node holds them by the
    hundred thousand, and a restart or a take-over rebuilds every one (an attrs
    frozen init cost 3 us each, a tuple's about 0.2; msgpack writes it as is)."""

    key: str
    allocation_id: str
    offset_bytes: int
    value: bytes


@attrs.frozen(slots=False)  # dict-backed: see gms.fsm.replace
class LayoutState:
    name: str
    writer: int | None = None
    readers: frozenset[int] = frozenset()
    committed: bool = False
    allocations: Map[str, Allocation] = Map()
    metadata: Map[str, MetadataEntry] = Map()
    # allocation id -> the metadata keys pointing into it (a set as a Map), so
    # freeing an allocation finds its keys without scanning every key.  Kept
    # while a writer builds the layout only: a committed layout's metadata never
    # changes (a writer's RW_CONNECT starts it afresh), so the commit drops it,
    # and a restart has none to rebuild.
    keys_by_allocation: Map[str, Map[str, None]] = Map()
    metadata_bytes: int = 0  # bytes of every key and value: what the daemon's RAM holds for it
    layout_hash: str | None = None
    next_layout_slot: int = 0
    held_bytes: int = 0  # aligned bytes of every allocation, whatever the tier
    owner: str | None = None  # the tenant charged for held_bytes: whoever built the layout
    residency: Residency = Residency.DEVICE
    tier: Tier = Tier.GPU
    restorer: int | None = None  # the reader filling the GPU copy from the host copy
    host_copies: Map[str, int] = Map()  # allocation id -> aligned bytes of its host copy
    host_bytes: int = 0
    persist: bool = False  # its writer asked for a snapshot on disk (gms.disk): saved after the commit
    disk_bytes: int = 0  # the size of its snapshot file; 0: none saved (yet)
    disk_file: str = ""  # the snapshot's file in the disk tier's folder (gms.disk.format.file_name)
    # The last whole snapshot of an earlier commit, kept while a writer rebuilds the
    # layout (RW_CONNECT clears the committed layout, not the one copy on disk): it goes
    # once a newer snapshot is whole (SNAPSHOT_SAVED), at a commit that asks for none, or
    # at an admin's delete.  A rebuild that ends with no newer commit (its writer gone,
    # RW_ABORT; the new commit's memory lost, LAYOUT_LOST) leaves the layout EMPTY with it,
    # and the disk tier brings it back (LAYOUT_RECOVERED; SNAPSHOT_SET_ASIDE where it does
    # not read); a node that dies mid-rebuild comes back with it or with the newer one.
    # Charged to ``kept_owner``, whose commit it holds.
    kept_file: str = ""
    kept_bytes: int = 0
    kept_owner: str | None = None
    save_error: str = ""  # why this commit's snapshot is not saved yet (its last SNAPSHOT_FAILED); "": none failed
    # Why this EMPTY layout's last snapshot was not served (SNAPSHOT_SET_ASIDE naming it:
    # set aside, or refused): its readers are told while they wait; a writer clears it.
    unserved: str = ""
    last_use: int = 0  # the node's tick when a lock on it was last taken or released
    loads: int = 0  # commits
    restores: int = 0
    evictions: int = 0

    @property
    def lock_state(self) -> LockState:
        return lock_state(self)

    @property
    def total_bytes(self) -> int:
        return self.held_bytes

    @property
    def gpu_bytes(self) -> int:
        """Bytes this layout holds on the GPU now."""
        return 0 if self.evicted else self.held_bytes

    @property
    def evicted(self) -> bool:
        """Its bytes are off the GPU, in a host copy or a snapshot: its next reader restores it."""
        return self.tier is Tier.HOST or self.tier is Tier.DISK

    @property
    def recovered(self) -> bool:
        """Committed, and only its snapshot holds it (a node that started from its disk)."""
        return self.committed and self.tier is Tier.DISK

    @property
    def disk_held(self) -> int:
        """Bytes of this layout's files on disk: its snapshot and a kept earlier one."""
        return self.disk_bytes + self.kept_bytes

    @property
    def saved(self) -> bool:
        """A snapshot of this committed layout is on disk (``disk_file``)."""
        return self.disk_bytes > 0

    @property
    def unsaved(self) -> bool:
        """A commit that asked to persist and is not on disk yet."""
        return self.committed and self.persist and not self.saved

    @property
    def awaits_revert(self) -> bool:
        """A rebuild left it EMPTY with the snapshot kept from before (its writer gone,
        its new commit lost): the disk tier brings that back."""
        return bool(self.kept_file) and lock_state(self) is LockState.EMPTY

    @property
    def resident(self) -> bool:
        return self.tier is Tier.GPU

    @property
    def vacant(self) -> bool:
        """Nothing held, nothing committed: the node forgets the layout."""
        return (
            self.writer is None
            and not self.readers
            and self.restorer is None
            and not self.committed
            and not self.allocations
            and not self.kept_file
            and not self.unserved
        )

    def holds_lock(self, conn: int) -> bool:
        return conn == self.writer or conn in self.readers or conn == self.restorer

    def fresh(self, **changes) -> LayoutState:
        """The empty layout of this name; its counters survive (they count uses of the name)."""
        counters = dict(
            loads=self.loads, restores=self.restores, evictions=self.evictions, last_use=self.last_use
        )
        return LayoutState(self.name, **{**counters, **changes})


def lock_state(state: LayoutState) -> LockState:
    if state.writer is not None:
        return LockState.RW
    if state.readers or state.restorer is not None:
        return LockState.RO
    if state.committed:
        return LockState.COMMITTED
    return LockState.EMPTY


# -- the node: every layout of one GPU, its sessions and tenants (gms.fsm.node folds it) ----

DEFAULT_TENANT = "default"


@attrs.frozen
class SessionInfo:
    """A handshaken connection: the layout it locks, and who it is."""

    layout: str
    tenant: str
    uid: int
    gid: int
    pid: int
    lock_type: str
    limit_bytes: int | None = None


@attrs.frozen(slots=False)  # dict-backed: see gms.fsm.replace
class TenantState:
    name: str
    quota_bytes: int | None = None  # None: unlimited
    used_bytes: int = 0
    sessions: int = 0
    metadata_quota: int | None = None  # bytes of keys and values; None: unlimited
    metadata_bytes: int = 0
    max_layouts: int | None = None  # None: only the node's cap
    # layout -> references: 1 if the tenant owns it, +1 per session of the
    # tenant that may write it (RW, RW_OR_RO).  A writer's session counts the
    # layout from its handshake, so the grant (which may come much later)
    # never adds one: the bound is checked once, when the session opens.
    layout_refs: Map[str, int] = Map()
    disk_quota: int | None = None  # bytes of snapshots on disk; None: unlimited
    disk_bytes: int = 0

    @property
    def layouts(self) -> int:
        return len(self.layout_refs)

    @property
    def over_bounds(self) -> tuple[str, ...]:
        return over_bounds(
            self.used_bytes, self.quota_bytes, self.metadata_bytes, self.metadata_quota, self.layouts,
            self.max_layouts,
        )


def charged_metadata(layout: LayoutState, per_entry: int) -> int:
    """What a layout's metadata is charged to its owner and the node: its keys and
    values, and ``per_entry`` (``Limits.metadata_entry_bytes``) for each entry."""
    return layout.metadata_bytes + len(layout.metadata) * per_entry


def over_bounds(
    used: int, quota: int | None, metadata: int, metadata_quota: int | None, layouts: int, max_layouts: int | None,
) -> tuple[str, ...]:
    """The bounds a tenant holds more than (``quota``, ``metadata_quota``,
    ``max_layouts``): a new server's policy lowered them under what it held.  It
    keeps what it holds and cannot grow past them (the fold's ``hold``)."""
    return tuple(
        name for name, total, bound in (
            ("quota", used, quota), ("metadata_quota", metadata, metadata_quota), ("max_layouts", layouts, max_layouts),
        ) if bound is not None and total > bound
    )


@attrs.frozen(slots=False)  # dict-backed: see gms.fsm.replace
class NodeState:
    started: bool = False
    capacity_bytes: int | None = None
    budget_bytes: int | None = None
    host_budget_bytes: int | None = None  # 0: the server keeps no host tier
    disk_budget_bytes: int | None = 0  # bytes of snapshots; 0: the server keeps no disk tier, None: no bound
    limits: Limits = Limits()
    layouts: Map[str, LayoutState] = Map()
    sessions: Map[int, SessionInfo] = Map()
    tenants: Map[str, TenantState] = Map()
    gpu_bytes: int = 0
    host_bytes: int = 0
    disk_bytes: int = 0
    metadata_bytes: int = 0
    tick: int = 0

    def layout(self, name: str) -> LayoutState:
        """The named layout; a vacant one if the node holds none of that name."""
        found = self.layouts.get(name)
        return found if found is not None else LayoutState(name)


EMPTY_NODE = NodeState()
