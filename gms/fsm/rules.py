"""Every rule of the state machine, in one table.

``RULES`` maps each event type to the :class:`Rule` that says when it may be
folded: who may send it (the role of its connection on the layout), the lock
states it may happen in and the state it leads to (``moves``, from which
docs/architecture.md draws its diagrams), the tiers it may happen in, and the
checks on its fields, in order.  Nothing else decides legality: decisions
build events, and :func:`check`, which the fold runs before every step,
accepts or refuses them.  Checked once, then trusted: a step never checks
again, and the commit's hash, computed by its decision, is taken as given
(``check_invariants`` recomputes it where that is wanted: tests, replays).

A refusal is a typed :class:`Rejection` saying what the client asked wrong;
the shell answers it and nothing is appended.  The same refusal of an event
the server proposed itself, or in a log being replayed, is an
:class:`InvariantViolation`: the server stops.

Node-wide bounds (the GPU and host budgets, tenant quotas, session limits,
the layout cap, the metadata bound) and each tenant's (its byte quota, its
metadata quota, its layouts) are checked here for the events that spend them
(a refusal names the limit, what is used and what was asked: OverLimit,
QuotaExceeded) and held by the fold for every event (``gms.fsm.node``): no
log can break one.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable

import attrs

from . import folding as steps
from .errors import (
    BudgetExceeded,
    HostBudgetExceeded,
    HostCopyMissing,
    InvalidArgument,
    InvariantViolation,
    LimitExceeded,
    ModeViolation,
    NotConnected,
    NotEvictable,
    OffsetOutOfBounds,
    OverLimit,
    PermissionDenied,
    QuotaExceeded,
    Rejection,
    StaleLayout,
    StateViolation,
    UnknownAllocation,
)
from .events import (
    RESUME_MODES,
    AllocationCreated,
    AllocationFreed,
    AllocationOomGaveUp,
    AllocationOomWait,
    ConnectionDropped,
    Event,
    HostCopyCreated,
    LayoutDeleted,
    LayoutEvicted,
    LayoutFellToDisk,
    LayoutLost,
    LayoutRecovered,
    LayoutRevoked,
    LayoutSpilled,
    LockTimeout,
    MetadataDeleted,
    MetadataPut,
    ReaderJoined,
    ReaderLeft,
    ResidencySet,
    RestoreAborted,
    RestoreClaimed,
    RestoreFinished,
    RestoreLoading,
    RoConnect,
    RoDisconnect,
    RwAbort,
    RwCommit,
    RwConnect,
    ServerResumed,
    ServerStarted,
    SessionClosed,
    SessionOpened,
    SessionRefused,
    SnapshotFailed,
    SnapshotSaved,
    SnapshotSetAside,
    StateDiscarded,
)
from .folding import entry_bytes
from .layout_hash import compute_layout_hash
from .node_steps import observation, server_resumed, session_closed, session_opened
from .releases import (
    ReleaseFn,
    aborted,
    cleared,
    dropped,
    everything,
    gpu_copy,
    half_restored,
    host_copies,
    kept_snapshot,
    kept_unasked,
    memory_copies,
    one_allocation,
)
from .state import LayoutState, LockState, Residency, Tier, lock_state

EMPTY, RW, COMMITTED, RO = LockState.EMPTY, LockState.RW, LockState.COMMITTED, LockState.RO
GPU, HOST, RESTORING, DISK = Tier.GPU, Tier.HOST, Tier.RESTORING, Tier.DISK
ALL_TIERS = frozenset(Tier)
_WHERE = {GPU: "on the GPU", HOST: "evicted to the host tier", RESTORING: "being restored", DISK: "on disk only"}

MAX_LAYOUT_NAME_BYTES = 128
_LAYOUT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+/-]*")
LOCK_TYPES = ("RW", "RO", "RW_OR_RO")
_SNAPSHOT_FILE = re.compile(r"[0-9a-f]{24}-[0-9a-f]{16}\.gsnap")  # gms.disk.format.file_name


class Who(enum.Enum):
    """The role an event's connection must have on the event's layout."""

    ANYONE = "anyone"  # the server (conn 0), an admin, any connection
    SESSION = "a session on the layout that holds no lock"  # a handshake being granted
    WRITER = "the writer"
    READER = "a reader"
    RESTORER = "the restorer"
    HOLDER = "a lock holder"  # writer, reader or restorer


@attrs.frozen
class Move:
    """One edge of the diagram: ``before`` -> ``after`` (lock states or tiers)."""

    before: enum.Enum
    after: enum.Enum
    note: str = ""


def stays(*states: enum.Enum) -> tuple[Move, ...]:
    return tuple(Move(s, s) for s in states)


Check = Callable[["object", LayoutState, Event], None]
LayoutStep = Callable[[LayoutState, Event], LayoutState]  # gms.fsm.folding
NodeStep = Callable[["object", Event, int], "object"]  # gms.fsm.node_steps: (node, event, tick) -> node


@attrs.frozen
class Rule:
    who: Who
    moves: tuple[Move, ...]  # lock states it may happen in, and where each leads
    tier_moves: tuple[Move, ...] = stays(*Tier)  # tiers it may happen in, and where each leads
    checks: tuple[Check, ...] = ()
    action: str = ""  # the client's word for it, in refusals
    refusal: type[Rejection] = StateViolation  # when the lock state or tier does not allow it
    needs_layout: bool = True  # False: node events that may name no layout
    # What it does beyond its fold step, for the shell and the LRU order:
    uses: bool = False  # the layout counts as used after it (the eviction order)
    makes_room: bool = False  # an idle layout may have become evictable (a lock let go, a residency set, a save ended)
    owns: bool = False  # the writer's tenant becomes the layout's owner (charged for it)
    # Declared by every row (no default): the memory it releases, read from the
    # layout before it (a function of gms.fsm.releases; None: none), and whether
    # a restart keeps what it did (``lasting``: the node's configuration, or a
    # committed layout made, cleared, dropped, evicted, restored or pinned).  An
    # answer that tells of a lasting change leaves only once the keeper holds
    # it (gms.server.restart.mirror); a restart keeps nothing else (no session,
    # lock, unfinished build or restore half done).
    releases: ReleaseFn | None = attrs.field(kw_only=True)
    lasting: bool = attrs.field(kw_only=True)
    # A row not lasting whose some events are (``is_lasting``): e.g. an abort that discards.
    lasting_when: Callable[[Event], bool] | None = attrs.field(default=None, kw_only=True)
    # What it does: its fold step on the node, on the layout it names, or both (the node's first).
    step: LayoutStep | None = None  # on the layout it names (the node settles the bytes)
    node_step: NodeStep | None = None  # on the node (the server's resume, sessions)
    # Where it may happen, derived once from the moves.  Tuples, not sets: a few
    # members each, found by identity without hashing an enum on the hot path.
    locks: tuple[LockState, ...] = attrs.field(init=False)
    tiers: tuple[Tier, ...] = attrs.field(init=False)
    anywhere: bool = attrs.field(init=False)  # every lock state, every tier: nothing to look up
    plays: Callable[[object, LayoutState, int], bool] | None = attrs.field(init=False)  # None: anyone
    # Where the role settles the lock state: the writer's layout is RW (see
    # ``lock_state``), so only the tier is left to ask.
    lock_known: bool = attrs.field(init=False)
    # The moves as (before, after) pairs: the fold checks each step's outcome against them.
    lock_pairs: frozenset = attrs.field(init=False)
    tier_pairs: frozenset = attrs.field(init=False)
    still: bool = attrs.field(init=False)  # every move stays where it was (most of the writer's events)

    def __attrs_post_init__(self) -> None:
        if self.step is None and self.node_step is None:
            raise ValueError("a rule has a fold step: on its layout, on the node, or both")
        object.__setattr__(self, "lock_pairs", frozenset((move.before, move.after) for move in self.moves))
        object.__setattr__(self, "tier_pairs", frozenset((move.before, move.after) for move in self.tier_moves))
        object.__setattr__(self, "still", all(m.before is m.after for m in (*self.moves, *self.tier_moves)))
        object.__setattr__(self, "locks", tuple(dict.fromkeys(move.before for move in self.moves)))
        object.__setattr__(self, "tiers", tuple(dict.fromkeys(move.before for move in self.tier_moves)))
        object.__setattr__(self, "anywhere", set(self.locks) == set(LockState) and set(self.tiers) == set(Tier))
        object.__setattr__(self, "plays", _PLAYS.get(self.who))
        object.__setattr__(self, "lock_known", self.who is Who.WRITER and RW in self.locks)


# -- the roles --------------------------------------------------------------------------


def _free_session(node, layout: LayoutState, conn: int) -> bool:
    """A session on the layout that holds no lock yet: one a grant may go to."""
    session = node.sessions.get(conn)
    return session is not None and session.layout == layout.name and not layout.holds_lock(conn)


# Who holds the role, asked cheaply (ANYONE: nobody to ask); ``require`` explains a False.
_PLAYS: dict[Who, Callable[[object, LayoutState, int], bool]] = {
    Who.WRITER: lambda node, layout, conn: layout.writer == conn,
    Who.READER: lambda node, layout, conn: conn in layout.readers,
    Who.RESTORER: lambda node, layout, conn: layout.restorer == conn,
    Who.HOLDER: lambda node, layout, conn: layout.holds_lock(conn),
    Who.SESSION: _free_session,
}


def require(layout: LayoutState, conn: int, who: Who, action: str, node=None) -> None:
    """Raise the Rejection that says why ``conn`` is not ``who`` on ``layout``."""
    if who is Who.ANYONE or (who is not Who.SESSION and _PLAYS[who](node, layout, conn)):
        return
    if who is Who.WRITER and layout.holds_lock(conn):
        raise ModeViolation(f"{action} needs the RW lock; this connection holds RO")
    if who is Who.RESTORER:
        raise StateViolation("this connection is not restoring the layout")
    if who is Who.SESSION:
        session = node.sessions.get(conn) if node is not None else None
        if session is None or session.layout != layout.name:
            raise StateViolation(f"{action}: connection {conn} has no session on layout {layout.name!r}")
        if layout.holds_lock(conn):
            raise StateViolation(f"{action}: connection {conn} holds a lock on {layout.name!r} already")
        return
    raise NotConnected(f"{action} needs a lock: send HandshakeRequest first")


# -- checks on fields ---------------------------------------------------------------------


def check_text(name: str, text: str, max_bytes: int) -> None:
    if not text:
        raise InvalidArgument(f"{name} must not be empty")
    if len(text.encode()) > max_bytes:
        raise LimitExceeded(f"{name} is longer than {max_bytes} bytes")


def check_layout_name(name: object) -> str:
    """Printable, short, no odd bytes: names show up in logs, metrics and file names."""
    if not isinstance(name, str) or not name:
        raise InvalidArgument("a layout name must be a non-empty string")
    if len(name.encode()) > MAX_LAYOUT_NAME_BYTES:
        raise InvalidArgument(f"layout name is longer than {MAX_LAYOUT_NAME_BYTES} bytes")
    if not _LAYOUT_NAME.fullmatch(name):
        raise InvalidArgument(
            f"layout name {name!r} must start with a letter or digit and hold only "
            "letters, digits and . _ : @ + / -"
        )
    return name


def parse_residency(value: Residency | str) -> Residency:
    try:
        return Residency(value)
    except ValueError:
        choices = ", ".join(r.value for r in Residency)
        raise InvalidArgument(f"unknown residency {value!r}; choose one of {choices}") from None


def allocation_of(layout: LayoutState, allocation_id: str):
    allocation = layout.allocations.get(allocation_id)
    if allocation is None:
        raise UnknownAllocation(f"no allocation {allocation_id!r} in the current layout")
    return allocation


def _new_allocation(node, layout: LayoutState, e: AllocationCreated) -> None:
    if e.allocation_id in layout.allocations:
        raise StateViolation(f"allocation {e.allocation_id!r} exists")
    if e.layout_slot != layout.next_layout_slot:
        raise StateViolation(f"slot {e.layout_slot} is not the next one ({layout.next_layout_slot})")


def _allocation_sizes(node, layout: LayoutState, e: AllocationCreated) -> None:
    limits = node.limits
    if e.size <= 0:
        raise InvalidArgument(f"allocation size must be positive, got {e.size}")
    if e.aligned_size < e.size:
        raise InvalidArgument(f"aligned size {e.aligned_size} is below the size {e.size}")
    if limits.max_allocation_bytes is not None and e.size > limits.max_allocation_bytes:
        raise LimitExceeded(f"allocation of {e.size} bytes exceeds the {limits.max_allocation_bytes}-byte limit")
    if not e.tag or len(e.tag) > limits.max_tag_bytes // 4:  # (UTF-8: at most 4 bytes a character)
        check_text("tag", e.tag, limits.max_tag_bytes)
    if len(layout.allocations) >= limits.max_allocations:
        raise LimitExceeded(f"layout already holds {limits.max_allocations} allocations")


def fits_budget_ever(node, layout: LayoutState, total: int) -> None:
    budget = node.budget_bytes
    if budget is not None and total > budget:
        raise BudgetExceeded(
            f"layout {layout.name!r} would hold {total} bytes, more than the GPU budget of "
            f"{budget} bytes: it can never fit"
        )


def _allocation_admitted(node, layout: LayoutState, e: AllocationCreated) -> None:
    """The writer's session limit, then its tenant's quota, then the budget."""
    more = e.aligned_size
    session = node.sessions.get(e.conn)
    if session is None:
        raise InvariantViolation(f"conn {e.conn} spends bytes without a session")
    if session.limit_bytes is not None and layout.held_bytes + more > session.limit_bytes:
        raise QuotaExceeded("session", layout.held_bytes, more, session.limit_bytes)
    tenant = node.tenants[session.tenant]
    if tenant.quota_bytes is not None and tenant.used_bytes + more > tenant.quota_bytes:
        raise QuotaExceeded("tenant", tenant.used_bytes, more, tenant.quota_bytes)
    if node.budget_bytes is not None:
        fits_budget_ever(node, layout, layout.held_bytes + more)


def _known_allocation(node, layout: LayoutState, e) -> None:
    if e.allocation_id not in layout.allocations:
        allocation_of(layout, e.allocation_id)  # says why


def _unreferenced(node, layout: LayoutState, e: AllocationFreed) -> None:
    keys = layout.keys_by_allocation.get(e.allocation_id)
    if keys:
        raise StateViolation(f"metadata {next(iter(keys))!r} still points into {e.allocation_id!r}")


def _metadata_entry(node, layout: LayoutState, e: MetadataPut) -> None:
    limits = node.limits
    if not e.key or len(e.key) > limits.max_key_bytes // 4:
        check_text("metadata key", e.key, limits.max_key_bytes)
    if len(e.value) > limits.max_metadata_value_bytes:
        raise LimitExceeded(f"metadata value of {len(e.value)} bytes exceeds {limits.max_metadata_value_bytes}")
    allocation = allocation_of(layout, e.allocation_id)
    if not 0 <= e.offset_bytes < allocation.size:
        raise OffsetOutOfBounds(
            f"offset {e.offset_bytes} is outside allocation {e.allocation_id!r} of {allocation.size} bytes"
        )
    old = layout.metadata.get(e.key)
    if old is None and len(layout.metadata) >= limits.max_metadata_keys:
        raise LimitExceeded(f"layout already holds {limits.max_metadata_keys} metadata keys")
    more = entry_bytes(e.key, e.value) - (
        entry_bytes(old.key, old.value) if old is not None else -limits.metadata_entry_bytes
    )
    if more > 0:
        within_metadata_bounds(node, layout, more)


def within_metadata_bounds(node, layout: LayoutState, more: int) -> None:
    """Metadata is the daemon's RAM (keys, values, and each entry's own cost):
    the owner's metadata quota, then the node's bound."""
    tenant = node.tenants[layout.owner]
    if tenant.metadata_quota is not None and tenant.metadata_bytes + more > tenant.metadata_quota:
        raise OverLimit(
            "metadata_quota", "tenant", tenant.metadata_bytes, more, tenant.metadata_quota,
            f"tenant {tenant.name!r}'s metadata quota (keys and values, in the server's RAM) would be passed",
        )
    bound = node.limits.max_metadata_bytes
    if bound is not None and node.metadata_bytes + more > bound:
        raise OverLimit(
            "max_metadata_bytes", "node", node.metadata_bytes, more, bound,
            "the server's metadata bound (keys and values of every layout) would be passed",
        )


def _known_key(node, layout: LayoutState, e: MetadataDeleted) -> None:
    if e.key not in layout.metadata:
        raise StateViolation(f"no metadata key {e.key!r}")


def require_host_copies(layout: LayoutState) -> None:
    missing = len(layout.allocations) - len(layout.host_copies)
    if missing:
        raise HostCopyMissing(
            f"residency system needs a host copy of every allocation; {missing} of "
            f"{len(layout.allocations)} have none (the client library makes them at commit)"
        )


def _residency_field(node, layout: LayoutState, e: RwCommit | ResidencySet) -> None:
    if parse_residency(e.residency) is Residency.SYSTEM:
        require_host_copies(layout)


def _persist_field(node, layout: LayoutState, e: RwCommit) -> None:
    if e.persist:
        require_disk_tier(node)


def require_disk_tier(node) -> None:
    if node.disk_budget_bytes == 0:
        raise StateViolation("this server keeps no disk tier (gms serve --disk-dir)")


def _within_disk_bounds(node, owner: str, more: int, owner_freed: int = 0, freed: int = 0) -> None:
    """A snapshot's bytes: its owner's disk quota, then the node's disk budget
    (``owner_freed``, ``freed``: bytes of files released with it, the owner's and the node's)."""
    tenant = node.tenants[owner]
    if tenant.disk_quota is not None and tenant.disk_bytes - owner_freed + more > tenant.disk_quota:
        raise OverLimit(
            "disk_quota", "tenant", tenant.disk_bytes - owner_freed, more, tenant.disk_quota,
            f"tenant {owner!r}'s disk quota (its layouts' snapshots) would be passed",
        )
    budget = node.disk_budget_bytes
    if budget is not None and node.disk_bytes + more - freed > budget:
        raise OverLimit(
            "disk_budget", "node", node.disk_bytes - freed, more, budget, "the disk tier's budget would be passed",
        )


def _snapshot_admitted(node, layout: LayoutState, e: SnapshotSaved) -> None:
    require_disk_tier(node)
    if not layout.persist:
        raise StateViolation(f"layout {layout.name!r} was not committed to persist")
    if e.layout_hash != layout.layout_hash:
        raise StaleLayout(f"layout {layout.name!r} is committed with another hash than the snapshot's")
    if layout.saved:
        raise StateViolation(f"layout {layout.name!r} has a snapshot already")
    check_snapshot(e)
    # (the snapshot kept through the rebuild goes with this one: its bytes are room)
    freed = layout.kept_bytes
    _within_disk_bounds(node, layout.owner, e.bytes, freed if layout.kept_owner == layout.owner else 0, freed)


def check_snapshot(e: SnapshotSaved | LayoutRecovered) -> None:
    """A size, and a file name of the disk tier's own making (no folder, no link out of it)."""
    if e.bytes <= 0:
        raise InvalidArgument("a snapshot has a size")
    if not _SNAPSHOT_FILE.fullmatch(e.file):
        raise InvalidArgument(f"{e.file!r} is not a snapshot's file name")


