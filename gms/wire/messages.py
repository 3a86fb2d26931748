"""Every message of the wire protocol, and the one registry of their names.

A message travels as a msgpack map whose ``"type"`` key holds the class name
and whose other keys are the fields below.  docs/protocol.md is the contract.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import attrs

# -- connection ---------------------------------------------------------------


@attrs.frozen
class HandshakeRequest:
    """``layout`` names the layout to lock; ``limit_bytes`` narrows this session's
    own byte limit below its tenant's quota (a scheduler's grant, say).
    ``expect_hash`` (readers): grant only the committed layout of exactly this
    hash; otherwise the answer is ``STALE_LAYOUT`` at once, never a wait."""

    lock_type: str
    timeout_ms: int | None = None
    layout: str = "weights"
    limit_bytes: int | None = None
    expect_hash: str = ""
    # Extension: while the handshake waits for its lock, send ``LockWaiting``
    # at least this often, so the client tells a wait from a server that
    # accepted and never answers (an older server ignores it and sends none).
    heartbeat_ms: int | None = None


@attrs.frozen
class HandshakeResponse:
    """``success`` is false only when the lock wait timed out (then the server closes)."""

    success: bool
    committed: bool
    granted_lock_type: str | None
    # Extensions: what the client needs to map without being told by its user.
    backend: str = ""
    device: int = 0
    device_uuid: str = ""
    memory_layout_hash: str = ""
    layout: str = ""
    tenant: str = ""
    # The layout was evicted and this reader restores it: copy every allocation's
    # host copy into its GPU memory, then send RestoreDoneRequest.
    restore: bool = False
    # The largest frame body this server reads (0: unknown, assume 16 MiB): the
    # client refuses a bigger request before sending it.
    max_frame_bytes: int = 0
    # A wait that timed out on an empty layout whose last snapshot was not served
    # (set aside, or refused): why, so the reader knows nothing will come from disk.
    unserved: str = ""


# -- allocations --------------------------------------------------------------


@attrs.frozen
class AllocationInfo:
    allocation_id: str
    size: int
    aligned_size: int
    tag: str
    layout_slot: int


@attrs.frozen
class AllocateRequest:
    size: int
    tag: str = "default"


@attrs.frozen
class AllocateResponse:
    allocation_id: str
    size: int
    aligned_size: int
    layout_slot: int


@attrs.frozen
class ExportAllocationRequest:
    allocation_id: str


@attrs.frozen
class ExportAllocationResponse(AllocationInfo):
    """One fd rides with the first byte of this frame (SCM_RIGHTS)."""


@attrs.frozen
class ExportAllocationsRequest:
    """Extension: export many allocations in one round trip (at most 253)."""

    allocation_ids: list[str]


@attrs.frozen
class ExportAllocationsResponse:
    """``len(allocations)`` fds ride with the first byte, in the same order."""

    allocations: list[AllocationInfo]


@attrs.frozen
class GetAllocationRequest:
    allocation_id: str


@attrs.frozen
class GetAllocationResponse(AllocationInfo):
    pass


@attrs.frozen
class ListAllocationsRequest:
    tag: str | None = None


@attrs.frozen
class ListAllocationsResponse:
    allocations: list[AllocationInfo]


@attrs.frozen
class FreeAllocationRequest:
    allocation_id: str


@attrs.frozen
class FreeAllocationResponse:
    success: bool


@attrs.frozen
class CommitRequest:
    """``residency``: device (default), system (needs a host copy of every
    allocation) or unpinned.  ``persist``: save a snapshot to the server's disk
    tier after the commit, so the layout outlives the node (None: the tenant's
    policy says; a server without a disk tier refuses true)."""

    residency: str | None = None
    persist: bool | None = None


@attrs.frozen
class CommitResponse:
    success: bool
    memory_layout_hash: str


@attrs.frozen
class AbortRequest:
    """The writer gives up its rebuild without committing; the server answers, then
    closes the connection.  ``discard``: the snapshot kept through the rebuild goes
    too (a plain close, or a writer's death, brings it back: docs/protocol.md)."""

    discard: bool = False


@attrs.frozen
class AbortResponse:
    success: bool


@attrs.frozen
class ExportHostCopiesRequest:
    """The host-tier copies of allocations (fds, like exports).  For the writer
    the server creates missing ones; a restorer gets the existing ones."""

    allocation_ids: list[str]


@attrs.frozen
class ExportHostCopiesResponse:
    """``len(allocations)`` fds ride with the first byte, in the same order."""

    allocations: list[AllocationInfo]


@attrs.frozen
class ExportHostChunksRequest:
    """Extension, for the restorer: the pieces of host copies.  A host copy the
    server filled through its copier may be held in several chunks (pinned
    host memory made ahead of need); ``start`` skips that many chunks of the
    allocations' chunks listed in order (paging: at most 253 fds an answer)."""

    allocation_ids: list[str]
    start: int = 0


@attrs.frozen
class ExportHostChunksResponse:
    """Columns, one row per chunk, in order: the allocation it holds bytes of, where
    in the allocation they start, how many; one fd per row.  ``next_start``:
    ask again from there (0: every chunk was sent)."""

    allocation_ids: list[str]
    offsets: list[int]
    sizes: list[int]
    next_start: int = 0

    def rows(self) -> Iterator[tuple[str, int, int]]:
        """(allocation_id, offset, size) per chunk; the columns must agree."""
        if not len(self.allocation_ids) == len(self.offsets) == len(self.sizes):
            raise ValueError("host chunk columns differ in length")
        return zip(self.allocation_ids, self.offsets, self.sizes)


@attrs.frozen
class RestoreDoneRequest:
    """The restorer copied every host copy into the GPU memory: serve it."""


@attrs.frozen
class RestoreDoneResponse:
    memory_layout_hash: str


# -- metadata -----------------------------------------------------------------


@attrs.frozen
class MetadataPutRequest:
    key: str
    allocation_id: str
    offset_bytes: int
    value: bytes


@attrs.frozen
class MetadataPutResponse:
    success: bool


@attrs.frozen
class MetadataGetRequest:
    key: str


@attrs.frozen
class MetadataGetResponse:
    found: bool
    allocation_id: str = ""
    offset_bytes: int = 0
    value: bytes = b""


@attrs.frozen
class MetadataDeleteRequest:
    key: str


@attrs.frozen
class MetadataDeleteResponse:
    deleted: bool


@attrs.frozen
class MetadataListRequest:
    prefix: str = ""


@attrs.frozen
class MetadataListResponse:
    keys: list[str]


@attrs.frozen
class MetadataEntryInfo:
    key: str
    allocation_id: str
    offset_bytes: int
    value: bytes


@attrs.frozen
class MetadataScanRequest:
    """Extension: every entry under ``prefix`` in one round trip, sorted by key."""

    prefix: str = ""


@attrs.frozen
class MetadataScanResponse:
    """Columns, one row per entry: a model's thousand entries decode as four
    lists (a fifth of the time of a thousand maps)."""

    keys: list[str]
    allocation_ids: list[str]
    offsets_bytes: list[int]
    values: list[bytes]

    def rows(self) -> Iterator[tuple[str, str, int, bytes]]:
        """(key, allocation_id, offset_bytes, value) per entry; the columns must agree."""
        n = len(self.keys)
        if not len(self.allocation_ids) == len(self.offsets_bytes) == len(self.values) == n:
            raise ValueError("metadata scan columns differ in length")
        return zip(self.keys, self.allocation_ids, self.offsets_bytes, self.values)


@attrs.frozen
class MetadataPutManyRequest:
    """Extension: put many entries at once; all are applied or none is."""

    entries: list[MetadataEntryInfo]


@attrs.frozen
class MetadataPutManyResponse:
    success: bool
    count: int


# -- state and probes ---------------------------------------------------------


@attrs.frozen
class GetStateHashRequest:
    pass


@attrs.frozen
class GetStateHashResponse:
    memory_layout_hash: str


@attrs.frozen
class GetRuntimeStateRequest:
    pass


@attrs.frozen
class LayoutStatus:
    """One layout as the runtime-state probe shows it."""

    name: str
    state: str
    committed: bool
    residency: str
    tier: str
    bytes: int
    gpu_bytes: int
    host_bytes: int
    allocation_count: int
    metadata_count: int
    writer: bool
    readers: int
    restoring: bool
    waiting_writers: int
    waiting_readers: int
    memory_layout_hash: str
    owner: str
    last_use_s: float | None  # seconds since a lock on it was last taken or released
    loads: int
    restores: int
    evictions: int
    disk_bytes: int = 0  # its snapshot on the disk tier (0: none)
    persist: bool = False  # committed to persist: a snapshot is saved (or is being)
    kept_bytes: int = 0  # an earlier commit's snapshot, kept until this commit's is whole (issue 60)
    save_error: str = ""  # why this commit's snapshot is not saved yet ("": saved, saving, or none asked)
    unserved: str = ""  # why its last snapshot was not served (set aside, or refused): its readers wait for a writer

    @classmethod
    def empty(cls, name: str) -> LayoutStatus:
        """The row of a layout the server holds none of."""
        return cls(name, "EMPTY", False, "device", "device", 0, 0, 0, 0, 0, False, 0, False, 0, 0, "", "", None, 0, 0, 0)


@attrs.frozen
class TenantStatus:
    name: str
    used_bytes: int
    quota_bytes: int | None
    sessions: int
    metadata_bytes: int = 0  # keys and values of the layouts it owns (the server's RAM)
    metadata_quota: int | None = None
    layouts: int = 0  # layouts it owns or holds a session that may write
    max_layouts: int | None = None
    disk_bytes: int = 0  # snapshots of the layouts it owns
    disk_quota: int | None = None


@attrs.frozen
class GetRuntimeStateResponse:
    backend: str
    device: int
    device_name: str = ""
    device_uuid: str = ""
    capacity_bytes: int | None = None  # the device's memory
    budget_bytes: int | None = None  # what gms may hold on it (None: the capacity)
    used_bytes: int = 0  # layout bytes on the GPU now
    host_budget_bytes: int | None = None
    host_used_bytes: int = 0
    device_free_bytes: int | None = None
    server_handle_count: int = 0
    server_handle_bytes: int = 0
    host_handle_count: int = 0
    host_handle_bytes: int = 0
    allocations_cleared: int = 0
    sessions: int = 0
    waiting: int = 0
    first_event_seq: int = 1
    last_event_seq: int = 0
    event_log_bytes: int = 0  # what the kept events and the snapshot hold, as --event-log-bytes counts it
    uptime_s: float = 0.0
    pid: int = 0
    metadata_bytes: int = 0  # keys and values of every layout (the server's RAM)
    max_metadata_bytes: int | None = None
    layouts: list[LayoutStatus] = attrs.Factory(list)
    tenants: list[TenantStatus] = attrs.Factory(list)
    # The seed's single-layout fields, describing the layout "weights", so a
    # seed-era client or probe reads this response unchanged.
    state: str = "EMPTY"
    has_rw_session: bool = False
    ro_session_count: int = 0
    waiting_writers: int = 0
    waiting_readers: int = 0
    committed: bool = False
    allocation_count: int = 0
    total_bytes: int = 0
    memory_layout_hash: str = ""
    # The copier (extensions): "running", "starting", "down" (client-side
    # copies until it is back) or "off"; its pid; pinned host memory made
    # ahead of need (counted against host_budget_bytes, not in host_used_bytes).
    copier: str = "off"
    copier_pid: int = 0
    host_pool_bytes: int = 0
    # The keeper (extensions): "attached", "behind" (frames wait for it to read:
    # answers to lasting changes wait too), "gone" (a crash now loses the node,
    # until there is another), "starting", or "none" (--no-keeper); bytes not
    # yet taken and for how long; keepers lost since the server started.
    keeper: str = "none"
    keeper_backlog_bytes: int = 0
    keeper_behind_s: float = 0.0
    keepers_lost: int = 0
    # Who to signal (extensions): the keeper's pid (0: none, or one that did not
    # say), and the process whose SIGTERM stops the service cleanly (`gms stop`):
    # the keeper, the `gms serve --devices` supervisor above it, or a server
    # without a keeper itself (0: not known, a keeper in another container).
    keeper_pid: int = 0
    service_pid: int = 0
    # Where the service's Python runs from (``sys.prefix``: a virtual environment's
    # folder): `gms stop` from another installation asks for an explicit --socket.
    python_prefix: str = ""
    # The disk tier (extensions): its budget (0: no disk tier, None: what the disk
    # holds), the snapshots it keeps, its folder and what that disk has free.
    disk_budget_bytes: int | None = 0
    disk_used_bytes: int = 0
    disk_loose_bytes: int = 0  # files in its folder no layout holds (set aside, left on disk): in the budget too
    disk_dir: str = ""
    disk_free_bytes: int | None = None

    def layout(self, name: str) -> LayoutStatus:
        """The named layout's row; an empty one where the server holds none of that name."""
        for row in self.layouts:
            if row.name == name:
                return row
        return LayoutStatus.empty(name)

    def tenant(self, name: str) -> TenantStatus | None:
        return next((row for row in self.tenants if row.name == name), None)


@attrs.frozen
class GetEventHistoryRequest:
    since_seq: int | None = None
    limit: int | None = None
    layout: str | None = None  # only this layout's events


@attrs.frozen
class GetEventHistoryResponse:
    """``events`` are maps with ``seq``, ``kind``, ``time`` (unix seconds),
    ``mono_ns``, ``conn`` and the event's own fields."""

    events: list[dict]
    first_seq: int = 1
    last_seq: int = 0
    scanned_seq: int = 0  # the last sequence number this page looked at: the next page's since


# -- admin (server's uid, root, or a policy admin; one request, then close) -----------


@attrs.frozen
class RevokeRequest:
    """Take every lock on the layout away: writers abort, readers are dropped."""

    layout: str


@attrs.frozen
class RevokeResponse:
    sessions: int


@attrs.frozen
class EvictRequest:
    layout: str


@attrs.frozen
class EvictResponse:
    tier: str  # host (a copy is kept) or none (unpinned: the layout is dropped)
    freed_bytes: int


@attrs.frozen
class DeleteRequest:
    layout: str


@attrs.frozen
class DeleteResponse:
    """What went with the layout: bytes of device memory, of host copies, of its snapshot."""

    device_bytes: int
    host_bytes: int
    disk_bytes: int


@attrs.frozen
class PinRequest:
    layout: str
    residency: str = "device"


@attrs.frozen
class PinResponse:
    residency: str


# -- take-over (a new server replacing this one; the server's uid or root only) -------


@attrs.frozen
class TakeOverRequest:
    """A new server asks to take this one's place.  ``readable_versions``: the
    state hand-over formats it reads; ``pid``: who asks (for the logs).  The
    answer is a ``TakeOverResponse`` and the hand-over frames on this
    connection (docs/protocol.md, "Take-over"), or an ``ErrorResponse``: refused,
    and this server serves on."""

    readable_versions: list[int]
    pid: int = 0
    precopy: bool = False  # it reads a base before the pause, then only what changed (frames base, tail)


@attrs.frozen
class TakeOverResponse:
    """Accepted: the server is quiet and writes its state in ``state_version``;
    ``fds``: how many fds the hand-over carries (0: a server too old to say).
    ``precopy``: the server serves on and sends a base first (the new server
    asked for it, and this one knows it); it pauses once the new one read it."""

    state_version: int
    pid: int
    fds: int = 0
    precopy: bool = False


@attrs.frozen
class ErrorResponse:
    error: str
    code: str
    # QUOTA_EXCEEDED: which byte quota (scope tenant or session), and its bytes.
    # LIMIT_EXCEEDED and RESOURCE_EXHAUSTED, where ``limit`` names the bound
    # (metadata_quota, max_layouts, max_connections_per_uid, fds, ...): whose
    # it is (scope tenant, node or uid), its figures, and the bound in ``quota``.
    scope: str = ""
    used: int | None = None
    asked: int | None = None
    quota: int | None = None
    limit: str = ""


# -- notices (server to client, unsolicited) ----------------------------------


@attrs.frozen
class SessionEnded:
    """The server is ending this connection on purpose (best effort, sent just
    before it closes): ``reason`` is ``revoked`` for an admin's revoke.  A
    connection that ends without one ended because the server went away."""

    reason: str


REQUESTS: tuple[type, ...] = (
    HandshakeRequest,
    AllocateRequest,
    ExportAllocationRequest,
    ExportAllocationsRequest,
    GetAllocationRequest,
    ListAllocationsRequest,
    FreeAllocationRequest,
    CommitRequest,
    AbortRequest,
    ExportHostCopiesRequest,
    ExportHostChunksRequest,
    RestoreDoneRequest,
    MetadataPutRequest,
    MetadataPutManyRequest,
    MetadataGetRequest,
    MetadataDeleteRequest,
    MetadataListRequest,
    MetadataScanRequest,
    GetStateHashRequest,
    GetRuntimeStateRequest,
    GetEventHistoryRequest,
    RevokeRequest,
    EvictRequest,
    DeleteRequest,
    PinRequest,
    TakeOverRequest,
)
RESPONSES: tuple[type, ...] = (
    HandshakeResponse,
    AllocateResponse,
    ExportAllocationResponse,
    ExportAllocationsResponse,
    GetAllocationResponse,
    ListAllocationsResponse,
    FreeAllocationResponse,
    CommitResponse,
    AbortResponse,
    ExportHostCopiesResponse,
    ExportHostChunksResponse,
    RestoreDoneResponse,
    MetadataPutResponse,
    MetadataPutManyResponse,
    MetadataGetResponse,
    MetadataDeleteResponse,
    MetadataListResponse,
    MetadataScanResponse,
    GetStateHashResponse,
    GetRuntimeStateResponse,
    GetEventHistoryResponse,
    RevokeResponse,
    EvictResponse,
    DeleteResponse,
    PinResponse,
    TakeOverResponse,
    ErrorResponse,
)
@attrs.frozen
class LockWaiting:
    """The handshake still waits for its lock, ``waited_ms`` so far (sent only to
    a client that asked, ``HandshakeRequest.heartbeat_ms``)."""

    waited_ms: int


NOTICES: tuple[type, ...] = (SessionEnded, LockWaiting)
REGISTRY: dict[str, type] = {cls.__name__: cls for cls in REQUESTS + RESPONSES + NOTICES}
PROBES: tuple[type, ...] = (GetRuntimeStateRequest, GetEventHistoryRequest)
ADMIN: tuple[type, ...] = (RevokeRequest, EvictRequest, DeleteRequest, PinRequest)
ONE_SHOT: tuple[type, ...] = PROBES + ADMIN + (TakeOverRequest,)  # answered, then the connection closes
MAX_FDS_PER_MESSAGE = 253  # the kernel's SCM_MAX_FD


def _at_most_fds(ids: list, what: str) -> tuple[str, str] | None:
    if len(ids) > MAX_FDS_PER_MESSAGE:
        return "LIMIT_EXCEEDED", f"at most {MAX_FDS_PER_MESSAGE} {what}"
    return None


# What a request's fields must be whatever the server's state (refused by the
# wire, once: gms.wire.connection): (code, message) where a shape is wrong.
SHAPES: dict[type, Callable[[object], tuple[str, str] | None]] = {
    ExportAllocationsRequest: lambda r: _at_most_fds(r.allocation_ids, "allocations per export"),
    ExportHostCopiesRequest: lambda r: _at_most_fds(r.allocation_ids, "host copies per request"),
    ExportHostChunksRequest: lambda r: ("INVALID_ARGUMENT", "start must be >= 0") if r.start < 0 else None,
    HandshakeRequest: lambda r: (
        ("INVALID_ARGUMENT", "timeout_ms must be >= 0") if r.timeout_ms is not None and r.timeout_ms < 0 else None
    ),
}
