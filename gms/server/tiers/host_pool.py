"""The host tier's pool: chunks pinned ahead of need, on the lane, while nothing waits.

Pinning costs about 0.24 s per GiB on the H100 host (13 times the D2H copy
it prepares); the pool pays it while nothing waits, up to a fixed size
(``--host-pool BYTES``) or (``--host-pool auto``, the default) up to what the
builds under way may publish (``gms.server.tiers.pool_sizing``), giving back
what they no longer need.  Its bytes count against the host budget (they are
pinned memory the server holds) but are no host copy: the event log does not
know them.  It yields twice: to a request that needs room the budget lacks
(it pins nothing more, and a chunk it is pinning is given back once made),
and to a transfer through the copier (pinning beside a copy slows it, below).

Which chunk is in which phase is the book's (``chunk_book``); the chunks are
made and dropped by the host table (``host_memory``), which this serves.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from collections.abc import Iterator
from typing import Protocol

import trio

from ...cuda import OutOfMemory
from ...fsm import HostBudgetExceeded
from .chunk_book import ChunkBook, Phase
from .memory import Memory
from .pool_sizing import POLL_S, PoolSizing

log = logging.getLogger("gms.server.host")


class PoolHost(Protocol):
    """What the pool uses of the host table it serves (``host_memory.HostMemory``)."""

    book: ChunkBook
    chunks: Memory

    def fits(self, more: int) -> bool: ...

    def spill_for(self, more: int) -> bool: ...

    def drop(self, chunk_ids: list[str]) -> None: ...

    def to_copier(self, chunk_ids: list[str]) -> None: ...


class HostPool:
    def __init__(self, host: PoolHost, *, fixed_bytes: int, sizing: PoolSizing | None) -> None:
        """``fixed_bytes``: the pool's size in whole chunks (0: none); ``sizing``:
        sized by the builds under way instead."""
        self.host = host
        self.book = host.book
        self.sizing = sizing
        self.fixed = 0 if sizing is not None else fixed_bytes
        self._ids = itertools.count(1)
        self._wanted = 0  # bytes a request waits to have room for: the pool yields to it
        self._wake = trio.Event()
        self._pinned = trio.Event()  # set each time the chunk in the making is done
        self._copying = 0  # transfers under way: the pool waits for none (below)
        self._quiet = trio.Event()
        self._warned = False

    @property
    def kept(self) -> bool:
        """Whether the pool has a task at all (a size, or the builds to follow)."""
        return bool(self.fixed) or self.sizing is not None

    @property
    def bytes(self) -> int:
        return self.book.bytes_in(Phase.POOLED)

    def target(self) -> int:
        """What the pool should hold now, in whole chunks."""
        return self.fixed if self.sizing is None else self.sizing.target(self.book.chunk_bytes)

    def take(self, count: int) -> list[str]:
        """Up to ``count`` pooled chunks, reserved for the caller (no wait: made already)."""
        taken = self.book.take_pool(count)
        self._wake.set()
        return taken

    def changed(self) -> None:
        """Chunks were let go: room for the pool, maybe."""
        self._wake.set()

    async def make_room(self, more: int) -> None:
        """Give pooled chunks back until ``more`` bytes fit the host budget (a chunk
        being pinned now is waited for, then given back); else spill, else refuse."""
        host = self.host
        while True:
            while not host.fits(more) and self.book.pooled:
                host.drop([self.book.pop_pool()])
            if host.fits(more):
                return
            if host.spill_for(self.book.in_flight + more):
                continue  # host copies recorded gone: the room is the state's
            if not self.book.bytes_in(Phase.MAKING):
                raise HostBudgetExceeded(
                    f"host tier full: no room for {more} more bytes under the host budget "
                    f"({self.book.in_flight} bytes in flight beyond the host copies)"
                )
            self._wanted += more  # the pool makes no more chunks meanwhile
            try:
                await self._pinned.wait()
            finally:
                self._wanted -= more

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A transfer through the copier runs: the pool pins nothing new meanwhile.
        Pinning and the copier mapping the new chunk would run beside the copy
        (a host mapping's set-access beside a copy slows it to 0.8 of the
        floor, bench/restore_copy_probe.py); the pool refills between transfers."""
        self._copying += 1
        try:
            yield
        finally:
            self._copying -= 1
            if not self._copying:
                self._quiet.set()
                self._quiet = trio.Event()

    async def keep(self) -> None:
        """Refill whenever the pool falls short, and (sized by the builds) give back
        what it holds beyond its target (a task in the server's nursery)."""
        if not self.kept:
            return
        self._wake.set()
        while True:
            with trio.move_on_after(POLL_S if self.sizing is not None else math.inf):
                await self._wake.wait()
            self._wake = trio.Event()
            while self._copying:  # a publish may be taking chunks: decided once it is done
                await self._quiet.wait()
            await self._refill()

    async def _refill(self) -> None:
        book, host, size = self.book, self.host, self.book.chunk_bytes
        while book.pooled and self.bytes > self.target():
            host.drop([book.pop_pool()])
        while book.pooled * size + book.bytes_in(Phase.MAKING) < self.target() and host.fits(size + self._wanted):
            if self._copying:
                await self._quiet.wait()
                continue  # decided again: the world changed meanwhile
            if not await self._pin(f"pool-{next(self._ids)}", size):
                return

    async def _pin(self, chunk: str, size: int) -> bool:
        """One chunk made for the pool; False when the host has no memory to pin."""
        self.book.making(chunk)
        try:
            await self.host.chunks.create([(chunk, size)])
        except BaseException as exc:
            self.book.not_made(chunk)
            if not isinstance(exc, OutOfMemory):
                raise
            if not self._warned:
                log.warning("host pool: the host has no more memory to pin (%s); trying again later", exc)
                self._warned = True
            return False
        finally:
            self._pinned.set()
            self._pinned = trio.Event()
        self.book.pooled_in(chunk)
        self.host.to_copier([chunk])
        return True

