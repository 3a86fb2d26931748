"""Events: the only inputs of the fold.

Every event names the connection it came from (``conn``, an integer the
server hands out per accepted socket; 0 is the server itself) and the layout
it concerns (``layout``; ``""`` for node-wide events).  Lock events carry the
seed's names; layout events describe one change of a layout; residency events
move a layout between the GPU, the host tier and the disk; session events say who is
connected, as which tenant; observations change nothing in the state but are
kept in the log for post-mortems.
"""

from __future__ import annotations

from typing import ClassVar

import attrs


@attrs.frozen
class Event:
    KIND: ClassVar[str] = ""
    conn: int
    layout: str = attrs.field(kw_only=True)


# -- node ---------------------------------------------------------------------


@attrs.frozen
class ServerStarted(Event):
    """The first event: what the node holds and who may use it.

    ``quotas`` maps every tenant to its byte quota (None: unlimited); the
    budgets are None when unlimited (a host budget of 0: no host tier).
    ``limits`` are the server's :class:`~gms.fsm.limits.Limits` as a dict, so
    the fold enforces exactly what the server enforced when it logged.
    ``tenant_limits`` maps a tenant to its resolved ``metadata_quota`` (bytes),
    ``max_layouts`` and ``disk_quota`` (None: unbounded); a tenant it does not
    name (a log from before these limits) is unbounded.  ``disk_budget_bytes``
    bounds the snapshots on disk (0: no disk tier, as in a log from before it).
    """

    KIND: ClassVar[str] = "SERVER_STARTED"
    capacity_bytes: int | None
    budget_bytes: int | None
    host_budget_bytes: int | None
    quotas: dict
    limits: dict = attrs.field(factory=dict)
    # For the post-mortem reader only: which server this log is from.
    backend: str = ""
    device: int = 0
    device_uuid: str = ""
    tenant_limits: dict = attrs.field(factory=dict)
    disk_budget_bytes: int | None = 0


@attrs.frozen
class ServerResumed(Event):
    """A new server took the node over with its state: from a live server
    (``mode`` ``take-over``: the sessions are handed over too and go on) or
    from the keeper after the server before it died (``restart``: the dead
    server's sessions are closed by the events that follow).  ``old_pid`` and
    ``reason`` say who it took over from and why; ``state_version`` the
    hand-over format it read.  The rest is the new server's configuration,
    which replaces the old one's (tenants the new policy no longer names keep
    their quotas: they may still own layouts); ``tenant_limits`` as in
    SERVER_STARTED.  ``follows_seq``: the number of the old server's last event
    the new one has; after a crash this event's own number is higher (the
    events between, if any, never reached the keeper: ``gms.store.log``).
    0 in a log from before it was recorded."""

    KIND: ClassVar[str] = "SERVER_RESUMED"
    mode: str
    old_pid: int
    reason: str
    state_version: int
    capacity_bytes: int | None
    budget_bytes: int | None
    host_budget_bytes: int | None
    quotas: dict
    limits: dict = attrs.field(factory=dict)
    backend: str = ""
    device: int = 0
    device_uuid: str = ""
    tenant_limits: dict = attrs.field(factory=dict)
    follows_seq: int = 0
    disk_budget_bytes: int | None = 0


RESUME_MODES = ("restart", "take-over")

# A node's configuration: what SERVER_STARTED carries.  A SERVER_RESUMED carries
# all of it again (the new server's), built by ``resumed_from``, never field by
# field: a setting added to the first event reaches every restart by itself
# (tests/test_fsm_node.py checks ServerResumed has every one of these).
NODE_CONFIG_FIELDS: tuple[str, ...] = tuple(f.name for f in attrs.fields(ServerStarted) if f.name not in ("conn", "layout"))


def resumed_from(started: ServerStarted, *, mode: str, old_pid: int, reason: str, state_version: int,
                 follows_seq: int) -> ServerResumed:
    """The SERVER_RESUMED of a server whose own configuration is ``started``."""
    return ServerResumed(0, mode, old_pid, reason, state_version, layout="", follows_seq=follows_seq,
                         **{name: getattr(started, name) for name in NODE_CONFIG_FIELDS})


