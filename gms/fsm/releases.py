"""What an event releases of the memory the server owns, read from the layout before it.

One function per kind of release; each rule in ``gms.fsm.rules`` names the one
its event uses (its ``releases`` column), or None.  Pure: a layout and an
event in, (tier, allocation id, aligned size) rows out.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from .events import AllocationFreed, Event, RwAbort, RwCommit
from .folding import restore_source
from .state import LayoutState, Residency, Tier


class MemoryTier(str, enum.Enum):
    GPU = "gpu"
    HOST = "host"
    DISK = "disk"  # a snapshot file (its id: LayoutState.disk_file)


Released = list[tuple[MemoryTier, str, int]]
ReleaseFn = Callable[[LayoutState, Event], Released]


def _all(layout: LayoutState, *, gpu: bool, host: bool, disk: bool = False) -> Released:
    out = []
    if gpu:
        out += [(MemoryTier.GPU, a.allocation_id, a.aligned_size) for a in layout.allocations.values()]
    if host:
        out += [(MemoryTier.HOST, i, size) for i, size in layout.host_copies.items()]
    if disk and layout.saved:
        out.append((MemoryTier.DISK, layout.disk_file, layout.disk_bytes))
    return out


def everything(layout: LayoutState, event: Event) -> Released:
    """The layout's memory on every tier, its snapshots too (an admin's delete)."""
    return _all(layout, gpu=layout.gpu_bytes > 0, host=True, disk=True) + kept_snapshot(layout, event)


def dropped(layout: LayoutState, event: Event) -> Released:
    """The layout's memory on every tier and its own snapshot (a loss); a snapshot
    kept through its rebuild stays, to be brought back (gms.fsm.folding.layout_lost)."""
    return _all(layout, gpu=layout.gpu_bytes > 0, host=True, disk=True)


def aborted(layout: LayoutState, event: RwAbort) -> Released:
    """The writer's layout; the snapshot kept through its rebuild only if it discards it."""
    return dropped(layout, event) + (kept_snapshot(layout, event) if event.discard else [])


def cleared(layout: LayoutState, event: Event) -> Released:
    """A writer's grant: the committed layout's memory; its snapshot is kept
    until a newer one is whole (LayoutState.kept_file)."""
    return _all(layout, gpu=layout.gpu_bytes > 0, host=True)


def kept_snapshot(layout: LayoutState, event: Event | None) -> Released:
    """The snapshot kept through a rebuild, once a newer one is whole."""
    return [(MemoryTier.DISK, layout.kept_file, layout.kept_bytes)] if layout.kept_file else []


def kept_unasked(layout: LayoutState, event: RwCommit) -> Released:
    """A commit: the kept snapshot if it asks for none of its own."""
    return [] if event.persist else kept_snapshot(layout, event)


def one_allocation(layout: LayoutState, event: AllocationFreed) -> Released:
    """The freed allocation, and its host copy if it has one."""
    allocation = layout.allocations[event.allocation_id]
    out = [(MemoryTier.GPU, allocation.allocation_id, allocation.aligned_size)]
    if allocation.allocation_id in layout.host_copies:
        out.append((MemoryTier.HOST, allocation.allocation_id, allocation.aligned_size))
    return out


def gpu_copy(layout: LayoutState, event: Event) -> Released:
    """An eviction: the GPU's memory; the host copies too if the layout is unpinned
    (dropped, or kept in its snapshot alone); an earlier snapshot kept for it if
    it is dropped (no copy of this commit left: gms.fsm.folding.layout_evicted)."""
    dropped = not layout.saved and restore_source(layout) is not Tier.HOST
    return _all(layout, gpu=True, host=layout.residency is Residency.UNPINNED) + (
        kept_snapshot(layout, event) if dropped else []
    )


def memory_copies(layout: LayoutState, event: Event) -> Released:
    """A layout left to its snapshot: its GPU memory (if it holds any) and host copies."""
    return _all(layout, gpu=layout.gpu_bytes > 0, host=True)


def host_copies(layout: LayoutState, event: Event) -> Released:
    """A spill to disk: the host tier's copies (the snapshot holds the bytes)."""
    return _all(layout, gpu=False, host=True)


def half_restored(layout: LayoutState, event: Event) -> Released:
    """An abandoned restore: the GPU memory it had made, if any (the host copy stays)."""
    return _all(layout, gpu=layout.tier is Tier.RESTORING, host=False)