def _recovery_admitted(node, layout: LayoutState, e: LayoutRecovered) -> None:
    """A snapshot is trusted no more than a client: everything a writer's events
    would have been checked for, its hash recomputed, the owner's bounds."""
    require_disk_tier(node)
    check_layout_name(e.layout)
    parse_residency(e.residency)
    tenant = node.tenants.get(e.owner)
    if tenant is None:
        raise PermissionDenied(f"tenant {e.owner!r} is not configured on this server")
    limits = node.limits
    if len(e.allocations) > limits.max_allocations or len(e.metadata) > limits.max_metadata_keys:
        raise LimitExceeded("the snapshot holds more allocations or metadata keys than this server allows")
    sizes: dict[str, int] = {}
    slots = set()
    for allocation_id, size, aligned, tag, slot in e.allocations:
        if allocation_id in sizes or slot in slots or not isinstance(slot, int) or slot < 0:
            raise InvalidArgument(f"allocation {allocation_id!r} or slot {slot} repeats")
        if not 0 < size <= aligned or (limits.max_allocation_bytes is not None and size > limits.max_allocation_bytes):
            raise InvalidArgument(f"allocation {allocation_id!r} has sizes {size}/{aligned}")
        check_text("tag", tag, limits.max_tag_bytes)
        sizes[allocation_id] = size
        slots.add(slot)
    metadata = 0
    if len({row[0] for row in e.metadata}) != len(e.metadata):
        raise InvalidArgument("the snapshot repeats a metadata key")
    for key, allocation_id, offset, value in e.metadata:
        check_text("metadata key", key, limits.max_key_bytes)
        if len(value) > limits.max_metadata_value_bytes:
            raise LimitExceeded(f"metadata value of {len(value)} bytes exceeds {limits.max_metadata_value_bytes}")
        if not 0 <= offset < sizes.get(allocation_id, 0):
            raise OffsetOutOfBounds(f"metadata {key!r} points outside its allocation")
        metadata += entry_bytes(key, value) + limits.metadata_entry_bytes
    recovered = fold_layout(layout, e)
    if compute_layout_hash(recovered.allocations.values(), recovered.metadata.values()) != e.layout_hash:
        raise InvalidArgument("the snapshot's allocations and metadata do not hash to its layout hash")
    held = recovered.held_bytes
    if tenant.quota_bytes is not None and tenant.used_bytes + held > tenant.quota_bytes:
        raise QuotaExceeded("tenant", tenant.used_bytes, held, tenant.quota_bytes)
    fits_budget_ever(node, layout, held)
    within_metadata_bounds(node, recovered, metadata)
    _layout_admitted(node, tenant, e)
    check_snapshot(e)
    # (a snapshot kept through a rebuild, brought back: its bytes are charged already)
    freed = layout.kept_bytes if e.file == layout.kept_file else 0
    _within_disk_bounds(node, e.owner, e.bytes, freed if layout.kept_owner == e.owner else 0, freed)