@attrs.frozen
class SessionOpened(Event):
    """A handshake was accepted for ``layout``: identity from the kernel, tenant from the policy."""

    KIND: ClassVar[str] = "SESSION_OPENED"
    tenant: str
    uid: int
    gid: int
    pid: int
    lock_type: str
    limit_bytes: int | None = None
    # A reader asking for exactly this committed layout back (a wake, a client
    # riding through a server restart): anything else is refused at once.
    expect_hash: str = ""


@attrs.frozen
class SessionClosed(Event):
    KIND: ClassVar[str] = "SESSION_CLOSED"


# -- lock events --------------------------------------------------------------


@attrs.frozen
class RwConnect(Event):
    """A writer got the lock: the previous layout (committed or not) is cleared."""

    KIND: ClassVar[str] = "RW_CONNECT"


@attrs.frozen
class RwCommit(Event):
    """The writer published its layout; ``layout_hash`` is what readers will see.
    ``persist``: save a snapshot of it to disk (``SNAPSHOT_SAVED`` follows)."""

    KIND: ClassVar[str] = "RW_COMMIT"
    layout_hash: str
    residency: str = "device"
    persist: bool = False


@attrs.frozen
class RwAbort(Event):
    """The writer left without committing: its layout is dropped.  A snapshot kept
    through its rebuild comes back (the disk tier's LAYOUT_RECOVERED), unless the
    writer asked to ``discard`` it (AbortRequest): a writer's death and a plain
    close look alike, and neither may lose the last whole version."""

    KIND: ClassVar[str] = "RW_ABORT"
    discard: bool = False


@attrs.frozen
class RoConnect(Event):
    KIND: ClassVar[str] = "RO_CONNECT"


@attrs.frozen
class RoDisconnect(Event):
    KIND: ClassVar[str] = "RO_DISCONNECT"


# A reader's whole visit in two events, not four: the common handshake (a
# read lock nobody waits ahead of) opens its session and takes its lock in
# one, and a reader that leaves lets its lock go and closes its session in
# one.  Each is its two events' steps in one row of the rules; logs from
# before them (the four) read and replay as they always did.


@attrs.frozen
class ReaderJoined(SessionOpened):
    """A session opened and granted its read lock at once (SESSION_OPENED + RO_CONNECT)."""

    KIND: ClassVar[str] = "READER_JOINED"


@attrs.frozen
class ReaderLeft(SessionClosed):
    """A reader let its lock go and closed its session (RO_DISCONNECT + SESSION_CLOSED)."""

    KIND: ClassVar[str] = "READER_LEFT"


# -- layout events ------------------------------------------------------------


@attrs.frozen
class AllocationCreated(Event):
    KIND: ClassVar[str] = "ALLOCATION_CREATED"
    allocation_id: str
    size: int
    aligned_size: int
    tag: str
    layout_slot: int


@attrs.frozen
class AllocationFreed(Event):
    """Metadata pointing into the allocation is deleted by earlier events."""

    KIND: ClassVar[str] = "ALLOCATION_FREED"
    allocation_id: str


@attrs.frozen
class MetadataPut(Event):
    KIND: ClassVar[str] = "METADATA_PUT"
    key: str
    allocation_id: str
    offset_bytes: int
    value: bytes


@attrs.frozen
class MetadataDeleted(Event):
    KIND: ClassVar[str] = "METADATA_DELETED"
    key: str


@attrs.frozen
class HostCopyCreated(Event):
    """The writer was given server-owned host memory to keep a copy of an allocation in."""

    KIND: ClassVar[str] = "HOST_COPY_CREATED"
    allocation_id: str


# -- residency ------------------------------------------------------------------


@attrs.frozen
class ResidencySet(Event):
    """An admin (``gms pin``) changed a committed layout's residency."""

    KIND: ClassVar[str] = "RESIDENCY_SET"
    residency: str


@attrs.frozen
class LayoutEvicted(Event):
    """GPU memory released; metadata, hash and host copy kept (``system``), or
    the whole layout dropped (``unpinned``).  ``reason``: budget, oom or admin."""

    KIND: ClassVar[str] = "LAYOUT_EVICTED"
    reason: str


@attrs.frozen
class RestoreClaimed(Event):
    """A reader of an evicted layout will restore it; other readers wait."""

    KIND: ClassVar[str] = "RESTORE_CLAIMED"


@attrs.frozen
class RestoreLoading(Event):
    """GPU memory for every allocation exists again; the restorer fills it."""

    KIND: ClassVar[str] = "RESTORE_LOADING"


