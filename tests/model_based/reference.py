"""A reference model of one layout's tables, written without the fold.

Plain mutable dicts and sets, one method per request, each returning the
rejection code the seed's rules call for (or ``None``) and mutating in place.
It shares no code with ``gms.fsm`` beyond the limits it is configured with,
so agreement between the two is evidence, not tautology.  The layout hash is
restated from the protocol document's definition.  Residency (the host tier,
eviction, restores) and the disk tier (a snapshot per commit that asks, an
unpinned layout evicted to it, restores from it) are restated from docs/operations.md.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


def reference_hash(allocs: dict[str, tuple], meta: dict[str, tuple]) -> str:
    def u64(n: int) -> bytes:
        return n.to_bytes(8, "big")

    def blob(b: bytes) -> bytes:
        return u64(len(b)) + b

    order = sorted(allocs, key=lambda i: allocs[i][3])
    out = bytearray(b"gms-layout-v1\x00")
    out += u64(len(order))
    for i in order:
        size, aligned, tag, _slot = allocs[i]
        out += u64(size) + u64(aligned) + blob(tag.encode())
    out += u64(len(meta))
    for key in sorted(meta):
        alloc, offset, value = meta[key]
        out += blob(key.encode()) + u64(order.index(alloc)) + u64(offset) + blob(value)
    return hashlib.sha256(bytes(out)).hexdigest()


@dataclass
class ReferenceModel:
    max_allocations: int
    max_keys: int
    max_value: int
    max_key_bytes: int
    max_tag_bytes: int
    writer: int | None = None
    readers: set[int] = field(default_factory=set)
    committed: bool = False
    allocs: dict[str, tuple[int, int, str, int]] = field(default_factory=dict)
    meta: dict[str, tuple[str, int, bytes]] = field(default_factory=dict)
    layout_hash: str | None = None
    next_slot: int = 0
    queue: list[tuple[int, str]] = field(default_factory=list)
    owner: str | None = None
    residency: str = "device"
    tier: str = "device"
    restorer: int | None = None
    host: set[str] = field(default_factory=set)
    last_use: int = 0
    persist: bool = False
    disk: int = 0  # its snapshot's bytes (0: none)
    kept: int = 0  # an earlier commit's snapshot kept through a rebuild until the new one is saved (issue 60)
    kept_owner: str | None = None  # charged for it
    unserved: str = ""  # why its last snapshot was not served (set aside): an empty layout says so till a writer
    save_failed: bool = False  # its commit's save failed (SNAPSHOT_FAILED): an unpinned one may go unsaved

    # -- lock table -------------------------------------------------------

    def state_name(self) -> str:
        if self.writer is not None:
            return "RW"
        if self.readers or self.restorer is not None:
            return "RO"
        return "COMMITTED" if self.committed else "EMPTY"

    def bytes(self) -> int:
        return sum(a[1] for a in self.allocs.values())

    def gpu_bytes(self) -> int:
        return 0 if self.tier in ("host", "disk") else self.bytes()

    def host_bytes(self) -> int:
        return sum(self.allocs[i][1] for i in self.host)

    def vacant(self) -> bool:
        return (self.writer is None and not self.readers and self.restorer is None and not self.committed
                and not self.kept and not self.unserved)

    def _clear_layout(self) -> None:
        self.allocs.clear()
        self.meta.clear()
        self.layout_hash = None
        self.committed = False
        self.next_slot = 0
        self.owner = None
        self.residency = "device"
        self.tier = "device"
        self.host.clear()
        self.persist = False
        self.disk = 0
        self.kept, self.kept_owner = 0, None
        self.unserved = ""
        self.save_failed = False

    def _may_grant(self, position: int) -> str | None:
        conn, wanted = self.queue[position]
        writer_queued = any(w == "RW" for _, w in self.queue)
        first_writer = next((c for c, w in self.queue if w == "RW"), None)
        if self.writer is not None:
            return None
        if wanted == "RW":
            free = not self.readers and self.restorer is None
            return "RW" if free and conn == first_writer else None
        if wanted == "RW_OR_RO" and not self.committed:
            return "RW"
        if not self.committed or writer_queued or self.restorer is not None:
            return None
        return "RESTORE" if self.tier in ("host", "disk") else "RO"

    def pump(self, clock, tenant_of) -> list[tuple[int, str]]:
        """Grant waiting handshakes, first grantable first, until none is.
        ``clock()`` ticks a use; ``tenant_of(conn)`` names a writer's tenant."""
        granted = []
        while True:
            for position in range(len(self.queue)):
                lock = self._may_grant(position)
                if lock is not None:
                    conn, _ = self.queue.pop(position)
                    if lock == "RW":
                        kept = (self.disk, self.owner) if self.disk else (self.kept, self.kept_owner)
                        self._clear_layout()
                        self.kept, self.kept_owner = kept
                        self.writer = conn
                        self.owner = tenant_of(conn)
                    elif lock == "RESTORE":
                        self.restorer = conn
                    else:
                        self.readers.add(conn)
                    self.last_use = clock()
                    granted.append((conn, lock))
                    break
            else:
                return granted

    def turn_away(self) -> list[int]:
        """The waiting readers answered ungranted (docs/protocol.md, the handshake): the
        layout is empty since its last snapshot was not served, and no writer holds it
        or waits to build it.  Leaves the queue."""
        if not self.unserved or self.writer is not None or any(w != "RO" for _, w in self.queue):
            return []
        away, self.queue = [c for c, _ in self.queue], []
        return away

    def disconnect(self, conn: int, clock) -> str | None:
        """Returns the lock event the seed names for this disconnect."""
        self.queue = [(c, w) for c, w in self.queue if c != conn]
        if conn == self.writer:
            self.writer = None
            kept = (self.kept, self.kept_owner)  # (a snapshot kept through the rebuild stays, to come back)
            self._clear_layout()
            self.kept, self.kept_owner = kept
            self.last_use = clock()
            return "RW_ABORT"
        if conn in self.readers:
            self.readers.discard(conn)
            self.last_use = clock()
            return "RO_DISCONNECT"
        if conn == self.restorer:
            self.restorer = None
            self.tier = self.restore_source()  # nothing half-copied is ever served
            return "RESTORE_ABORTED"
        return None

    # -- residency ------------------------------------------------------------

    def evictable(self) -> str | None:
        if not self.committed or self.writer is not None:
            return "NOT_EVICTABLE"
        if self.residency == "device" or self.tier != "device" or self.readers or self.restorer is not None:
            return "NOT_EVICTABLE"
        if self.persist and not self.disk and not self.save_failed and self.restore_source() != "host":
            return "NOT_EVICTABLE"  # it leaves for its snapshot, once that is saved
        return None

    def evict(self) -> str | None:
        error = self.evictable()
        if error is None:
            if self.restore_source() == "host":
                self.tier = "host"
            elif self.disk:
                self.tier = "disk"  # its snapshot holds it (a system layout back from disk has no host copy)
                self.host.clear()
            else:
                self._clear_layout()
        return error

    def delete(self) -> str | None:
        """An admin's delete: an idle committed layout goes from every tier, its snapshot too."""
        if not self.committed or self.writer is not None or self.readers or self.restorer is not None:
            return "NOT_EVICTABLE"
        self._clear_layout()
        return None

    def restore_source(self) -> str:
        """The tier it is on; else its host copies (residency system, every one held,
        and some, or no snapshot), else its snapshot."""
        if self.tier in ("host", "disk"):
            return self.tier
        every = self.host == set(self.allocs)
        return "host" if self.residency == "system" and every and (self.host or not self.disk) else "disk"

    def spill(self) -> str | None:
        """A layout on the host tier lets its host copies go: its snapshot holds it."""
        if not self.committed or self.writer is not None or self.tier != "host" or self.restorer is not None:
            return "NOT_EVICTABLE"
        if not self.disk or not self.host:
            return "NOT_EVICTABLE"
        self.tier = "disk"
        self.host.clear()
        return None

    def save(self, size: int, disk_used: int, disk_budget: int | None, owner_used: int, owner_quota: int | None):
        """The shell's SNAPSHOT_SAVED of ``size`` bytes: the refusal code, or None."""
        if not self.committed or self.writer is not None or self.tier == "disk":
            return "STATE_VIOLATION"
        if not self.persist or self.disk:
            return "STATE_VIOLATION"
        # (the kept snapshot goes with this save: its bytes are room, its saver's)
        if owner_quota is not None and owner_used - (self.kept if self.kept_owner == self.owner else 0) + size > owner_quota:
            return "LIMIT_EXCEEDED"
        if disk_budget is not None and disk_used - self.kept + size > disk_budget:
            return "LIMIT_EXCEEDED"
        self.disk = size
        self.kept, self.kept_owner = 0, None
        self.save_failed = False
        return None

    def save_fails(self, layout_hash: str | None) -> None:
        """SNAPSHOT_FAILED of ``layout_hash``: only this commit's, only while it waits."""
        if self.committed and self.persist and not self.disk and layout_hash == self.layout_hash:
            self.save_failed = True

    def pin(self, residency: str) -> str | None:
        if not self.committed or self.writer is not None or self.tier != "device":
            return "STATE_VIOLATION"
        if residency == "system" and self.host != set(self.allocs):
            return "HOST_COPY_MISSING"
        self.residency = residency
        return None

    def host_copy(self, conn: int, alloc_id: str) -> str | None:
        error = self._auth(conn, True)
        if error is None and alloc_id not in self.allocs:
            error = "UNKNOWN_ALLOCATION"
        if error is None:
            self.host.add(alloc_id)
        return error

    # -- requests -----------------------------------------------------------

    def _auth(self, conn: int, write: bool) -> str | None:
        if conn == self.writer:
            return None
        if conn in self.readers or conn == self.restorer:
            return "MODE_VIOLATION" if write else None
        return "NOT_CONNECTED"

    def _text(self, text: str, limit: int) -> str | None:
        if text == "":
            return "INVALID_ARGUMENT"
        return "LIMIT_EXCEEDED" if len(text.encode()) > limit else None

    def allocate(self, conn: int, alloc_id: str, size: int, aligned: int, tag: str):
        error = self._auth(conn, True)
        if error is None and size <= 0:
            error = "INVALID_ARGUMENT"
        error = error or self._text(tag, self.max_tag_bytes)
        if error is None and len(self.allocs) >= self.max_allocations:
            error = "LIMIT_EXCEEDED"
        if error is None:
            self.allocs[alloc_id] = (size, aligned, tag, self.next_slot)
            self.next_slot += 1
        return error

    def free(self, conn: int, alloc_id: str):
        error = self._auth(conn, True)
        if error is None and alloc_id not in self.allocs:
            error = "UNKNOWN_ALLOCATION"
        if error is None:
            del self.allocs[alloc_id]
            self.host.discard(alloc_id)
            for key in [k for k, v in self.meta.items() if v[0] == alloc_id]:
                del self.meta[key]
        return error

    def metadata_put(self, conn: int, key: str, alloc_id: str, offset: int, value: bytes):
        error = self._auth(conn, True) or self._text(key, self.max_key_bytes)
        if error is None and len(value) > self.max_value:
            error = "LIMIT_EXCEEDED"
        if error is None and alloc_id not in self.allocs:
            error = "UNKNOWN_ALLOCATION"
        if error is None and not 0 <= offset < self.allocs[alloc_id][0]:
            error = "OFFSET_OUT_OF_BOUNDS"
        if error is None and key not in self.meta and len(self.meta) >= self.max_keys:
            error = "LIMIT_EXCEEDED"
        if error is None:
            self.meta[key] = (alloc_id, offset, value)
        return error

    def metadata_delete(self, conn: int, key: str):
        error = self._auth(conn, True)
        if error is None:
            return None, self.meta.pop(key, None) is not None
        return error, False

    def commit(self, conn: int, residency: str, clock, persist: bool = False):
        error = self._auth(conn, True)
        if error is None and residency not in ("device", "system", "unpinned"):
            error = "INVALID_ARGUMENT"
        if error is None and residency == "system" and self.host != set(self.allocs):
            error = "HOST_COPY_MISSING"
        if error is None:
            self.writer = None
            self.committed = True
            self.residency = residency
            self.persist = persist
            self.save_failed = False
            if not persist:  # a commit asking for no snapshot lets the kept one go
                self.kept, self.kept_owner = 0, None
            self.layout_hash = reference_hash(self.allocs, self.meta)
            self.last_use = clock()
        return error

    def get_allocation(self, conn: int, alloc_id: str):
        error = self._auth(conn, False)
        if error is None and alloc_id not in self.allocs:
            error = "UNKNOWN_ALLOCATION"
        return error, None if error else self.allocs[alloc_id]

    def list_allocations(self, conn: int, tag: str | None):
        error = self._auth(conn, False)
        if error:
            return error, None
        ids = [i for i in self.allocs if tag is None or self.allocs[i][2] == tag]
        return None, sorted(ids, key=lambda i: self.allocs[i][3])

    def metadata_get(self, conn: int, key: str):
        error = self._auth(conn, False)
        return error, None if error else self.meta.get(key)

    def metadata_list(self, conn: int, prefix: str):
        error = self._auth(conn, False)
        return error, None if error else sorted(k for k in self.meta if k.startswith(prefix))
