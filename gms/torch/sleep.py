"""The shadow-engine pattern: release GPU memory, keep every pointer valid.

Tensors (and CUDA graphs captured over them) keep their addresses across a
sleep: the reservations stay, only the memory goes.
"""

from __future__ import annotations

from ..client.manager import GMSClientMemoryManager
from ..fsm import RequestedLockType


def sleep(mgr: GMSClientMemoryManager) -> None:
    """Unmap everything and drop the lock; the addresses stay reserved."""
    mgr.unmap_all_vas()
    mgr.abort()


def wake_weights(mgr: GMSClientMemoryManager, timeout_ms: int | None = None) -> None:
    """Read-only weights: the same committed layout comes back at the same addresses
    (StaleMemoryLayoutError if another layout was published meanwhile)."""
    mgr.connect(RequestedLockType.RO, timeout_ms)
    mgr.remap_all_vas()


def wake_kv_cache(mgr: GMSClientMemoryManager, tag: str = "kv_cache", timeout_ms: int | None = None) -> None:
    """Mutable KV cache: fresh memory (contents are not kept) at the same addresses."""
    mgr.connect(RequestedLockType.RW, timeout_ms)
    mgr.reallocate_all_handles(tag)
    mgr.remap_all_vas()