def require_host_tier(node) -> None:
    """A server started without a host tier (its budget 0) refuses everything of it."""
    if node.host_budget_bytes == 0:
        raise StateViolation("this server keeps no host tier")


def check_lock_type(value: object) -> str:
    """A lock type a handshake may ask for (the request's, then its event's)."""
    if value not in LOCK_TYPES:
        raise InvalidArgument(f"unknown lock type {value!r}")
    return value


def _host_copy_admitted(node, layout: LayoutState, e: HostCopyCreated) -> None:
    require_host_tier(node)
    allocation = allocation_of(layout, e.allocation_id)
    if e.allocation_id in layout.host_copies:
        raise StateViolation(f"allocation {e.allocation_id!r} has a host copy")
    budget = node.host_budget_bytes
    if budget is not None and node.host_bytes + allocation.aligned_size > budget:
        raise HostBudgetExceeded(
            f"host tier full: {node.host_bytes} bytes used + {allocation.aligned_size} asked > "
            f"the host budget of {budget} bytes"
        )


def _spill_admitted(node, layout: LayoutState, e: LayoutSpilled) -> None:
    if not layout.saved:
        raise NotEvictable(f"cannot spill layout {layout.name!r} to disk: it has no snapshot")
    if not layout.host_copies:
        raise NotEvictable(f"cannot spill layout {layout.name!r}: it holds no host copy")
    if layout.restorer is not None:
        raise NotEvictable(f"cannot spill layout {layout.name!r}: a reader is restoring it")


