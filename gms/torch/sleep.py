"""The shadow-engine pattern: release GPU memory, keep every pointer valid.

Tensors (and CUDA graphs captured over them) keep their addresses across a
sleep: the reservations stay, only the memory goes.  They also outlive a
restart of the gms server: imported memory lives as long as it is mapped.
A reader (the weights) rides through a restart by itself
(docs/client.md); a KV cache, never committed, is lost with its server's
session (BuildLostError) and is made again by :func:`rebuild_kv_cache`.
"""

from __future__ import annotations

from ..client.manager import GMSClientMemoryManager
from ..fsm import RequestedLockType


def sleep(mgr: GMSClientMemoryManager) -> None:
    """Unmap everything and drop the lock; the addresses stay reserved."""
    mgr.unmap_all_vas()
    mgr.abort()


def wake_weights(mgr: GMSClientMemoryManager, timeout_ms: int | None = None) -> None:
    """Read-only weights: the same committed layout comes back at the same addresses.

    StaleMemoryLayoutError from ``remap_all_vas`` if the layout committed
    when the lock is granted is not the one mapped (republished meanwhile, or
    lost with a server): then materialize again.  With none committed, the
    wake waits for one (``timeout_ms``: LockTimeoutError)."""
    mgr.connect(RequestedLockType.RO, timeout_ms)
    mgr.remap_all_vas()


def wake_kv_cache(mgr: GMSClientMemoryManager, tag: str = "kv_cache", timeout_ms: int | None = None) -> None:
    """Mutable KV cache: fresh memory (contents are not kept) at the same addresses."""
    mgr.connect(RequestedLockType.RW, timeout_ms)
    mgr.reallocate_all_handles(tag)
    mgr.remap_all_vas()


def rebuild_kv_cache(mgr: GMSClientMemoryManager, tag: str = "kv_cache", timeout_ms: int | None = None) -> None:
    """A KV cache whose server went away (BuildLostError) gets fresh memory from
    whatever server answers now, at the same addresses (contents are new).

    The lock comes first: until a server grants it (GMSConnectionError,
    LockTimeoutError), the old memory stays mapped and the tensors stay usable."""
    mgr.connect(RequestedLockType.RW, timeout_ms)
    mgr.unmap_all_vas()
    mgr.reallocate_all_handles(tag)
    mgr.remap_all_vas()
