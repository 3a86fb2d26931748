"""Every message of the wire protocol, and the one registry of their names.

A message travels as a msgpack map whose ``"type"`` key holds the class name
and whose other keys are the fields below.  docs/protocol.md is the contract.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs

# -- connection ---------------------------------------------------------------


@attrs.frozen
class HandshakeRequest:
    lock_type: str
    timeout_ms: int | None = None


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
    pass


@attrs.frozen
class CommitResponse:
    success: bool
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
class GetRuntimeStateResponse:
    state: str
    has_rw_session: bool
    ro_session_count: int
    waiting_writers: int
    committed: bool
    allocation_count: int
    total_bytes: int
    memory_layout_hash: str
    backend: str
    device: int
    # Extensions.
    tag: str = ""
    waiting_readers: int = 0
    allocations_cleared: int = 0
    device_name: str = ""
    device_uuid: str = ""
    device_total_bytes: int | None = None
    device_free_bytes: int | None = None
    server_handle_count: int = 0
    server_handle_bytes: int = 0
    last_event_seq: int = 0
    uptime_s: float = 0.0
    pid: int = 0


@attrs.frozen
class GetEventHistoryRequest:
    since_seq: int | None = None
    limit: int | None = None


@attrs.frozen
class GetEventHistoryResponse:
    """``events`` are maps with ``seq``, ``kind``, ``time`` (unix seconds),
    ``mono_ns``, ``conn`` and the event's own fields."""

    events: list[dict]
    first_seq: int = 1
    last_seq: int = 0


@attrs.frozen
class ErrorResponse:
    error: str
    code: str


REQUESTS: tuple[type, ...] = (
    HandshakeRequest,
    AllocateRequest,
    ExportAllocationRequest,
    ExportAllocationsRequest,
    GetAllocationRequest,
    ListAllocationsRequest,
    FreeAllocationRequest,
    CommitRequest,
    MetadataPutRequest,
    MetadataPutManyRequest,
    MetadataGetRequest,
    MetadataDeleteRequest,
    MetadataListRequest,
    MetadataScanRequest,
    GetStateHashRequest,
    GetRuntimeStateRequest,
    GetEventHistoryRequest,
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
    MetadataPutResponse,
    MetadataPutManyResponse,
    MetadataGetResponse,
    MetadataDeleteResponse,
    MetadataListResponse,
    MetadataScanResponse,
    GetStateHashResponse,
    GetRuntimeStateResponse,
    GetEventHistoryResponse,
    ErrorResponse,
)
REGISTRY: dict[str, type] = {cls.__name__: cls for cls in REQUESTS + RESPONSES}
PROBES: tuple[type, ...] = (GetRuntimeStateRequest, GetEventHistoryRequest)
MAX_FDS_PER_MESSAGE = 253  # the kernel's SCM_MAX_FD
