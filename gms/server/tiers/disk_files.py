"""The disk tier's files as the write path lets them go: what a released snapshot
becomes (an unlink on the disk's lane, off the loop).  Made before the ledger, which
hands it the snapshots each batch releases, as it hands the memory tables
theirs (``gms.server.tiers.table``); the saver and the restorer
(``gms.server.service.snapshots``) use the same folder and lane.  A node without a
disk tier has the table's ``Absent`` one: the files stay for a server that keeps one."""

from __future__ import annotations

from collections.abc import Iterable

from ...disk.store import DiskStore
from .lanes import Lane
from .table import HoldsNoFds


class DiskFiles(HoldsNoFds):
    name = "disk"
    # No fd is a snapshot: a new server finds the files in the folder (gms.server.service.warm_start),
    # and one that is gone is found gone by its reader (the restore's check).
    unadoptable = "a snapshot is a file in the folder, not an fd"

    def __init__(self, store: DiskStore) -> None:
        self.store = store
        self.lane = Lane("disk")  # unlinks, off the loop (one that fails is left and said: never fatal)

    def release(self, files: Iterable[str]) -> None:
        for file in files:
            self.lane.post(self.store.remove, file)

    async def watch(self) -> None:
        await self.lane.watch()

    def stop(self) -> None:
        self.lane.stop()

    async def close(self) -> None:
        """Stop the lane and close the folder; the snapshots stay (they outlive the server)."""
        self.lane.stop()
        self.store.close()
