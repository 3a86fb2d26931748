"""Host copies: made for a writer publishing with residency ``system``, exported to
it and to the restorer of an evicted layout.

Pinning host memory takes about a quarter of a second per GiB on CUDA, so it
runs on the host tier's lane while the loop serves others; the copies are
decided (checked against the rules, the host budget included) before they are
made, and recorded after, when the fold checks them again on the state as it
is then: two writers racing for the last of the host budget cannot both win.
"""

from __future__ import annotations

from ...cuda import OutOfMemory, align_up
from ...fsm import (
    HostBudgetExceeded,
    LimitExceeded,
    decide_host_copy,
    queries,
)
from ...fsm.rules import allocation_of, require_host_tier
from ...fsm.state import Allocation
from ...wire import messages as m
from ...wire.messages import MAX_FDS_PER_MESSAGE
from ..edge.reply import Reply, allocation_info
from ..tiers.host_memory import HostMemory
from .ledger import Ledger

MAX_CHUNK_ROWS = 1 << 20  # allocations x chunks listed per request, before paging


class HostTier:
    def __init__(self, ledger: Ledger, host: HostMemory | None) -> None:
        self.ledger = ledger
        self.host = host

    def _size(self, allocation: Allocation) -> int:
        return align_up(allocation.aligned_size, self.host.granularity)

    async def export_copies(self, conn: int, allocation_ids: list[str]) -> Reply:
        """The writer: make the missing copies, then export them all.  The restorer:
        export the copies the layout has."""
        require_host_tier(self.ledger.state)  # (its budget is 0 exactly where self.host is None)
        layout = queries.layout_of(self.ledger.state, conn)
        if not queries.host_copies_to_export(layout, conn, allocation_ids):  # the writer: made if missing
            await self._make(conn, list(dict.fromkeys(allocation_ids)))
        layout = queries.layout_of(self.ledger.state, conn)
        found = [allocation_of(layout, i) for i in allocation_ids]
        fds = self.host.export_many(allocation_ids)
        rows = [allocation_info(a, aligned=self._size(a)) for a in found]
        return Reply(m.ExportHostCopiesResponse(rows), fds=tuple(fds))

    def export_chunks(self, conn: int, allocation_ids: list[str], start: int) -> Reply:
        """The restorer: the chunks of the host copies, in order, 253 fds at most an
        answer (a host copy the copier filled is several chunks of pool memory)."""
        require_host_tier(self.ledger.state)  # (its budget is 0 exactly where self.host is None)
        queries.host_chunks_to_export(queries.layout_of(self.ledger.state, conn), conn, allocation_ids)
        rows: list[tuple[str, int, str, int]] = []
        for allocation_id in allocation_ids:
            offset = 0
            for chunk, size in self.host.chunks_of(allocation_id):
                rows.append((allocation_id, offset, chunk, size))
                offset += size
            if len(rows) > MAX_CHUNK_ROWS:
                raise LimitExceeded(f"more than {MAX_CHUNK_ROWS} chunks in one request")
        page = rows[start : start + MAX_FDS_PER_MESSAGE]
        end = start + len(page)
        fds = self.host.export_chunks([chunk for _, _, chunk, _ in page])
        response = m.ExportHostChunksResponse(
            [a for a, _, _, _ in page], [o for _, o, _, _ in page], [s for _, _, _, s in page],
            end if end < len(rows) else 0,
        )
        return Reply(response, fds=tuple(fds))

    async def _make(self, conn: int, allocation_ids: list[str]) -> None:
        def decide():
            layout = queries.layout_of(self.ledger.state, conn)
            return [e for i in allocation_ids for e in decide_host_copy(layout, conn, i)]

        events = decide()
        if not events:
            return
        layout = queries.layout_of(self.ledger.state, conn)
        self.host.spill_for(sum(layout.allocations[e.allocation_id].aligned_size for e in events))
        items = [(e.allocation_id, self._size(layout.allocations[e.allocation_id])) for e in events]

        async def make() -> None:
            try:
                await self.host.create(items)
            except OutOfMemory as exc:
                raise HostBudgetExceeded(f"host memory exhausted: {exc}") from None

        await self.ledger.make_then_record(
            decide, make, lambda _: self.host.release([allocation_id for allocation_id, _ in items]),
            changed="the layout's host copies changed while these were made",
        )
