"""The node's tiers in one table: what the write path, a restart, a take-over and
the server's edges ask of every tier alike.

A tier is where a layout's bytes can be held: the GPU's memory
(:class:`~gms.server.tiers.memory.Memory`), the host's pinned copies
(:class:`~gms.server.tiers.host_memory.HostMemory`), the disk's snapshot files
(:class:`~gms.server.tiers.disk_files.DiskFiles`).  The fsm says which tier holds
what (``gms.fsm.releases``: rows of (tier, id, size)); each tier here answers the
same five questions about it:

* ``release(ids)``: the log let these go (the ledger, after every stored batch);
* ``adopt(kept)``: another server held these, here are its fds (a restart, a
  take-over); returns (id, why) for each it could not take;
* ``mark_lost(ids)``: these did not come over (their release finds nothing);
* ``held_fds()`` / ``fd_count()``: what it holds by fd (the keeper, a take-over,
  the fd budget);
* ``watch()`` / ``stop()`` / ``close()``: its lane in the server's nursery, its
  end without releasing (another server holds it now), its end releasing.

A tier the node was not started with is :class:`Absent`, never a branch: it holds
nothing, and whatever another server hands it is lost with the reason.  Adding a
tier: docs/architecture.md, "Adding a tier".
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Protocol

import attrs

from ...fsm import MemoryTier


@attrs.frozen
class Kept:
    """One allocation another server held on a tier: its size as the log says, and
    the fds of its parts as (offset, size, fd); offset and size None for one part
    that is the whole (gms.server.tiers.chunk_book.chunk_name)."""

    allocation_id: str
    size: int
    parts: tuple[tuple[int | None, int | None, int], ...]

    def close(self) -> None:
        for _, _, fd in self.parts:
            os.close(fd)


class TierStore(Protocol):
    name: str

    def release(self, ids: Iterable[str]) -> None: ...
    async def adopt(self, kept: list[Kept]) -> list[tuple[str, str]]: ...
    def mark_lost(self, ids: Iterable[str]) -> None: ...
    def held_fds(self) -> list[tuple[str, int]]: ...
    def fd_count(self) -> int: ...
    async def watch(self) -> None: ...
    def stop(self) -> None: ...
    async def close(self) -> None: ...


class HoldsNoFds:
    """The part of a tier that holds nothing by fd (the disk's files, an absent tier):
    what another server hands it is lost for ``unadoptable`` and its fds closed."""

    unadoptable = "it holds nothing by fd"

    async def adopt(self, kept: list[Kept]) -> list[tuple[str, str]]:
        for one in kept:
            one.close()
        return [(one.allocation_id, self.unadoptable) for one in kept]

    def mark_lost(self, ids: Iterable[str]) -> None:
        """Nothing held by fd: nothing to forget."""

    def held_fds(self) -> list[tuple[str, int]]:
        return []

    def fd_count(self) -> int:
        return 0


class Absent(HoldsNoFds):
    """A tier this node has none of: nothing held, nothing released; what another
    server hands it is lost ("no host tier here") and its fds closed."""

    def __init__(self, tier: MemoryTier) -> None:
        self.name = tier.value
        self.unadoptable = f"no {self.name} tier here"

    def release(self, ids: Iterable[str]) -> None:
        """Nothing is held here (a disk tier's files stay for a server that keeps one)."""

    async def watch(self) -> None:
        """No lane: nothing can fail."""

    def stop(self) -> None:
        """No lane to stop."""

    async def close(self) -> None:
        """Nothing to release."""


def tier_table(present: Mapping[MemoryTier, TierStore]) -> dict[MemoryTier, TierStore]:
    """Every tier, in the fsm's order: those the node has, :class:`Absent` for the rest."""
    return {tier: present[tier] if tier in present else Absent(tier) for tier in MemoryTier}
