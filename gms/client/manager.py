"""``GMSClientMemoryManager``: the client API of the seed, Tier 1 and Tier 2.

One manager talks to one layout of one server (one device) and keeps a table of
*mappings*: an address range it reserved, and the allocation (id, size, tag,
layout slot) mapped there.  Reservations outlive mappings: ``unmap_all_vas``
drops the memory and keeps the addresses, ``remap_all_vas`` puts memory of
the same layout back at the same addresses, so pointers into it (tensors)
stay valid.  Mapping goes through the adapter of whatever backend the server
runs (``gms.cuda``), which the handshake names: user code is the same on a
laptop and on a GPU host.

Every reply has a deadline (``call_timeout_s``; memory waits and untimed lock
waits excepted, see the constructor).  A connection that ends without the
manager's doing is remembered with the reason: a reader whose server went
away (EOF, reset: no ``SessionEnded`` notice) rides through, taking its lock
back from whatever server answers on the socket within
``reconnect_timeout_s``, on the very layout it mapped (``expect_hash``);
its mappings stay mapped all the while.  A writer's build is gone with its
server (BuildLostError); a revoked session stays ended (LockRevokedError).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Sequence

from ..cuda import Mapper, preload_mapper
from ..errors import (
    GMSError,
    GMSServerError,
    GMSUsageError,
    StaleMemoryLayoutError,
)
from ..fsm import GrantedLockType, RequestedLockType
from ..system.fds import reserve_fd_slots
from ..wire import messages as m
from ..wire.messages import MAX_FDS_PER_MESSAGE
from . import tiering
from .link import ServerLink
from .metadata import MetadataCalls
from .resources import HandleInfo, Mapping, Resources, handle_info
from .transport import _close_all

log = logging.getLogger("gms.client")

DEFAULT_CALL_TIMEOUT_S = 60.0
DEFAULT_RECONNECT_TIMEOUT_S = 30.0
__all__ = ["GMSClientMemoryManager", "HandleInfo", "Mapping"]


def _on_link(name: str, doc: str) -> property:
    """An attribute of the manager kept by its connection (``gms.client.link``)."""
    return property(lambda self: getattr(self._link, name), lambda self, value: setattr(self._link, name, value),
                    doc=doc)


class GMSClientMemoryManager(MetadataCalls):
    """Client of one GMS server.

    Thread-safe: every public method holds one lock for its whole run, so a
    request/response pair and the mapping table change together.
    """

    def __init__(
        self,
        socket_path: str,
        *,
        device: int = 0,
        layout: str = "weights",
        call_timeout_s: float | None = DEFAULT_CALL_TIMEOUT_S,
        memory_timeout_s: float | None = None,
        reconnect_timeout_s: float = DEFAULT_RECONNECT_TIMEOUT_S,
    ) -> None:
        """``call_timeout_s``: the deadline of every reply (None: none), except an
        allocation's or a host copy's, which may wait for memory as long as the
        server keeps trying (``memory_timeout_s``, default None), and a lock
        wait (``connect``).  ``reconnect_timeout_s``: how long a reader whose
        server went away keeps trying to take its lock back (0: never)."""
        self._lock = threading.RLock()
        self._res = Resources()
        self._link = ServerLink(self._res, socket_path, device=device, layout=layout, call_timeout_s=call_timeout_s,
                                memory_timeout_s=memory_timeout_s, reconnect_timeout_s=reconnect_timeout_s)
        self._layout_hash: str | None = None  # of the layout the mappings came from
        self._unmapped = False
        self._finalizer = weakref.finalize(self, Resources.release, self._res)
        # A batch of exports arrives as up to 253 fds at once: make room for them
        # now, not in the middle of an import (see gms/system/fds.py).
        reserve_fd_slots(MAX_FDS_PER_MESSAGE)
        # Loading the CUDA bindings costs 15-23 ms once per process: pay it here,
        # at start-up, not inside the first connect() a user times.
        preload_mapper()

    # -- properties -------------------------------------------------------------

    socket_path = _on_link("socket_path", "The server's socket.")
    device = _on_link("device", "This process's device the server's is checked against.")
    layout = _on_link("layout", "The layout this manager locks and maps.")
    call_timeout_s = _on_link("call_timeout_s", "The deadline of every reply (None: none).")
    memory_timeout_s = _on_link("memory_timeout_s", "The deadline of a reply that may wait for memory.")
    reconnect_timeout_s = _on_link("reconnect_timeout_s", "How long a reader rides through (0: never).")
    reconnects = _on_link("reconnects", "Rides through a server restart so far.")

    @property
    def granted_lock_type(self) -> GrantedLockType | None:
        return self._link.granted if self.is_connected else None

    @property
    def is_connected(self) -> bool:
        """True while the connection is up; the kernel is asked, so a server that
        died (or revoked the lock) while the manager was idle shows at once."""
        return self._link.connected

    @property
    def is_unmapped(self) -> bool:
        """True between ``unmap_all_vas()`` and the next ``remap_all_vas()``."""
        return self._unmapped

    @property
    def total_bytes(self) -> int:
        """Bytes of every mapping this manager keeps, mapped or (while asleep) not."""
        return sum(mapping.size for mapping in self._res.mappings.values())

    @property
    def backend(self) -> str | None:
        return self._link.backend

    @property
    def mappings(self) -> list[Mapping]:
        return sorted(self._res.mappings.values(), key=lambda mapping: mapping.va)

    @property
    def _mapper(self) -> Mapper:
        return self._res.need_mapper()

    # -- Tier 1: connection -----------------------------------------------------------

    def connect(
        self,
        lock_type: RequestedLockType | str,
        timeout_ms: int | None = None,
        *,
        layout: str | None = None,
        limit_bytes: int | None = None,
    ) -> None:
        """Handshake for a lock on ``layout`` (default: the manager's).

        ``limit_bytes`` narrows this session's byte limit below its tenant's
        quota (allocating past it raises QuotaExceededError).  On timeout
        raises LockTimeoutError and stays reusable (SnapshotNotServedError, one
        of them, at once: a reader of a layout whose last snapshot was not
        served, which no writer builds); the answer itself must
        come within ``timeout_ms`` plus ``call_timeout_s``, and without
        ``timeout_ms`` the server must say at least every ``call_timeout_s``
        that the lock is still waited for (else ResponseTimeoutError: a
        server that accepted and hangs).  A reader waking (``unmap_all_vas``,
        ``abort``, ``connect(RO)``, ``remap_all_vas``, the seed's flow) is
        granted whatever is committed then, as any reader is, waiting for a
        writer still building; ``remap_all_vas`` raises StaleMemoryLayoutError
        if it is not the layout it mapped.  A layout evicted to the host tier
        is restored here first, if this reader is the one asked to.
        """
        with self._lock:
            self._link.settle()
            if self._res.transport is not None:
                raise GMSUsageError("already connected; abort() or close() first")
            if layout is not None and layout != self.layout:
                if self._res.mappings:
                    raise GMSUsageError(
                        f"this manager maps layout {self.layout!r}; use another manager for {layout!r}"
                    )
                self.layout = layout
            self._link.connect(RequestedLockType(lock_type), timeout_ms, limit_bytes)

    def abort(self, discard: bool = False) -> None:
        """Close the connection (releasing the lock); mappings are kept.  Idempotent.

        A writer's layout is dropped; if it was rebuilding a layout saved to the
        disk tier, that snapshot brings the last version back (as after the
        writer's death).  ``discard=True`` (a writer only) drops that snapshot
        too: the last version goes for good."""
        with self._lock:
            if discard:
                self._link.require(GrantedLockType.RW, "abort(discard=True)")
                self._link.call(m.AbortRequest(discard=True), m.AbortResponse)
            self._link.drop()
            self._link.lost = None

    def ensure_connected(self, timeout_s: float | None = None) -> bool:
        """Make sure the lock this manager held is held now: nothing to do while
        connected (False); a reader whose server went away rides through now,
        within ``timeout_s`` (default ``reconnect_timeout_s``) (True).  Raises
        what a call would: StaleMemoryLayoutError, ServerGoneError,
        LockRevokedError, BuildLostError, or GMSUsageError if the manager was
        never connected or disconnected itself (commit, abort)."""
        with self._lock:
            self._link.settle()
            if self._res.transport is not None:
                return False
            self._link.resume("ensure_connected", timeout_s)
            return True

    # -- Tier 1: handles (server side) -----------------------------------------------------

    def allocate_handle(self, size: int, tag: str = "default") -> tuple[str, int]:
        """Create memory on the server (RW); returns (allocation_id, layout_slot)."""
        with self._lock:
            self._link.require(GrantedLockType.RW, "allocate_handle")
            response, _ = self._link.call(m.AllocateRequest(size, tag), m.AllocateResponse)
            return response.allocation_id, response.layout_slot

    def export_handle(self, allocation_id: str) -> int:
        """A new fd for the allocation; the caller owns (and closes) it."""
        with self._lock:
            response, fds = self._link.call(m.ExportAllocationRequest(allocation_id), m.ExportAllocationResponse)
            return self._single_fd(fds)

    @staticmethod
    def _single_fd(fds: list[int]) -> int:
        if len(fds) != 1:
            _close_all(fds)
            raise GMSError(f"expected one file descriptor, got {len(fds)}")
        return fds[0]

    def export_handles(self, allocation_ids: Sequence[str]) -> list[tuple[HandleInfo, int]]:
        """Many exports in few round trips (at most 253 fds each); caller closes the fds."""
        with self._lock:
            return self._link.export_many(allocation_ids)

    def get_handle_info(self, allocation_id: str) -> HandleInfo:
        with self._lock:
            return self._link.call(m.GetAllocationRequest(allocation_id), m.GetAllocationResponse)[0]

    def free_handle(self, allocation_id: str) -> bool:
        with self._lock:
            self._link.require(GrantedLockType.RW, "free_handle")
            return self._link.call(m.FreeAllocationRequest(allocation_id), m.FreeAllocationResponse)[0].success

    def list_handles(self, tag: str | None = None) -> list[HandleInfo]:
        with self._lock:
            response, _ = self._link.call(m.ListAllocationsRequest(tag), m.ListAllocationsResponse)
            return [handle_info(a) for a in response.allocations]

    def get_memory_layout_hash(self) -> str:
        """Connected: the server's committed hash of this layout ("" while a writer
        builds).  Disconnected: the hash of the committed layout this manager's
        mappings belong to (after ``commit()``, the one it published), "" when
        none; no round trip."""
        with self._lock:
            if self._res.transport is None and self._link.lost is None:
                return self._layout_hash or ""
            return self._link.call(m.GetStateHashRequest(), m.GetStateHashResponse)[0].memory_layout_hash

    def commit(self, residency: str | None = None, persist: bool | None = None) -> bool:
        """Publish: synchronize, unmap every local mapping, then commit.

        ``residency``: ``device`` (default: stays on the GPU), ``system`` (the
        server keeps a host copy, filled before the commit returns, and may
        evict the GPU copy while nobody reads it) or ``unpinned`` (evictable,
        no host copy: its next user reloads it).  A server with a copier
        fills the host copy itself; from a server without one
        (``HOST_COPY_MISSING``) this process fills it, then commits again.
        ``persist``: the server saves a snapshot to its disk tier after the
        commit, so the layout outlives a reboot (None: the tenant's policy says).

        The mappings and their addresses are kept; after commit the manager is
        disconnected and remembers the committed hash, so ``connect(RO)`` and
        ``remap_all_vas()`` bring the writer back on its own addresses.  Past
        the local unmap there is no in-process recovery: a failure raises.
        """
        with self._lock:
            self._link.require(GrantedLockType.RW, "commit")
            self._unmap_all()  # synchronizes first: the server's copier reads what was written
            if residency == "system":
                response = self._commit_system(persist)
            else:
                response, _ = self._link.call(m.CommitRequest(residency, persist), m.CommitResponse)
            self._layout_hash = response.memory_layout_hash
            self.abort()  # the server closes a committed writer's connection
            return response.success

    def _commit_system(self, persist: bool | None) -> m.CommitResponse:
        # The server's copier fills the host copies (its pool may be short: pinning
        # then takes time, so memory_timeout_s bounds the answer, as for allocations).
        request = m.CommitRequest("system", persist)
        try:
            return self._link.call(request, m.CommitResponse, timeout=self.memory_timeout_s)[0]
        except GMSServerError as exc:
            if exc.code != "HOST_COPY_MISSING":
                raise
        tiering.fill_host_copies(self._link.call, self._mapper, {})  # no copier: copy from here
        return self._link.call(request, m.CommitResponse, timeout=self.memory_timeout_s)[0]

    # -- Tier 1: address space (local) ----------------------------------------------------

    def reserve_va(self, size: int) -> int:
        with self._lock:
            return self._res.reserve(size)

    def map_va(self, fd: int, va: int, size: int, allocation_id: str, tag: str) -> object:
        """Map ``fd`` (consumed) at a reserved ``va``; returns the mapper's handle."""
        with self._lock:
            info = self.get_handle_info(allocation_id)
            writable = self._link.granted is GrantedLockType.RW
            handle = self._res.map_at(fd, va, size, info, tag, writable)
            self._note_layout(writable)
            return handle

    def unmap_va(self, va: int) -> None:
        """Unmap and release the memory at ``va``; the reservation stays."""
        with self._lock:
            self._res.unmap_at(va)

    def free_va(self, va: int) -> None:
        """Forget the mapping at ``va`` (unmapping it) and give its reservation back
        once nothing else lies in it; or free an unused reservation."""
        with self._lock:
            self._res.free_at(va)

    # -- Tier 2 -------------------------------------------------------------------------

    def create_mapping(self, allocation_id: str | None = None, size: int = 0, tag: str = "default") -> int:
        """Allocate (RW, no id) or import (an id) one allocation and map it; returns its VA."""
        with self._lock:
            if allocation_id is None:
                if size <= 0:
                    raise GMSUsageError("create_mapping needs an allocation_id or a size > 0")
                allocation_id, _ = self.allocate_handle(size, tag)
            return self.create_mappings([allocation_id])[0]

    def create_mappings(self, allocation_ids: Sequence[str]) -> list[int]:
        """Import and map many allocations in few round trips; returns their VAs in order.

        They share one reservation, back to back, so the driver grants access
        once for all of them.
        """
        with self._lock:
            writable = self._link.granted is GrantedLockType.RW
            exported = self.export_handles(allocation_ids)
            if not exported:
                return []
            vas = self._res.map_together(exported, writable)
            self._note_layout(writable)
            return vas

    def _note_layout(self, writable: bool) -> None:
        # A reader's mappings belong to the committed layout the server has now;
        # a writer's belong to a layout with no hash until it commits.
        self._layout_hash = None if writable else self._link.server_hash
        self._unmapped = False

    def destroy_mapping(self, va: int) -> None:
        with self._lock:
            self.free_va(va)

    def unmap_all_vas(self) -> None:
        """Synchronize, unmap and release every mapping; keep every reservation."""
        with self._lock:
            self._unmap_all()

    def _unmap_all(self) -> None:
        if self._res.mapper is not None:
            self._res.mapper.synchronize()
            self._res.unmap(self._res.mappings.values())
            self._unmapped = True

    def remap_all_vas(self) -> None:
        """Map the current layout back at the preserved addresses.

        A reader checks the layout hash saved when it mapped against the
        server's (mismatch: StaleMemoryLayoutError) and matches allocations by
        layout slot, size and tag, not by id.  A writer remaps the allocations
        ``reallocate_all_handles`` gave its mappings.
        """
        with self._lock:
            pending = [mp for mp in self._res.mappings.values() if not mp.mapped]
            if not pending:
                self._unmapped = False
                return
            self._link.transport("remap_all_vas")  # a reader whose server went away rides through here
            writable = self._link.granted is GrantedLockType.RW
            if not writable:
                # What the handshake saw is current: nothing commits while we hold RO.
                current = self._link.server_hash
                if not current or current != self._layout_hash:
                    raise StaleMemoryLayoutError(
                        f"layout changed since mapping (saved {self._layout_hash or 'none'}, "
                        f"server {current or 'none'}): re-import"
                    )
                self._link.match_by_shape(pending, self.list_handles())
            self._res.map_again(pending, self.export_handles([mp.allocation_id for mp in pending]), writable)
            self._unmapped = False

    def reallocate_all_handles(self, tag: str = "default") -> None:
        """Fresh server allocations (RW) for the preserved mappings of ``tag``.

        The KV-cache wake path: after ``connect(RW)`` the old layout is gone;
        this creates same-sized allocations, in the old slot order, and binds
        them to the old addresses for ``remap_all_vas`` to map.
        """
        with self._lock:
            self._link.require(GrantedLockType.RW, "reallocate_all_handles")
            chosen = sorted(
                (mp for mp in self._res.mappings.values() if mp.tag == tag),
                key=lambda mp: mp.layout_slot,
            )
            if any(mp.mapped for mp in chosen):
                raise GMSUsageError("unmap_all_vas() before reallocating: mappings are live")
            for mapping in chosen:
                response, _ = self._link.call(m.AllocateRequest(mapping.alloc_size, tag), m.AllocateResponse)
                if response.aligned_size != mapping.size:
                    raise GMSError(
                        f"server aligned {mapping.alloc_size} bytes to {response.aligned_size}, "
                        f"the reservation holds {mapping.size}"
                    )
                mapping.allocation_id = response.allocation_id
                mapping.layout_slot = response.layout_slot
            self._layout_hash = None

    # -- bytes (backend-neutral copies, for loaders and checks) ---------------------------

    def write(self, va: int, data: bytes) -> None:
        """Copy ``data`` from host memory to mapped memory at ``va``."""
        with self._lock:
            self._mapper.write(va, data)

    def read(self, va: int, size: int) -> bytes:
        """Copy ``size`` bytes at ``va`` (mapped memory) to the host."""
        with self._lock:
            return self._mapper.read(va, size)

    def close(self) -> None:
        """Unmap everything, give every reservation back, disconnect.  Idempotent."""
        with self._lock:
            if self._res.mapper is not None and self._res.mappings:
                self._res.mapper.synchronize()
            self._res.release()
            self._link.granted = None
            self._link.lost = None
            self._unmapped = False

    def __enter__(self) -> GMSClientMemoryManager:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        lock = self._link.granted.value if self._link.granted else "disconnected"
        return (
            f"<GMSClientMemoryManager {self.socket_path} layout {self.layout!r} {lock}, "
            f"{len(self._res.mappings)} mappings>"
        )