@attrs.frozen
class RestoreFinished(Event):
    """The GPU copy is whole: the layout is resident and the restorer a reader."""

    KIND: ClassVar[str] = "RESTORE_FINISHED"


@attrs.frozen
class RestoreAborted(Event):
    """The restorer left before finishing: nothing half-copied is ever served."""

    KIND: ClassVar[str] = "RESTORE_ABORTED"


@attrs.frozen
class LayoutLost(Event):
    """A restarted server found memory of this layout gone (on CUDA: the fd of
    an allocation or host copy no longer imports, as after a GPU reset): the
    whole layout is dropped, whatever its residency.  Its next user rebuilds it
    (or, a snapshot kept from before this commit, the disk tier brings that back)."""

    KIND: ClassVar[str] = "LAYOUT_LOST"
    reason: str
    allocation_id: str
    tier: str


@attrs.frozen
class LayoutDeleted(Event):
    """An admin deleted an idle committed layout (``gms delete``): its memory on
    every tier goes, its snapshot on disk too; ``uid`` is the admin's."""

    KIND: ClassVar[str] = "LAYOUT_DELETED"
    uid: int


# -- the disk tier (gms.disk) ----------------------------------------------------


@attrs.frozen
class SnapshotSaved(Event):
    """A snapshot of the committed layout of ``layout_hash`` (``file`` in the disk
    tier's folder, ``bytes`` long, checksummed per chunk) was made visible: the
    layout now outlives the node."""

    KIND: ClassVar[str] = "SNAPSHOT_SAVED"
    layout_hash: str
    bytes: int
    file: str


@attrs.frozen
class LayoutRecovered(Event):
    """A server that started with nothing found this layout's snapshot on disk:
    it is committed again, with the same hash, on the disk tier, owned by
    ``owner`` (its first reader restores it).  ``allocations`` rows are
    ``[id, size, aligned size, tag, slot]``, ``metadata`` rows
    ``[key, allocation id, offset, value]``; ``residency`` its at the save."""

    KIND: ClassVar[str] = "LAYOUT_RECOVERED"
    owner: str
    layout_hash: str
    allocations: list
    metadata: list
    bytes: int
    file: str
    residency: str = "unpinned"  # (journals from before it was kept: unpinned)


# -- observations (no state change) -------------------------------------------


@attrs.frozen
class AllocationOomWait(Event):
    """An allocation (or a restore) found no memory and is now waiting for some."""

    KIND: ClassVar[str] = "ALLOCATION_OOM_WAIT"
    size: int
    tag: str


@attrs.frozen
class AllocationOomGaveUp(Event):
    """An out-of-memory wait ended without memory: ``reason`` is timeout or disconnect."""

    KIND: ClassVar[str] = "ALLOCATION_OOM_GAVE_UP"
    size: int
    tag: str
    reason: str
    waited_ms: int


@attrs.frozen
class LockTimeout(Event):
    """A handshake waited ``timeout_ms`` for ``lock_type`` and was refused; or, with
    ``unserved``, was answered before it: a reader of a layout left empty because its
    last snapshot was not served (why), which no writer builds (``gms.fsm.turned_away``)."""

    KIND: ClassVar[str] = "LOCK_TIMEOUT"
    lock_type: str
    timeout_ms: int
    unserved: str = ""


@attrs.frozen
class SessionRefused(Event):
    """A handshake was refused before any lock: who asked, and why."""

    KIND: ClassVar[str] = "SESSION_REFUSED"
    uid: int
    gid: int
    pid: int
    reason: str


@attrs.frozen
class LayoutRevoked(Event):
    """An admin took the layout's locks away; the disconnects follow."""

    KIND: ClassVar[str] = "LAYOUT_REVOKED"
    uid: int
    sessions: int


@attrs.frozen
class ConnectionDropped(Event):
    """The server stopped trusting a connection (undecodable frame, failed send)."""

    KIND: ClassVar[str] = "CONNECTION_DROPPED"
    reason: str


@attrs.frozen
class StateDiscarded(Event):
    """A restarted server could not rebuild the state it was handed (it did not
    decode or replay, or broke an invariant): it was saved to ``saved_to`` for
    ``gms replay``, its memory released, and the server started empty."""

    KIND: ClassVar[str] = "STATE_DISCARDED"
    reason: str
    saved_to: str
    old_pid: int


