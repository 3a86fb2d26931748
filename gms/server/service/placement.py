"""Where GPU memory comes from: room under the budget, creation on the lane, waiting.

An allocation (or a restore) is decided before its memory exists and
recorded after, and between the two the server awaits the lane that makes
the memory: a point where the world may have changed.  So every step is
decided again after the await, on the state as it is then: a writer revoked
meanwhile gets its refusal (the memory goes back), and room another request
took meanwhile sends this one back to make room or wait.  The fold holds the
budget for every event, so no interleaving can break it.

Short of budget, the least recently used idle layouts are evicted; short of
device memory (other processes hold it), the least recently used idle layout
is evicted and creation tried again; neither: :class:`OutOfMemory`, which
:meth:`Placement.with_memory` waits out (backpressure) until memory is
released, a retry timer fires, the client hangs up or the retry timeout ends.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Awaitable, Callable
from typing import ContextManager, TypeVar

import trio

from ...cuda import OutOfMemory, align_up
from ...fsm import (
    Rejection,
    admit_allocation,
    admit_restore,
    decide_allocate,
    decide_evict,
    eviction_candidates,
    gpu_shortfall,
    plan_evictions,
)
from ...fsm.events import AllocationOomGaveUp, AllocationOomWait, Event, RestoreLoading
from ...fsm.queries import layout_of
from ...store import Folded
from ...wire import messages as m
from ..edge.netio import PeerGone, wait_or_hangup
from ..tiers.memory import Memory
from ..tiers.memory_signal import MemorySignal
from .ledger import Ledger

T = TypeVar("T")
_FIRST_RETRY_S = 0.001  # out of memory: retry soon, then back off to the configured interval


class OutOfMemoryTimeout(Rejection):
    code = "OUT_OF_MEMORY"


class Placement:
    def __init__(
        self,
        ledger: Ledger,
        gpu: Memory,
        signal: MemorySignal,
        *,
        retry_interval: float,
        retry_timeout: float | None,
    ) -> None:
        self.ledger = ledger
        self.log = ledger.log  # the state, read (the ledger alone writes)
        self.gpu = gpu
        self.signal = signal
        self.retry_interval = retry_interval
        self.retry_timeout = retry_timeout

    async def allocate(self, conn: int, size: int, tag: str) -> m.AllocateResponse:
        """One attempt; raises a Rejection, or OutOfMemory to wait out."""
        allocation_id = os.urandom(16).hex()  # uuid4's randomness, without its object
        aligned = align_up(size, self.gpu.granularity) if size > 0 else size  # <= 0: refused

        def propose() -> Event:
            (event,) = decide_allocate(layout_of(self.log.state, conn), conn, allocation_id, size, aligned, tag)
            return event

        event = await self._create(propose, admit_allocation, [(allocation_id, aligned)], aligned)
        return m.AllocateResponse(allocation_id, size, aligned, event.layout_slot)

    async def restore(self, conn: int, *, evict: bool = True) -> None:
        """GPU memory again for the evicted layout ``conn`` restores; OutOfMemory to wait out
        (``evict``: False, at once where the device is full, rather than evict another layout)."""
        layout = layout_of(self.log.state, conn)
        items = [(a.allocation_id, a.aligned_size) for a in layout.allocations.values()]

        def propose() -> Event:
            return RestoreLoading(conn, layout=layout.name)

        await self._create(propose, admit_restore, items, layout.held_bytes, evict)

    async def _create(
        self, propose: Callable[[], Event], admit, items: list[tuple[str, int]], more: int, evict: bool = True
    ) -> Event:
        """Memory for ``items`` (``more`` bytes in all) and the event ``propose()``
        makes for it, recorded; raises a Rejection, or OutOfMemory to wait out."""
        while True:
            folded, checked = self._fold(propose, admit, more, len(items))  # refusals cost nothing yet
            try:
                await self.gpu.create(items, fds_checked=checked)
            except OutOfMemory:
                if not self.gpu.drop_stock() and not (evict and self._evict_one()):
                    raise
                continue
            # The world may have changed during the await: the fold is stored
            # as it is if nothing was recorded meanwhile (the state is
            # immutable: the same object is the same world), else the event is
            # decided and folded again on the state as it is now.
            try:
                if self.log.state is not folded.base:
                    if gpu_shortfall(self.log.state, more):
                        self.gpu.release([allocation_id for allocation_id, _ in items])
                        continue  # room taken meanwhile: make room again, or wait
                    folded = self.ledger.fold([propose()])
                self.ledger.record(folded)
            except BaseException:
                self.gpu.release([allocation_id for allocation_id, _ in items])
                raise
            return folded.events[0]

    def _fold(self, propose: Callable[[], Event], admit, more: int, count: int) -> tuple[Folded, bool]:
        """The event folded on the state as it is, after making room for it if the
        budget is short, and whether the fd budget was asked.  Where it fits, the
        fold alone judges it (the rules, the budget); where it does not, ``admit``
        and the fd budget refuse it first, so that nothing is evicted for a
        request the rules refuse anyway, or for memory whose fds the server could
        not hold (evicting only gives fds back: the memory need not ask again)."""
        state = self.log.state
        checked = False
        if state.budget_bytes is not None and gpu_shortfall(state, more):
            event = propose()
            needed = admit(self.log.state, event)
            if self.gpu.fds is not None:
                self.gpu.fds.check_memory(count)
                checked = True
            self._make_room(needed)
        return self.ledger.fold([propose()]), checked

    def _make_room(self, needed: int) -> None:
        """Evict least-recently-used idle layouts until ``needed`` more GPU bytes fit
        the budget; OutOfMemory (the caller waits) when evicting all would not do."""
        if needed <= 0:
            return
        plan = plan_evictions(self.log.state, needed, self.ledger.queues.busy())
        if plan is None:
            raise OutOfMemory(f"the GPU budget has no room for {needed} more bytes")
        for name in plan:
            self.ledger.record(decide_evict(self.log.state, 0, name, "budget"), by_server=True)

    def _evict_one(self) -> bool:
        """The device is full (other processes hold it): evict the LRU idle layout."""
        candidates = eviction_candidates(self.log.state, self.ledger.queues.busy())
        if not candidates:
            return False
        self.ledger.record(decide_evict(self.log.state, 0, candidates[0].name, "oom"), by_server=True)
        return True

    async def with_memory(
        self,
        conn: int,
        attempt: Callable[[], Awaitable[T]],
        size: int,
        tag: str,
        until_gone: Callable[[], Awaitable[None]],
        interruptible: Callable[[], ContextManager[None]] = contextlib.nullcontext,
    ) -> T:
        """Run ``attempt`` until it finds memory.  Out-of-memory is transient:
        retry when the server releases memory, and on a timer that starts at a
        millisecond and backs off to ``--alloc-retry-interval`` (other processes
        free memory the server cannot see).  OutOfMemoryTimeout once
        ``--alloc-retry-timeout`` passes; PeerGone once ``until_gone()`` returns
        (the client hung up).  Only the wait between attempts is
        ``interruptible()`` (a take-over may stop it there: the attempt made nothing)."""
        started = None
        pause = _FIRST_RETRY_S
        while True:
            released = self.signal.next_release()
            try:
                return await attempt()
            except OutOfMemory:
                pass
            layout = self._layout_name(conn)
            now = trio.current_time()
            if started is None:
                started = now
                self.ledger.record([AllocationOomWait(conn, size, tag, layout=layout)])
            waited = now - started
            timeout = self.retry_timeout
            if timeout is not None and waited >= timeout:
                self.ledger.record([AllocationOomGaveUp(conn, size, tag, "timeout", int(waited * 1000), layout=layout)])
                raise OutOfMemoryTimeout(f"out of memory: no {size} bytes after waiting {waited:.1f} s")
            wait = pause if timeout is None else min(pause, timeout - waited)
            pause = min(pause * 2, self.retry_interval)
            with trio.move_on_after(wait), interruptible():
                if await wait_or_hangup(released.wait, until_gone):
                    waited_ms = int((trio.current_time() - started) * 1000)
                    self.ledger.record([AllocationOomGaveUp(conn, size, tag, "disconnect", waited_ms, layout=layout)])
                    raise PeerGone("hung up while waiting for memory")

    def _layout_name(self, conn: int) -> str:
        session = self.log.state.sessions.get(conn)
        return session.layout if session is not None else ""
