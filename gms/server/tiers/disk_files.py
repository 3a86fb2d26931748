"""The disk tier's files as the write path lets them go: what a released snapshot
becomes (an unlink on the disk's lane, off the loop).  Made before the ledger, which
hands it the snapshots each batch releases, as it hands the memory tables
theirs; the saver and the restorer (``gms.server.service.snapshots``) use
the same folder and lane.  A node without a disk tier has :data:`NO_FILES`: the
files stay for a server that keeps one."""

from __future__ import annotations

from collections.abc import Iterable

from ...disk.store import DiskStore
from .lanes import Lane


class DiskFiles:
    def __init__(self, store: DiskStore) -> None:
        self.store = store
        self.lane = Lane("disk")  # unlinks, off the loop (one that fails is left and said: never fatal)

    def release(self, files: Iterable[str]) -> None:
        for file in files:
            self.lane.post(self.store.remove, file)

    def stop(self) -> None:
        self.lane.stop()

    def close(self) -> None:
        self.lane.stop()
        self.store.close()


class NoFiles:
    """No disk tier here."""

    def release(self, files: Iterable[str]) -> None:
        """A server without a disk tier leaves the files for one with it."""


NO_FILES = NoFiles()