def _fall_admitted(node, layout: LayoutState, e: LayoutFellToDisk) -> None:
    if not layout.saved:
        raise StateViolation(f"layout {layout.name!r} has no snapshot to fall back to: it is lost")


def _not_pinned(node, layout: LayoutState, e: LayoutEvicted) -> None:
    if layout.residency is Residency.DEVICE:
        raise NotEvictable(f"cannot evict layout {layout.name!r}: it is pinned to the device (residency device)")


def _saved_first(node, layout: LayoutState, e: LayoutEvicted) -> None:
    """A commit asked to persist leaves the GPU for its snapshot, not for nothing: while
    its save may still land it stays (a failed one lets it go, as an unpinned layout)."""
    if layout.unsaved and not layout.save_error and steps.restore_source(layout) is not Tier.HOST:
        raise NotEvictable(f"cannot evict layout {layout.name!r} yet: it was committed to persist and its "
                           "snapshot is being saved (evictable to disk once it is)")


def discards(e: RwAbort) -> bool:
    """An abort that lets the kept snapshot go: a restart must not bring it back."""
    return e.discard


def _restore_admitted(node, layout: LayoutState, e: RestoreLoading) -> None:
    fits_budget_ever(node, layout, layout.held_bytes)


def _session_admitted(node, layout: LayoutState | None, e: SessionOpened) -> None:
    if e.conn in node.sessions:
        raise StateViolation("this connection has already handshaken")
    if e.layout not in node.layouts:  # a layout's name was checked when it was made
        check_layout_name(e.layout)  # also when empty: then ``layout`` is None
    check_lock_type(e.lock_type)
    tenant = node.tenants.get(e.tenant)
    if tenant is None:
        raise PermissionDenied(f"tenant {e.tenant!r} is not configured on this server")
    if e.limit_bytes is not None:
        if e.limit_bytes < 0:
            raise InvalidArgument("limit_bytes must be >= 0")
        if tenant.quota_bytes is not None and e.limit_bytes > tenant.quota_bytes:
            raise InvalidArgument(
                f"limit_bytes {e.limit_bytes} exceeds tenant {e.tenant!r}'s quota of "
                f"{tenant.quota_bytes} bytes: a session may narrow its limit, never widen it"
            )
    if e.expect_hash:
        _expected_layout(node, e)
    if e.lock_type != "RO":
        _layout_admitted(node, tenant, e)


