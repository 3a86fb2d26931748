"""The disk tier's folder as it is, beyond what the log names: at a cold start,
every snapshot found again (the latest of each layout's, if its owner may write
it and the rules take it: ``LAYOUT_RECOVERED``), the rest set aside, left where
it is or left unlisted (``SNAPSHOT_SET_ASIDE`` says why, in the history);
at a resumed start, only what a crash cut short goes; and the loose files (set
aside, left on disk) counted with the log's snapshots against the disk budget,
the oldest going first while it is short.  The saver
(``gms.server.service.snapshots``) holds one; a snapshot kept through a rebuild
comes back through :meth:`SnapshotFolder.bring_back` too."""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from ...disk import format as fmt
from ...disk.store import SET_ASIDE_KEPT, Found
from ...fsm import Rejection
from ...fsm.events import LayoutRecovered, SnapshotSetAside
from ..tiers.disk_files import DiskFiles
from .ledger import Ledger

log = logging.getLogger("gms.server.service.snapshots")


class SnapshotFolder:
    def __init__(self, ledger: Ledger, files: DiskFiles, may_write: Callable[[str, str], bool]) -> None:
        self.ledger = ledger
        self.files = files
        self.may_write = may_write
        # Snapshots in the folder the log does not name (a cold start refused them), by
        # layout: a writer's grant on that layout supersedes them, and they go.
        self.unlisted: dict[str, list[str]] = {}

    @property
    def store(self):
        return self.files.store

    def superseded(self, layout: str) -> None:
        """A writer's grant: the layout's snapshots the log never took go (a later cold
        start must not bring them back over what the writer makes)."""
        if layout in self.unlisted:
            files = self.unlisted.pop(layout)
            log.info("snapshots of %r that the log never took are superseded by its writer: %s", layout,
                     ", ".join(files))
            self.files.release(files)

    def bring_back(self, name: str, snapshot: Found) -> bool:
        """``LAYOUT_RECOVERED`` from a snapshot that reads, if the policy and the rules
        take it; else it is left on disk, unlisted.  Whether it came back."""
        manifest = snapshot.manifest
        if not self.may_write(manifest.owner, name):
            self.left_on_disk(name, snapshot.file, f"its owner {manifest.owner!r} may not write it under this policy")
            return False
        try:
            self.ledger.record([_recovered(name, snapshot)])
        except Rejection as exc:
            self.left_on_disk(name, snapshot.file, exc.message)
            return False
        return True

    async def recover(self) -> int:
        """At a cold start: every snapshot in the folder as a committed layout on the
        disk tier (the latest of each layout's) that its owner may write; how many were recovered."""
        found = await trio.to_thread.run_sync(self.store.scan)
        await trio.to_thread.run_sync(self.store.sweep)
        latest: dict[str, Found] = {}  # layout -> its latest snapshot
        for snapshot in found:
            if isinstance(snapshot.error, fmt.UnsupportedSnapshot):
                # Whole, of a format another gms writes (a downgrade): left where it is for
                # a gms that reads it, never renamed away (its save stamp still counts).
                log.warning("snapshot %s left as it is, not served: %s", snapshot.file, snapshot.error)
                self.not_served(snapshot.file, f"left as it is: {snapshot.error}")
                continue
            if snapshot.manifest is None:
                aside = await trio.to_thread.run_sync(self.store.set_aside, snapshot.file)
                log.error("snapshot %s does not read (%s): set aside as %s, not served", snapshot.file,
                          snapshot.error, aside)
                self.not_served(snapshot.file, f"does not read: {snapshot.error}", aside)
                continue
            older = latest.get(snapshot.manifest.name)
            if older is not None:  # a crash came between a newer save and the older one's release
                if older.manifest.saved_ns > snapshot.manifest.saved_ns:
                    self.files.release([snapshot.file])
                    continue
                self.files.release([older.file])
            latest[snapshot.manifest.name] = snapshot
        if gone := await trio.to_thread.run_sync(self.store.trim_set_aside):
            log.warning("disk tier: %d older set-aside snapshots removed (the newest %d are kept): %s", len(gone),
                        SET_ASIDE_KEPT, ", ".join(gone))
        recovered = 0
        for name, snapshot in sorted(latest.items()):
            recovered += self.bring_back(name, snapshot)
        if found:
            log.info("disk tier: %d of %d snapshots recovered as layouts on disk", recovered, len(found))
        await self.found_loose()
        return recovered

    def left_on_disk(self, name: str, file: str, why: str) -> None:
        """A snapshot this start does not recover: kept for a start whose policy takes
        it, until a writer of its layout supersedes it."""
        self.store.leave(file)
        log.warning("snapshot of %r left on disk, not recovered: %s (a writer of %r supersedes it; a start whose "
                    "policy takes it recovers it)", name, why, name)
        self.unlisted.setdefault(name, []).append(file)
        self.not_served(file, f"layout {name!r} left on disk, not recovered: {why}", layout=name)

    def not_served(self, file: str, reason: str, aside: str = "", layout: str = "") -> None:
        """A snapshot not served, in the history (``gms history``): its file, why, and its
        layout where known, which then says why to its readers (LayoutState.unserved) if
        the node has room for one more layout (at the bound, the event names none)."""
        state = self.ledger.state
        if layout and layout not in state.layouts and len(state.layouts) >= state.limits.max_layouts:
            layout = ""
        self.ledger.record([SnapshotSetAside(0, file, reason, aside, layout=layout)], by_server=True)

    async def sweep(self) -> None:
        """A resumed node: only what a crash cut short goes (the log says what exists);
        snapshots the log does not name (a cold start refused them) are found again,
        for a writer of their layout to supersede."""
        await trio.to_thread.run_sync(self.store.sweep)
        named = _held(self.ledger.state)
        unknown = await trio.to_thread.run_sync(self.store.scan, lambda file: file not in named)
        for snapshot in unknown:
            if snapshot.manifest is not None:
                self.unlisted.setdefault(snapshot.manifest.name, []).append(snapshot.file)
        await self.found_loose()

    async def found_loose(self) -> None:
        """At a start: the files no layout holds count against the budget; past it, they go."""
        held = _held(self.ledger.state)
        await trio.to_thread.run_sync(self.store.find_loose, held.__contains__)
        await self.fit(0)

    async def fit(self, needed: int) -> None:
        """Room for ``needed`` more bytes of snapshots under the disk budget: the log's
        snapshots and the loose files (set aside, left on disk) count together, and
        loose ones go (set-aside first, the oldest first) while the budget is short."""
        budget, tried = self.ledger.state.disk_budget_bytes, set()
        while budget is not None and self.ledger.state.disk_bytes + (loose := self.store.loose_bytes) + needed > budget:
            if (file := self.store.first_to_go(tried)) is None:
                return  # (the fold's bounds refuse what still does not fit)
            tried.add(file)  # (one that will not go is tried once)
            log.warning("disk tier: %s removed (no layout holds it) to keep the folder under its budget of %d bytes "
                        "(%d in snapshots, %d loose, %d asked)", file, budget, self.ledger.state.disk_bytes, loose,
                        max(needed, 0))
            await trio.to_thread.run_sync(self.store.remove, file)
            for files in self.unlisted.values():
                if file in files:
                    files.remove(file)


def _held(state) -> set[str]:
    """The files the log's layouts hold: their snapshots and those kept through a rebuild."""
    return {file for layout in state.layouts.values() for file in (layout.disk_file, layout.kept_file) if file}


def _recovered(name: str, snapshot: Found) -> LayoutRecovered:
    manifest = snapshot.manifest
    return LayoutRecovered(0, manifest.owner, manifest.layout_hash, [list(a) for a in manifest.allocations],
                           [list(m) for m in manifest.metadata], snapshot.size, snapshot.file, manifest.residency,
                           layout=name)
