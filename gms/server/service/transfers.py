"""Host-tier transfers through the copier: a publish's host copies and a restore's GPU copy.

With a copier (``gms.server.tiers.copier_link``) the server moves the bytes itself,
and the clients just wait:

* **publish**: ``CommitRequest{residency: system}`` with host copies missing.
  The copier copies the writer's device allocations (exported to it) into
  chunks taken from the pool (made ahead of need, mapped in the copier
  already); what the pool lacks is made on the host lane meanwhile and
  copied as it comes.  Then the host copies and the commit are recorded
  together, all or nothing.  The copy happens *before* the commit returns,
  while the writer still holds the lock: a layout is never committed
  ``system`` before its host copy is whole, so a writer that crashes right
  after its commit leaves nothing half done, and no eviction can race the
  copy (eviction needs a committed layout).  The writer finished writing
  before it asked (its client synchronizes the device first).
* **restore**: the reader granted the restore of an evicted layout waits in
  its handshake while the server makes the GPU memory (as ever) and the
  copier fills it from the host copies; then ``RESTORE_FINISHED`` and a plain
  ``RO`` grant.  The reader is still the restorer in the log (the same
  events, the same rules): if it hangs up meanwhile, ``RESTORE_ABORTED``
  releases the half-filled memory, as when a client restored itself.

Each transfer awaits the copier, so each decides again after: a writer
revoked meanwhile loses its chunks, and the rules refuse whatever is no
longer legal.  Without a copier (none configured, or it died: ``CopierGone``)
both fall back to the client: the commit is refused ``HOST_COPY_MISSING``
(the client library then fills the host copies itself and commits again),
the reader is told ``restore: true`` and copies itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import trio

from ...cuda import OutOfMemory, align_up
from ...fsm import (
    HostBudgetExceeded,
    HostCopyMissing,
    Rejection,
    decide_commit,
    decide_host_copy,
    decide_restore_finished,
    may_commit,
)
from ...fsm.queries import layout_of
from ...fsm.state import Allocation
from ...wire import messages as m
from ..edge.netio import PeerGone, wait_or_hangup
from ..edge.reply import Reply
from ..tiers.copier_link import CopierGone, CopierLink, Move
from ..tiers.host_memory import HostMemory
from ..tiers.memory import Memory
from .ledger import Ledger
from .requests import Requests

log = logging.getLogger("gms.server.service.transfers")
MAX_ALLOCATIONS = 253  # device fds per copy (the kernel's SCM_MAX_FD)
MAX_MOVES = 2048


def _by_slot(allocations) -> list[Allocation]:
    return sorted(allocations, key=lambda a: a.layout_slot)


class Transfers:
    def __init__(self, ledger: Ledger, gpu: Memory, host: HostMemory, link: CopierLink, requests: Requests) -> None:
        self.ledger = ledger
        self.gpu = gpu
        self.host = host
        self.link = link
        self.requests = requests

    # -- publish ----------------------------------------------------------------------

    async def commit(self, conn: int, request: m.CommitRequest) -> Reply:
        layout = layout_of(self.ledger.state, conn)
        if request.residency != "system":
            return self.requests.commit(conn, request)
        persist = self.requests.persist(conn, request)
        may_commit(layout, conn, request.residency)  # refused before the copier works; decided once, after it
        missing = self._missing(conn)
        if not missing:
            return self.requests.commit(conn, request)
        self.host.spill_for(sum(a.aligned_size for a in missing))

        def decide():
            (commit,) = decide_commit(layout_of(self.ledger.state, conn), conn, request.residency, persist)
            return [*self._host_copy_events(conn, self._missing(conn)), commit]

        timed: list[float] = []
        counts: list[int] = []  # chunks from the pool, chunks in all
        adopted: list[str] = []

        async def fill() -> dict[str, list[str]]:
            if not await self.link.usable():
                raise HostCopyMissing(
                    f"residency system needs a host copy of every allocation and this server's copier is "
                    f"{self.link.state}: make them from the client (the client library does) and commit again"
                )
            timed.append(time.perf_counter())
            chunks, pooled = await self._fill(missing)  # allocation id -> its chunks, filled
            timed.append(time.perf_counter())
            counts.extend((pooled, sum(map(len, chunks.values()))))
            return chunks

        def adopt(chunks: dict[str, list[str]]) -> None:
            for allocation in missing:
                self.host.keep_copy(allocation.allocation_id, chunks.pop(allocation.allocation_id))
                adopted.append(allocation.allocation_id)

        def undo(chunks: dict[str, list[str]]) -> None:
            self.host.release(adopted)
            self.host.discard(c for ids in chunks.values() for c in ids)

        # The host budget is checked before the copier is asked; all or nothing after.
        *_, commit = await self.ledger.make_then_record(
            decide, fill, undo, keep=adopt, changed="the layout's host copies changed while the copier filled them")
        started, filled = timed
        log.info(
            "publish of %r with host copies: %d allocations, %.1f MiB copied in %.1f ms (%d of %d chunks "
            "pinned ahead by the pool), recorded in %.1f ms",
            layout.name, len(missing), sum(a.aligned_size for a in missing) / 2**20, (filled - started) * 1e3,
            *counts, (time.perf_counter() - filled) * 1e3,
        )
        return Reply(m.CommitResponse(True, commit.layout_hash), close_after=True)

    def _missing(self, conn: int) -> list[Allocation]:
        layout = layout_of(self.ledger.state, conn)
        return [a for a in _by_slot(layout.allocations.values()) if a.allocation_id not in layout.host_copies]

    def _host_copy_events(self, conn: int, missing: list[Allocation]):
        layout = layout_of(self.ledger.state, conn)
        return [e for a in missing for e in decide_host_copy(layout, conn, a.allocation_id)]

    async def _fill(self, missing: list[Allocation]) -> tuple[dict[str, list[str]], int]:
        """Chunks for every missing host copy, filled by the copier from the device,
        and how many came from the pool.  Pool chunks are copied into at once; the
        rest is made on the lane meanwhile and copied as it comes.  Raises
        HostCopyMissing if the copier could not."""
        with self.host.pool.paused():  # the pool neither pins nor gives back while a publish takes from it
            return await self._fill_chunks(missing)

    async def _fill_chunks(self, missing: list[Allocation]) -> tuple[dict[str, list[str]], int]:
        C = self.host.chunk_bytes
        # Each copy: whole chunks of C first, then one exact chunk for the rest.
        parts: list[tuple[int, int, int]] = []  # (allocation index, offset, size)
        for index, allocation in enumerate(missing):
            total = align_up(allocation.aligned_size, self.host.granularity)
            parts += [(index, offset, C) for offset in range(0, total - total % C, C)]
            if total % C:
                parts.append((index, total - total % C, total % C))
        pooled = self.host.pool.take(sum(1 for _, _, size in parts if size == C))
        chunk_of: dict[int, str] = {}
        owned: list[str] = list(pooled)
        now = [k for k, (_, _, size) in enumerate(parts) if size == C][: len(pooled)]
        chunk_of.update(zip(now, pooled))
        later = [k for k in range(len(parts)) if k not in chunk_of]
        gone: list[CopierGone] = []

        async def copy(ks: list[int]) -> None:
            try:
                await self._copy(True, missing, [(parts[k][0], parts[k][1], chunk_of[k], parts[k][2]) for k in ks])
            except CopierGone as exc:
                gone.append(exc)

        refused: list[Exception] = []
        try:
            async with trio.open_nursery() as nursery:
                if now:
                    nursery.start_soon(copy, now)
                if later:
                    try:
                        made = await self.host.make(
                            [(self.host.chunk_id(missing[parts[k][0]].allocation_id), parts[k][2]) for k in later]
                        )
                    except OutOfMemory as exc:
                        refused.append(HostBudgetExceeded(f"host memory exhausted: {exc}"))
                    except Rejection as exc:  # the host budget: raised below, not as a group
                        refused.append(exc)
                    else:
                        owned += made
                        chunk_of.update(zip(later, made))
                        nursery.start_soon(copy, later)
            if refused:
                raise refused[0]
            if gone:
                log.warning("publish through the copier failed (%s): the client copies itself", gone[0])
                raise HostCopyMissing(
                    f"the copier could not fill the host copies ({gone[0]}): make them from the client "
                    "(the client library does) and commit again"
                )
        except BaseException:
            self.host.discard(owned)
            raise
        filled: dict[str, list[str]] = {a.allocation_id: [] for a in missing}
        for k, (index, _, _) in enumerate(parts):
            filled[missing[index].allocation_id].append(chunk_of[k])
        return filled, len(pooled)

    # -- restore ------------------------------------------------------------------------

    async def restore(self, conn: int, until_gone: Callable[[], Awaitable[None]]) -> bool:
        """Fill the layout ``conn`` restores (its GPU memory made: ``RESTORING``) from
        its host copies; True once ``RESTORE_FINISHED`` is recorded.  False: no
        copier did it (the reader restores itself).  PeerGone if the reader left."""
        if not await self.link.usable():
            return False
        layout = layout_of(self.ledger.state, conn)
        allocations = _by_slot(layout.allocations.values())
        moves = []
        for index, allocation in enumerate(allocations):
            offset = 0
            for chunk, size in self.host.chunks_of(allocation.allocation_id):
                moves.append((index, offset, chunk, size))
                offset += size
        gone: list[CopierGone] = []

        async def copy() -> None:
            try:
                await self._copy(False, allocations, moves)
            except CopierGone as exc:
                gone.append(exc)

        if await wait_or_hangup(copy, until_gone):
            raise PeerGone("hung up while its layout was restored")
        if gone:
            log.warning("restore of %r through the copier failed (%s): the reader copies itself", layout.name, gone[0])
            return False
        # Decided again after the await: the rules refuse it if the restore is no longer this reader's.
        self.ledger.record(decide_restore_finished(self.ledger.state, conn, layout.name))
        return True

    # -- both ------------------------------------------------------------------------------

    async def _copy(self, to_host: bool, allocations: list[Allocation], moves: list[tuple[int, int, str, int]]) -> None:
        """``moves`` (allocation index, offset, chunk, size) in as few copies as the link
        allows (253 allocations, MAX_MOVES moves each), one after another."""
        with self.host.pool.paused():
            await self._copy_all(to_host, allocations, moves)

    async def _copy_all(self, to_host: bool, allocations: list[Allocation], moves) -> None:
        batch: list[tuple[int, int, str, int]] = []
        for move in moves:
            used = {index for index, _, _, _ in batch}
            if batch and (len(batch) >= MAX_MOVES or (move[0] not in used and len(used) >= MAX_ALLOCATIONS)):
                await self._copy_batch(to_host, allocations, batch)
                batch = []
            batch.append(move)
        if batch:
            await self._copy_batch(to_host, allocations, batch)

    async def _copy_batch(self, to_host: bool, allocations: list[Allocation], batch) -> None:
        indexes = list(dict.fromkeys(index for index, _, _, _ in batch))
        local = {index: n for n, index in enumerate(indexes)}
        ids = [allocations[index].allocation_id for index in indexes]
        fds = self.gpu.export_many(ids)  # lent from the fd budget (gms.server.edge.admission) ...
        sizes = [allocations[index].aligned_size for index in indexes]
        try:
            await self.link.copy(
                to_host, fds, sizes, [Move(local[i], off, chunk, size) for i, off, chunk, size in batch]
            )
        finally:  # ... until the link has sent and closed them (or closed them unsent): given back
            if self.gpu.fds is not None:
                self.gpu.fds.returned(len(fds))