def _layout_admitted(node, tenant, e: SessionOpened | LayoutRecovered) -> None:
    """A session that may write a layout counts it against its tenant from the
    handshake (see TenantState.layout_refs), and a new layout against the node."""
    bound = tenant.max_layouts
    if bound is not None and e.layout not in tenant.layout_refs and tenant.layouts >= bound:
        raise OverLimit(
            "max_layouts", "tenant", tenant.layouts, 1, bound,
            f"tenant {tenant.name!r} already owns or may write {tenant.layouts} layouts",
        )
    cap = node.limits.max_layouts
    if e.layout not in node.layouts and len(node.layouts) >= cap:
        raise OverLimit("max_layouts", "node", len(node.layouts), 1, cap, f"the server already holds {cap} layouts")


def _expected_layout(node, e: SessionOpened) -> None:
    """Checked when the handshake arrives; a layout that changes while the
    handshake waits behind a writer is granted with its new hash, which the
    client compares."""
    if e.lock_type == "RW":
        raise InvalidArgument("expect_hash is for readers (RO or RW_OR_RO), not RW")
    layout = node.layouts.get(e.layout)
    if layout is None or not layout.committed:
        raise StaleLayout(f"layout {e.layout!r} holds no committed layout (expected {e.expect_hash[:12]})")
    if layout.layout_hash != e.expect_hash:
        raise StaleLayout(
            f"layout {e.layout!r} is committed with hash {layout.layout_hash[:12]}, not {e.expect_hash[:12]}"
        )


