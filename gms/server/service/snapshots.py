"""The disk tier's shell: a snapshot saved after each commit that asks, a layout
restored from one, every snapshot found again when a server starts with nothing.

* **save** (:meth:`Snapshots.run`): the layouts committed to persist and not
  saved yet (``gms.fsm.queries.unsaved``), one at a time, off every request's
  path.  The rules are asked first (the disk budget, the owner's disk quota:
  ``SNAPSHOT_SAVED`` folded, not recorded), room is reserved on disk, the
  copier copies the allocations into the file with a crc32 per extent, the
  store seals it (manifest, fsync, rename), and ``SNAPSHOT_SAVED`` is decided
  again on the state as it is then: a layout rewritten or dropped meanwhile
  gets no snapshot (the file is removed).  A save that fails (a full disk, the
  budget, no copier, an I/O error) is ``SNAPSHOT_FAILED`` with the reason; the
  commit stands, and the save is tried again while the layout is unchanged,
  after 1 s, then twice as long each time up to a minute (``SNAPSHOT_FAILED``
  again only when the reason changes): a disk that had no room saves once it
  has some.
* **restore** (:meth:`Snapshots.restore`): the reader granted the restore of a
  layout on the disk tier waits in its handshake while its GPU memory is made
  (as for the host tier) and the copier reads the file into it, checking every
  extent.  A snapshot that does not read back whole is ``SNAPSHOT_FAILED`` and
  the layout is dropped (``LAYOUT_LOST``): never served.
* **recover** (:meth:`Snapshots.recover`): at a cold start (no keeper state),
  every snapshot in the folder becomes ``LAYOUT_RECOVERED``, checked by the
  rules like a client's layout; one that does not read is set aside
  (``*.corrupt``, the newest ``SET_ASIDE_KEPT`` of them kept for the operator,
  older ones removed), one the policy refuses (its owner gone) stays for a later start.
* **revert** (:meth:`Snapshots.revert`): a rebuild that ended with no newer
  commit (its writer gone, or its commit's memory lost) left the layout empty
  with the snapshot kept through it: that comes back as at a cold start
  (``LAYOUT_RECOVERED``); one that does not read is set aside, one refused is
  left on disk (``SNAPSHOT_SET_ASIDE``), and the layout stays empty.
* **spill** (:meth:`Snapshots.spill`): the host tier is short of room for new
  host copies: saved layouts on it, least recently used first, let their host
  copies go (``LAYOUT_SPILLED``: tier disk), if that makes the room.

Files are released as the ledger says (the disk tier's rows: a layout cleared,
dropped or lost), on the disk lane (``gms.server.tiers.disk_files``, in the tier table).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Awaitable, Callable

import attrs
import trio

from ...disk import format as fmt
from ...fsm import Rejection, SnapshotUnreadable, decide_restore_finished, decide_spill, plan_spills
from ...fsm.events import (
    LayoutLost,
    RestoreAborted,
    RwAbort,
    RwCommit,
    RwConnect,
    SnapshotFailed,
    SnapshotSaved,
)
from ...fsm.queries import layout_of, reverting, snapshot_rows, unsaved
from ...fsm.state import LayoutState
from ..edge.netio import PeerGone, wait_or_hangup
from ..tiers.copier_link import CopierGone, CopierLink, SnapshotCorrupt
from ..tiers.disk_files import DiskFiles
from ..tiers.memory import Memory
from .ledger import Ledger
from .snapshot_folder import SnapshotFolder

log = logging.getLogger("gms.server.service.snapshots")
_MAX_CRC = 0xFFFFFFFF  # a manifest's size is bounded by one with every checksum at its widest
SAVE_RETRY_FIRST_S = 1.0  # a failed save is tried again after this, then twice as long each time ...
SAVE_RETRY_MAX_S = 60.0  # ... up to this
_MAY_REVERT = (RwAbort, LayoutLost)  # the events that may leave a layout to the snapshot kept through its rebuild


@attrs.frozen
class Waiting:
    """A commit whose save failed: tried again at ``at`` (trio's clock)."""

    at: float
    delay: float
    reason: str


def retry_delay(last: Waiting | None) -> float:
    """How long after a failed save the next try comes.  Pure."""
    return SAVE_RETRY_FIRST_S if last is None else min(last.delay * 2, SAVE_RETRY_MAX_S)


class Snapshots:
    def __init__(
        self, ledger: Ledger, gpu: Memory, files: DiskFiles, link: CopierLink | None,
        may_write: Callable[[str, str], bool],
    ) -> None:
        self.ledger = ledger
        # ``may_write(owner, layout)``: the policy's word, asked as of a writer before a
        # snapshot comes back (it names its owner itself: trusted no more than a client).
        self.may_write = may_write
        self.gpu = gpu
        self.files = files  # what the ledger releases goes there too
        self.link = link
        self._wake = trio.Event()
        self.waiting: dict[tuple[str, str, int], Waiting] = {}  # commits (layout, hash, count) whose save failed
        self.folder = SnapshotFolder(ledger, files, may_write)  # what it holds beyond what the log names

    # -- what the ledger and the core tell it -----------------------------------------

    def notice(self, event) -> None:
        """Every recorded event: a commit that asks for a snapshot, or a rebuild that
        may have ended with none (:meth:`revert`), wakes the saver; a writer's grant
        supersedes the layout's snapshots the log never took (a later cold start must
        not bring them back over what the writer makes)."""
        kind = type(event)
        if kind is RwCommit and event.persist or kind in _MAY_REVERT and _awaits_revert(self.ledger.state, event.layout):
            self._wake.set()
        elif kind is RwConnect:
            self.folder.superseded(event.layout)

    def spill(self, needed: int) -> bool:
        """Make ``needed`` bytes of host tier room by spilling saved layouts to
        disk; False (nothing spilled) where all of them would not make it."""
        plan = plan_spills(self.ledger.state, needed, self.ledger.queues.busy())
        for name in plan or ():
            self.ledger.record(decide_spill(self.ledger.state, 0, name, "host budget"), by_server=True)
        return bool(plan)

    @property
    def store(self):
        """The folder (the disk tier's files hold it)."""
        return self.files.store

    # -- saving ------------------------------------------------------------------------

    async def run(self) -> None:
        """Save what waits (a failed save when its next try is due), then wait for
        the next commit that asks or the next try (the server's nursery)."""
        while True:
            for name in reverting(self.ledger.state):
                await self.revert(name)
            state = self.ledger.state
            pending = {_commit(state.layouts[name]): name for name in unsaved(state)}
            self.waiting = {c: w for c, w in self.waiting.items() if c in pending}  # saved, rewritten or gone
            for commit, name in pending.items():
                waiting = self.waiting.get(commit)
                # (after an earlier save's awaits the layout may be gone: save reads it again)
                if (waiting is None or waiting.at <= trio.current_time()) and name in self.ledger.state.layouts:
                    await self.save(name)
            with trio.move_on_at(min((w.at for w in self.waiting.values()), default=math.inf)):
                await self._wake.wait()
            self._wake = trio.Event()

    async def save(self, name: str) -> bool:
        """One layout's snapshot; whether ``SNAPSHOT_SAVED`` was recorded (a failure
        is tried again: :meth:`run`)."""
        layout = self.ledger.state.layouts[name]
        commit, layout_hash = _commit(layout), layout.layout_hash
        allocations, metadata = snapshot_rows(layout)
        extents = fmt.plan([row[2] for row in allocations])
        manifest = fmt.Manifest(name, layout_hash, layout.owner, tuple(map(tuple, allocations)),
                                tuple(map(tuple, metadata)), extents, saved_ns=self.store.next_stamp(),
                                residency=layout.residency.value)
        file = fmt.file_name(name, layout_hash, manifest.saved_ns)
        widest = attrs.evolve(manifest, extents=tuple(attrs.evolve(e, crc=_MAX_CRC) for e in extents))
        bound = manifest.data_bytes + len(await trio.to_thread.run_sync(fmt.encode, widest, manifest.data_bytes))
        started = time.perf_counter()
        await self.folder.fit(bound - layout.kept_bytes)  # (the snapshot kept through its rebuild goes with it)
        try:
            self.ledger.fold([SnapshotSaved(0, layout_hash, bound, file, layout=name)])  # the budget, the quota
            if self.link is None or not await self.link.usable():
                raise CopierGone("no copier runs to read the layout's memory (gms serve --no-copier?)")
            pending = await trio.to_thread.run_sync(self.store.begin, file, bound)  # ENOSPC: a full disk
        except (Rejection, CopierGone, OSError) as exc:
            return self._failed(name, layout_hash, commit, _why(exc))
        try:
            crcs = await self._copy(True, layout, extents, os.dup(pending.fd))
            manifest = attrs.evolve(manifest, extents=tuple(attrs.evolve(e, crc=c) for e, c in zip(extents, crcs)))
            size = await trio.to_thread.run_sync(self.store.seal, pending, manifest)
        except BaseException as exc:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self.store.abandon, pending)
            if isinstance(exc, (CopierGone, OSError, SnapshotCorrupt)):
                return self._failed(name, layout_hash, commit, _why(exc))
            raise
        # Decided again after the awaits: a layout rewritten, dropped or saved meanwhile gets none.
        now = self.ledger.state.layouts.get(name)
        if now is None or _commit(now) != commit:
            self.files.release([file])
            log.info("snapshot of %r not kept: the layout changed while it was saved", name)
            return False
        try:
            self.ledger.record([SnapshotSaved(0, layout_hash, size, file, layout=name)])
        except Rejection as exc:
            self.files.release([file])
            return self._failed(name, layout_hash, commit, _why(exc))
        took = time.perf_counter() - started
        log.info("snapshot of %r saved: %.1f MiB in %.2f s (%.2f GiB/s)", name, size / 2**20, took,
                 size / 2**30 / max(took, 1e-9))
        return True

    def _failed(self, name: str, layout_hash: str, commit: tuple[str, str, int], reason: str) -> bool:
        last = self.waiting.get(commit)
        delay = retry_delay(last)
        self.waiting[commit] = Waiting(trio.current_time() + delay, delay, reason)
        if last is None or last.reason != reason:  # said once per reason, not at every try
            self._record_failure(name, layout_hash, f"{reason} (the commit stands; tried again in {delay:.0f} s, "
                                 f"then less often up to every {SAVE_RETRY_MAX_S:.0f} s, while the layout is unchanged)")
        return False

    def _record_failure(self, name: str, layout_hash: str, reason: str) -> None:
        log.warning("snapshot of %r not saved: %s", name, reason)
        self.ledger.record([SnapshotFailed(0, layout_hash, reason, layout=name)], by_server=True)

    # -- reverting ---------------------------------------------------------------------

    async def revert(self, name: str) -> None:
        """A rebuild ended with no newer commit (its writer gone, its commit lost): the
        layout comes back from the snapshot kept through it, checked as at a cold start
        (``LAYOUT_RECOVERED``); one that does not read is set aside, one the policy
        refuses is left unlisted (``SNAPSHOT_SET_ASIDE``: kept no longer)."""
        if not _awaits_revert(self.ledger.state, name):
            return  # (an earlier revert's awaits: a writer came, or it went)
        file = self.ledger.state.layouts[name].kept_file
        found = await trio.to_thread.run_sync(self.store.find, file)
        if not _awaits_revert(self.ledger.state, name) or self.ledger.state.layouts[name].kept_file != file:
            return  # a writer came meanwhile (it keeps the snapshot till a newer one is whole)
        if found.manifest is not None and found.manifest.name != name:
            found = attrs.evolve(found, manifest=None, error=fmt.CorruptSnapshot(f"it names layout {found.manifest.name!r}"))
        if found.manifest is None:
            aside = await trio.to_thread.run_sync(self.store.set_aside, file)
            log.error("the snapshot kept for %r does not read (%s): %s, the layout stays empty", name, found.error,
                      f"set aside as {aside}" if aside else "gone")
            self.folder.not_served(file, f"kept through a rebuild, does not read: {found.error}", aside, layout=name)
            return
        if self.folder.bring_back(name, found):
            log.info("layout %r is back from the snapshot kept through its rebuild (%s)", name, file)

    # -- restoring ---------------------------------------------------------------------

    async def restore(self, conn: int, until_gone: Callable[[], Awaitable[None]]) -> None:
        """Fill the layout ``conn`` restores (``RESTORING``, its GPU memory made)
        from its snapshot, then ``RESTORE_FINISHED``.  SnapshotUnreadable if it
        could not (the layout dropped where the snapshot is bad); PeerGone if
        the reader left."""
        layout = layout_of(self.ledger.state, conn)
        if self.link is None or not await self.link.usable():
            raise SnapshotUnreadable(
                f"layout {layout.name!r} is on disk and no copier runs to read it "
                f"({'none configured' if self.link is None else self.link.state}): ask again"
            )
        try:
            fd, manifest = await trio.to_thread.run_sync(self.store.open, layout.disk_file)
        except (fmt.SnapshotError, OSError) as exc:
            self._drop(conn, layout, _why(exc))
        allocations, _ = snapshot_rows(layout)
        if [list(a) for a in manifest.allocations] != allocations:
            os.close(fd)
            self._drop(conn, layout, "the snapshot holds other allocations than the layout it is named for")
        failed: list[BaseException] = []

        async def copy() -> None:
            try:
                await self._copy(False, layout, manifest.extents, fd)
            except (CopierGone, SnapshotCorrupt) as exc:
                failed.append(exc)

        started = time.perf_counter()
        if await wait_or_hangup(copy, until_gone):
            raise PeerGone("hung up while its layout was restored from disk")
        if failed and isinstance(failed[0], SnapshotCorrupt):
            self._drop(conn, layout, _why(failed[0]))
        if failed:
            raise SnapshotUnreadable(f"layout {layout.name!r} could not be read from disk ({failed[0]}): ask again")
        self.ledger.record(decide_restore_finished(self.ledger.state, conn, layout.name))
        took = time.perf_counter() - started
        log.info("restore of %r from disk: %.1f MiB in %.2f s (%.2f GiB/s)", layout.name,
                 layout.held_bytes / 2**20, took, layout.held_bytes / 2**30 / max(took, 1e-9))

    def _drop(self, conn: int, layout: LayoutState, reason: str) -> None:
        """A snapshot that does not read back: never served; the layout goes with it."""
        log.error("the snapshot of %r does not read back (%s): the layout is dropped", layout.name, reason)
        self.ledger.record([
            RestoreAborted(conn, layout=layout.name),
            SnapshotFailed(0, layout.layout_hash, reason, layout=layout.name),
            LayoutLost(0, f"its snapshot does not read back: {reason}", "", "disk", layout=layout.name),
        ], by_server=True)
        raise SnapshotUnreadable(
            f"layout {layout.name!r}'s snapshot does not read back ({reason}): it was dropped, build it again"
        )

    async def _copy(self, to_file: bool, layout: LayoutState, extents, file_fd: int) -> list[int]:
        allocations = sorted(layout.allocations.values(), key=lambda a: a.layout_slot)
        try:
            fds = self.gpu.export_many(a.allocation_id for a in allocations)  # lent from the fd budget ...
        except BaseException:
            os.close(file_fd)
            raise
        try:
            return await self.link.file_copy(to_file, [*fds, file_fd], [a.aligned_size for a in allocations],
                                             extents)
        finally:  # ... until the link has sent and closed them
            if self.gpu.fds is not None:
                self.gpu.fds.returned(len(fds))

def _awaits_revert(state, name: str) -> bool:
    layout = state.layouts.get(name) if name else None
    return layout is not None and layout.awaits_revert


def _commit(layout: LayoutState) -> tuple[str, str, int]:
    """One commit of a layout (a rebuild of the same structure hashes the same)."""
    return layout.name, layout.layout_hash, layout.loads


def _why(exc: BaseException) -> str:
    return getattr(exc, "message", None) or str(exc) or type(exc).__name__