@attrs.frozen
class LayoutSpilled(Event):
    """A layout on the host tier let its host copies go: its snapshot holds it
    (tier disk).  ``reason``: ``host budget`` (room for another's host copies)
    or ``admin``."""

    KIND: ClassVar[str] = "LAYOUT_SPILLED"
    reason: str


@attrs.frozen
class LayoutFellToDisk(Event):
    """A restarted server found memory of this layout gone (as ``LAYOUT_LOST``),
    but the layout's snapshot holds it: what memory is left goes, and the
    layout stays committed on the disk tier (its next reader restores it)."""

    KIND: ClassVar[str] = "LAYOUT_FELL_TO_DISK"
    reason: str
    allocation_id: str
    tier: str


@attrs.frozen
class SnapshotFailed(Event):
    """A layout's snapshot could not be saved (a full disk, the disk tier's
    budget, an I/O error, no copier) or read back (corrupt, truncated, of
    another layout): ``reason`` says which.  The commit stands; a layout whose
    snapshot does not read back is dropped (``LAYOUT_LOST``), never served."""

    KIND: ClassVar[str] = "SNAPSHOT_FAILED"
    layout_hash: str
    reason: str


@attrs.frozen
class SnapshotSetAside(Event):
    """The disk tier found a snapshot that it does not serve (at a start, or the one
    kept through a rebuild that ended with no new commit): ``file`` was renamed
    ``aside`` (it does not read: torn, truncated, not a regular file) or left as it
    is (``aside`` empty: of another format version, or its owner refused by the
    policy), ``reason`` says why.  ``layout`` names its layout where known (a torn
    one found at a start names none); a layout whose kept snapshot it is keeps it no longer."""

    KIND: ClassVar[str] = "SNAPSHOT_SET_ASIDE"
    file: str
    reason: str
    aside: str = ""


NODE_EVENTS: tuple[type[Event], ...] = (ServerStarted, ServerResumed, SessionOpened, SessionClosed)
LOCK_EVENTS: tuple[type[Event], ...] = (
    RwConnect, RwCommit, RwAbort, RoConnect, RoDisconnect, ReaderJoined, ReaderLeft,
)
LAYOUT_EVENTS: tuple[type[Event], ...] = (
    AllocationCreated,
    AllocationFreed,
    MetadataPut,
    MetadataDeleted,
    HostCopyCreated,
)
RESIDENCY_EVENTS: tuple[type[Event], ...] = (
    ResidencySet,
    LayoutEvicted,
    RestoreClaimed,
    RestoreLoading,
    RestoreFinished,
    RestoreAborted,
    LayoutLost,
    LayoutDeleted,
)
DISK_EVENTS: tuple[type[Event], ...] = (SnapshotSaved, LayoutRecovered, LayoutSpilled, LayoutFellToDisk)
OBSERVATIONS: tuple[type[Event], ...] = (
    AllocationOomWait,
    AllocationOomGaveUp,
    LockTimeout,
    SessionRefused,
    LayoutRevoked,
    ConnectionDropped,
    StateDiscarded,
    SnapshotFailed,
    SnapshotSetAside,
)
EVENT_TYPES: dict[str, type[Event]] = {
    cls.KIND: cls
    for cls in NODE_EVENTS + LOCK_EVENTS + LAYOUT_EVENTS + RESIDENCY_EVENTS + DISK_EVENTS + OBSERVATIONS
}

# The kinds a reader sees (the history probe, ``gms history``, saved logs): the
# seed's name for every lock transition, whatever the log stores.  A merged
# event shows as the seed event it holds, its other fields beside it (a
# READER_JOINED's session: tenant, uid, pid); ``logged_as`` keeps the stored
# kind, which is what replaying the row folds (docs/protocol.md).
SHOWN_AS: dict[str, str] = {ReaderJoined.KIND: RoConnect.KIND, ReaderLeft.KIND: RoDisconnect.KIND}


def shown_kind(kind: str) -> str:
    """The kind a reader of the history sees for a logged ``kind``."""
    return SHOWN_AS.get(kind, kind)


def kind_columns(kind: str) -> dict:
    """A history row's ``kind`` (and ``logged_as`` where the shown kind is another) for a logged ``kind``."""
    shown = SHOWN_AS.get(kind)
    return {"kind": kind} if shown is None else {"kind": shown, "logged_as": kind}