def _asks_to_read(node, layout: LayoutState, e: ReaderJoined) -> None:
    if e.lock_type == "RW":
        raise StateViolation("a session that asked to write cannot join as a reader")


def _session_ends(node, layout: LayoutState, e: SessionClosed) -> None:
    session = node.sessions.get(e.conn)
    if session is None or session.layout != e.layout:
        raise StateViolation(f"connection {e.conn} has no session on layout {e.layout!r}")
    if layout.holds_lock(e.conn):
        raise StateViolation("the session still holds a lock")


def _resumable(node, layout: LayoutState | None, e: ServerResumed) -> None:
    """What a new server cannot take over is refused here, before it serves."""
    if e.mode not in RESUME_MODES:
        raise InvalidArgument(f"unknown resume mode {e.mode!r}")
    if e.host_budget_bytes == 0 and node.host_bytes:
        raise StateViolation(
            f"the node keeps {node.host_bytes} bytes of host copies and the new server keeps no host tier"
        )
    # A bound lowered under what the node holds would break an invariant at once:
    # the new server must be started with room for what it takes over.
    if e.budget_bytes is not None and node.gpu_bytes > e.budget_bytes:
        raise BudgetExceeded(
            f"the node holds {node.gpu_bytes} bytes on the GPU, more than the new GPU budget of {e.budget_bytes}"
        )
    if e.host_budget_bytes is not None and node.host_bytes > e.host_budget_bytes:
        raise HostBudgetExceeded(
            f"the node holds {node.host_bytes} bytes of host copies, more than the new host budget of "
            f"{e.host_budget_bytes}"
        )
    # Metadata and disk bounds lowered under what is held (a tenant's policy, the
    # node's bound, a new charge per entry, a smaller disk tier or none) are
    # applied, not refused: one tenant's policy, or an upgrade, must not stop the node.  What is over keeps what it holds
    # and cannot grow until it is under (the fold's ``hold``; ``over_bounds``).


# -- the table ------------------------------------------------------------------------------

ANY_LOCK = stays(*LockState)
EVICTED_LEAVES = (
    Move(HOST, HOST), Move(DISK, DISK), Move(RESTORING, HOST, "half-filled memory released"),
    Move(RESTORING, DISK, "half-filled memory released"),
)

