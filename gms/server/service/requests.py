"""The requests a session's state answers at once: reads, metadata, free, commit, exports.

The session's route table (``gms.server.service.routes``) sends each here.
Each handler turns a request into a decision (``gms.fsm``) and records what
it proposes through the ledger (the fold's rules accept or refuse it), or
reads the state; an export ``dup()``s fds from the tier's table.  None of
them waits, so they run on the event loop without a thread; what waits
(allocation, restore, host copies) lives in ``placement`` and ``host_tier``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from ...fsm import (
    LayoutState,
    decide_abort,
    decide_commit,
    decide_free,
    decide_metadata_delete,
    decide_metadata_put,
    decide_metadata_put_many,
    queries,
)
from ...wire import messages as m
from ..edge.reply import Reply, allocation_info
from ..tiers.memory import Memory
from .ledger import Ledger

DEFAULT_SCAN_CACHE_BYTES = 64 << 20
# Answers that are always the same (replies are frozen): made once.
_FREED = Reply(m.FreeAllocationResponse(True))
_PUT = Reply(m.MetadataPutResponse(True))


class ScanCache:
    """Answers to metadata scans, per (layout, prefix), while the metadata is
    unchanged: a committed layout's never changes, so every reader of a model
    shares one sort.  Bounded by the bytes of the answers it keeps (least
    recently used go first); a change makes a new metadata map, which misses."""

    def __init__(self, max_bytes: int = DEFAULT_SCAN_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[tuple[str, str], tuple[object, m.MetadataScanResponse, int]] = OrderedDict()

    def get(self, layout: LayoutState, prefix: str) -> m.MetadataScanResponse | None:
        key = (layout.name, prefix)
        found = self._entries.get(key)
        if found is None or found[0] is not layout.metadata:
            return None
        self._entries.move_to_end(key)
        return found[1]

    def put(self, layout: LayoutState, prefix: str, response: m.MetadataScanResponse) -> None:
        size = 64 * (len(response.keys) + 1) + sum(len(k) + len(v) for k, v in zip(response.keys, response.values))
        if size > self.max_bytes:
            return
        key = (layout.name, prefix)
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old[2]
        while self._entries and self.bytes + size > self.max_bytes:
            self.bytes -= self._entries.popitem(last=False)[1][2]
        self._entries[key] = (layout.metadata, response, size)
        self.bytes += size


class Requests:
    def __init__(
        self, ledger: Ledger, gpu: Memory, scan_cache_bytes: int = DEFAULT_SCAN_CACHE_BYTES,
        persists: Callable[[str], bool] = lambda tenant: False,
    ) -> None:
        """``persists(tenant)``: whether a commit that does not say saves a snapshot."""
        self.ledger = ledger
        self.log = ledger.log
        self.gpu = gpu
        self.scans = ScanCache(scan_cache_bytes)
        self.persists = persists

    def persist(self, conn: int, req: m.CommitRequest) -> bool:
        """What a commit asks of the disk tier: its own word, else its tenant's policy."""
        if req.persist is not None:
            return bool(req.persist)
        return self.persists(self.log.state.sessions[conn].tenant)

    def _layout(self, conn: int) -> LayoutState:
        return queries.layout_of(self.log.state, conn)

    def export(self, conn: int, req: m.ExportAllocationRequest) -> Reply:
        allocation = queries.export_one(self._layout(conn), conn, req.allocation_id)
        fd = self.gpu.export_lent(allocation.allocation_id)
        return Reply(allocation_info(allocation, m.ExportAllocationResponse), fds=(fd,))

    def export_many(self, conn: int, req: m.ExportAllocationsRequest) -> Reply:
        found = queries.exportable(self._layout(conn), conn, req.allocation_ids)
        fds = self.gpu.export_many(a.allocation_id for a in found)
        return Reply(m.ExportAllocationsResponse([allocation_info(a) for a in found]), fds=tuple(fds))

    def get_allocation(self, conn: int, req: m.GetAllocationRequest) -> Reply:
        allocation = queries.get_allocation(self._layout(conn), conn, req.allocation_id)
        return Reply(allocation_info(allocation, m.GetAllocationResponse))

    def list_allocations(self, conn: int, req: m.ListAllocationsRequest) -> Reply:
        found = queries.list_allocations(self._layout(conn), conn, req.tag)
        return Reply(m.ListAllocationsResponse([allocation_info(a) for a in found]))

    def free(self, conn: int, req: m.FreeAllocationRequest) -> Reply:
        self.ledger.record(decide_free(self._layout(conn), conn, req.allocation_id))
        return _FREED

    def commit(self, conn: int, req: m.CommitRequest) -> Reply:
        (commit,) = decide_commit(self._layout(conn), conn, req.residency or "device", self.persist(conn, req))
        # The lock is released (and waiters granted: a writer clears the hash
        # at once) before the response goes out, so the hash comes from the event.
        self.ledger.record([commit])
        return Reply(m.CommitResponse(True, commit.layout_hash), close_after=True)

    def abort(self, conn: int, req: m.AbortRequest) -> Reply:
        self.ledger.record(decide_abort(self._layout(conn), conn, req.discard))
        return Reply(m.AbortResponse(True), close_after=True)

    def metadata_put(self, conn: int, req: m.MetadataPutRequest) -> Reply:
        layout = self._layout(conn)
        self.ledger.record(decide_metadata_put(layout, conn, req.key, req.allocation_id, req.offset_bytes, req.value))
        return _PUT

    def metadata_put_many(self, conn: int, req: m.MetadataPutManyRequest) -> Reply:
        entries = [(e.key, e.allocation_id, e.offset_bytes, e.value) for e in req.entries]
        events = decide_metadata_put_many(self._layout(conn), conn, entries)
        self.ledger.record(events)  # all or nothing
        return Reply(m.MetadataPutManyResponse(True, len(events)))

    def metadata_get(self, conn: int, req: m.MetadataGetRequest) -> Reply:
        entry = queries.get_metadata(self._layout(conn), conn, req.key)
        if entry is None:
            return Reply(m.MetadataGetResponse(False))
        return Reply(m.MetadataGetResponse(True, entry.allocation_id, entry.offset_bytes, entry.value))

    def metadata_delete(self, conn: int, req: m.MetadataDeleteRequest) -> Reply:
        events = decide_metadata_delete(self._layout(conn), conn, req.key)
        self.ledger.record(events)
        return Reply(m.MetadataDeleteResponse(bool(events)))

    def metadata_list(self, conn: int, req: m.MetadataListRequest) -> Reply:
        return Reply(m.MetadataListResponse(queries.list_metadata(self._layout(conn), conn, req.prefix)))

    def metadata_scan(self, conn: int, req: m.MetadataScanRequest) -> Reply:
        layout = self._layout(conn)
        queries.require_view(layout, conn, "metadata_scan")
        if len(req.prefix) > self.ledger.state.limits.max_key_bytes:
            return Reply(m.MetadataScanResponse([], [], [], []))  # longer than any key: nothing
        cached = self.scans.get(layout, req.prefix)
        if cached is not None:
            return Reply(cached)
        entries = queries.scan_metadata(layout, conn, req.prefix)
        response = m.MetadataScanResponse(
            [e.key for e in entries],
            [e.allocation_id for e in entries],
            [e.offset_bytes for e in entries],
            [e.value for e in entries],
        )
        self.scans.put(layout, req.prefix, response)
        return Reply(response)

    def state_hash(self, conn: int, req: m.GetStateHashRequest) -> Reply:
        return Reply(m.GetStateHashResponse(self._layout(conn).layout_hash or ""))