RULES: dict[type[Event], Rule] = {
    # locks
    RwConnect: Rule(
        Who.SESSION,
        (Move(EMPTY, RW), Move(COMMITTED, RW, "the layout is cleared")),
        (Move(GPU, GPU), Move(HOST, GPU, "the host copy is dropped"),
         Move(DISK, GPU, "its snapshot kept till a newer one is whole")),
        uses=True, owns=True, releases=cleared, lasting=True, step=steps.rw_connect,
    ),
    RwCommit: Rule(
        Who.WRITER, (Move(RW, COMMITTED),), checks=(_residency_field, _persist_field), action="commit", uses=True,
        makes_room=True, releases=kept_unasked, lasting=True, step=steps.rw_commit,
    ),
    RwAbort: Rule(
        Who.WRITER, (Move(RW, EMPTY, "a snapshot kept through the rebuild stays, to be recovered, unless discarded"),),
        action="abort", uses=True, releases=aborted, lasting=False, lasting_when=discards,
        step=steps.rw_abort,
    ),
    RoConnect: Rule(
        Who.SESSION, (Move(COMMITTED, RO), Move(RO, RO, "another reader")), stays(GPU), uses=True,
        releases=None, lasting=False, step=steps.ro_connect,
    ),
    RoDisconnect: Rule(
        Who.READER, (Move(RO, RO, "not the last"), Move(RO, COMMITTED, "the last")), uses=True, makes_room=True,
        releases=None, lasting=False, step=steps.ro_disconnect,
    ),
    # a reader's visit in two events: SESSION_OPENED and RO_CONNECT in one, RO_DISCONNECT and SESSION_CLOSED in one
    ReaderJoined: Rule(
        Who.ANYONE, (Move(COMMITTED, RO), Move(RO, RO, "another reader")), stays(GPU),
        checks=(_session_admitted, _asks_to_read), uses=True, releases=None, lasting=False, node_step=session_opened,
        step=steps.ro_connect,
    ),
    ReaderLeft: Rule(
        Who.READER, (Move(RO, RO, "not the last"), Move(RO, COMMITTED, "the last")), uses=True, makes_room=True,
        releases=None, lasting=False, node_step=session_closed, step=steps.ro_disconnect,
    ),
    # the writer's layout
    AllocationCreated: Rule(
        Who.WRITER, stays(RW), stays(GPU),
        (_new_allocation, _allocation_sizes, _allocation_admitted), action="allocate",
        releases=None, lasting=False, step=steps.allocation_created,
    ),
    AllocationFreed: Rule(
        Who.WRITER, stays(RW), stays(GPU), (_known_allocation, _unreferenced), action="free",
        releases=one_allocation, lasting=False, step=steps.allocation_freed,
    ),
    MetadataPut: Rule(
        Who.WRITER, stays(RW), stays(GPU), (_metadata_entry,), action="metadata_put", releases=None, lasting=False,
        step=steps.metadata_put,
    ),
    MetadataDeleted: Rule(
        Who.WRITER, stays(RW), stays(GPU), (_known_key,), action="metadata_delete", releases=None, lasting=False,
        step=steps.metadata_deleted,
    ),
    HostCopyCreated: Rule(
        Who.WRITER, stays(RW), stays(GPU), (_host_copy_admitted,), action="host copies", releases=None,
        lasting=False, step=steps.host_copy_created,
    ),
    # residency
    ResidencySet: Rule(
        Who.ANYONE, stays(COMMITTED, RO), stays(GPU), (_residency_field,), action="pin", makes_room=True,
        releases=None, lasting=True, step=steps.residency_set,
    ),
    LayoutEvicted: Rule(
        Who.ANYONE,
        (Move(COMMITTED, COMMITTED, "system: kept in the host tier"), Move(COMMITTED, EMPTY, "unpinned: dropped")),
        (Move(GPU, HOST, "system"), Move(GPU, DISK, "saved, no host copy: kept in its snapshot"),
         Move(GPU, GPU, "unpinned: a fresh layout")),
        (_not_pinned, _saved_first), action="evict", refusal=NotEvictable, releases=gpu_copy, lasting=True,
        step=steps.layout_evicted,
    ),
    RestoreClaimed: Rule(
        Who.SESSION, (Move(COMMITTED, RO, "the reader restores"),), stays(HOST, DISK), uses=True, releases=None,
        lasting=False, step=steps.restore_claimed,
    ),
    RestoreLoading: Rule(
        Who.RESTORER, stays(RO), (Move(HOST, RESTORING, "GPU memory made"), Move(DISK, RESTORING, "GPU memory made")),
        (_restore_admitted,),
        releases=None, lasting=False, step=steps.restore_loading,
    ),
    RestoreFinished: Rule(
        Who.RESTORER, stays(RO), (Move(RESTORING, GPU, "filled: the restorer reads"),), uses=True, makes_room=True,
        releases=None, lasting=True, step=steps.restore_finished,
    ),
    RestoreAborted: Rule(
        Who.RESTORER, (Move(RO, COMMITTED),), EVICTED_LEAVES, makes_room=True, releases=half_restored,
        lasting=False, step=steps.restore_aborted,
    ),
    # a restarted server found the layout's memory gone: dropped whole, once nobody holds it
    LayoutLost: Rule(
        Who.ANYONE, (Move(COMMITTED, EMPTY, "dropped"),),
        (Move(GPU, GPU, "a fresh layout"), Move(HOST, GPU, "a fresh layout"), Move(DISK, GPU, "a fresh layout")),
        releases=dropped, lasting=True, step=steps.layout_lost,
    ),
    # an admin's delete: an idle committed layout goes from every tier, its snapshot too
    LayoutDeleted: Rule(
        Who.ANYONE, (Move(COMMITTED, EMPTY, "deleted"),),
        (Move(GPU, GPU, "a fresh layout"), Move(HOST, GPU, "a fresh layout"), Move(DISK, GPU, "a fresh layout")),
        action="delete", refusal=NotEvictable, releases=everything, lasting=True, step=steps.layout_deleted,
    ),
    # the disk tier (gms.disk): a snapshot saved after a commit; a layout recovered from one at a cold start
    SnapshotSaved: Rule(
        Who.ANYONE, stays(COMMITTED, RO), stays(GPU, HOST, RESTORING), (_snapshot_admitted,), action="save",
        makes_room=True, releases=kept_snapshot, lasting=True, step=steps.snapshot_saved,
    ),
    # ... unless its snapshot holds it: then it goes on, on the disk tier
    LayoutFellToDisk: Rule(
        Who.ANYONE, stays(COMMITTED),
        (Move(GPU, DISK, "its snapshot holds it"), Move(HOST, DISK, "its snapshot holds it")), (_fall_admitted,),
        action="fall to disk", releases=memory_copies, lasting=True, step=steps.layout_fell_to_disk,
    ),
    LayoutSpilled: Rule(
        Who.ANYONE, stays(COMMITTED), (Move(HOST, DISK, "its snapshot holds it"),), (_spill_admitted,),
        action="spill", refusal=NotEvictable, releases=host_copies, lasting=True, step=steps.layout_spilled,
    ),
    LayoutRecovered: Rule(
        Who.ANYONE, (Move(EMPTY, COMMITTED, "from its snapshot"),), (Move(GPU, DISK, "only the snapshot holds it"),),
        (_recovery_admitted,), action="recover", releases=None, lasting=True, step=steps.layout_recovered,
    ),
    # a new server with the node's state
    ServerResumed: Rule(
        Who.ANYONE, ANY_LOCK, checks=(_resumable,), needs_layout=False, releases=None, lasting=True,
        node_step=server_resumed,
    ),
    # sessions
    SessionOpened: Rule(
        Who.ANYONE, ANY_LOCK, checks=(_session_admitted,), needs_layout=False, releases=None, lasting=False,
        node_step=session_opened,
    ),
    SessionClosed: Rule(
        Who.ANYONE, ANY_LOCK, checks=(_session_ends,), releases=None, lasting=False, node_step=session_closed,
    ),
    # observations: they change nothing (a STATE_DISCARDED is kept: it says why the node started empty)
    AllocationOomWait: Rule(Who.HOLDER, stays(RW, RO), releases=None, lasting=False, step=steps.unchanged),
    AllocationOomGaveUp: Rule(Who.HOLDER, stays(RW, RO), releases=None, lasting=False, step=steps.unchanged),
    LockTimeout: Rule(Who.SESSION, ANY_LOCK, releases=None, lasting=False, step=steps.unchanged),
    SessionRefused: Rule(Who.ANYONE, ANY_LOCK, needs_layout=False, releases=None, lasting=False, node_step=observation),
    LayoutRevoked: Rule(Who.ANYONE, ANY_LOCK, releases=None, lasting=False, node_step=observation),
    ConnectionDropped: Rule(
        Who.ANYONE, ANY_LOCK, needs_layout=False, releases=None, lasting=False, node_step=observation,
    ),
    StateDiscarded: Rule(Who.ANYONE, ANY_LOCK, needs_layout=False, releases=None, lasting=True, node_step=observation),
    SnapshotFailed: Rule(Who.ANYONE, ANY_LOCK, makes_room=True, releases=None, lasting=False,
                         step=steps.snapshot_failed),
    # (where it names a layout whose kept snapshot it is, that is kept no longer: the file was set aside or left)
    SnapshotSetAside: Rule(Who.ANYONE, ANY_LOCK, needs_layout=False, releases=None, lasting=True,
                           step=steps.snapshot_set_aside),
}
NODE_ONLY = (ServerStarted,)  # no layout, no rule: the fold's first event (lasting: the configuration)
# The kinds whose effect a restart keeps (their rows' ``lasting``, and the start).
LASTING = frozenset({ServerStarted.KIND} | {kind.KIND for kind, rule in RULES.items() if rule.lasting})
_LASTING_WHEN = {kind.KIND: rule.lasting_when for kind, rule in RULES.items() if rule.lasting_when is not None}


def is_lasting(event: Event) -> bool:
    """Must a restart keep what ``event`` did (its answer waits for the keeper to hold it)?"""
    if event.KIND in LASTING:
        return True
    when = _LASTING_WHEN.get(event.KIND)
    return when is not None and when(event)


def kinds(flag: str) -> frozenset[type[Event]]:
    """The event types whose rule has ``flag`` (``uses``, ``releases``, ``makes_room``, ``owns``, ``lasting``)."""
    return frozenset(kind for kind, rule in RULES.items() if getattr(rule, flag))


def check_move(rule: Rule, event: Event, before: LayoutState, after: LayoutState) -> None:
    """The fold step's outcome is one of its rule's moves (lock state and tier):
    a step and its row that disagree are a broken invariant, not a refusal."""
    if (
        rule.still and after.writer == before.writer and after.restorer == before.restorer
        and after.readers is before.readers and after.committed == before.committed and after.tier is before.tier
    ):
        return  # nothing that makes the lock state or the tier moved: (x, x), which the rule allows where x is
    if (lock_state(before), lock_state(after)) not in rule.lock_pairs or (
        before.tier, after.tier) not in rule.tier_pairs:
        raise InvariantViolation(
            f"{event.KIND} took layout {after.name!r} from {lock_state(before).value}/{before.tier.value} to "
            f"{lock_state(after).value}/{after.tier.value}, which its rule does not list"
        )


def rule_for(event: Event) -> Rule:
    try:
        return RULES[type(event)]
    except KeyError:
        raise InvariantViolation(f"no rule for {type(event).__name__}") from None


def check(node, event: Event) -> tuple[Rule, LayoutState | None]:
    """Raise the Rejection that refuses ``event`` in ``node``; if it is legal,
    return its rule and the layout it names as ``node`` holds it (None: it
    names none), so the fold need not look either up again.

    Every event of the log passes here, so the common case asks as little as
    it can: a role by one comparison, the lock state only where the rule
    does not allow them all; ``require`` says why only when one fails."""
    rule = RULES.get(type(event)) or rule_for(event)
    name = event.layout
    if name:
        layout = node.layouts.get(name) or LayoutState(name)  # a vacant one: see NodeState.layout
        if rule.lock_known:  # the writer's events, most of the log: asked inline
            if layout.writer != event.conn:
                require(layout, event.conn, rule.who, rule.action or event.KIND, node)
            if layout.tier not in rule.tiers:
                raise rule.refusal(
                    f"{rule.action or event.KIND} cannot happen on layout {layout.name!r} while it is "
                    f"{layout.lock_state.value} and {_WHERE[layout.tier]}"
                )
        else:
            plays = rule.plays
            if plays is not None and not plays(node, layout, event.conn):
                require(layout, event.conn, rule.who, rule.action or event.KIND, node)
            if not rule.anywhere and (lock_state(layout) not in rule.locks or layout.tier not in rule.tiers):
                raise rule.refusal(
                    f"{rule.action or event.KIND} cannot happen on layout {layout.name!r} while it is "
                    f"{layout.lock_state.value} and {_WHERE[layout.tier]}"
                )
    elif rule.needs_layout:
        raise InvariantViolation(f"{event.KIND} names no layout")
    else:
        layout = None
    for step in rule.checks:
        step(node, layout, event)
    return rule, layout


def fold_layout(state: LayoutState, event: Event) -> LayoutState:
    """Apply a layout event the rules have accepted: its row's step."""
    step = rule_for(event).step
    if step is None:
        raise InvariantViolation(f"{type(event).__name__} changes the node, not a layout")
    return step(state, event)


def lock_event_allowed(layout: LayoutState, event_type: type[Event]) -> bool:
    """Whether the layout's lock state and tier allow ``event_type`` (who asks aside)."""
    rule = RULES[event_type]
    return layout.lock_state in rule.locks and layout.tier in rule.tiers
