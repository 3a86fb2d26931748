"""Restore at start: layouts a cold start recovered from the disk tier, put back
on the GPU by the server before it serves (``gms serve --restore-at-start``).

Without it the first reader of each layout restores it, and waits in its
handshake for the disk.  With it the server restores them itself, one at a
time, as that reader would: a session of its own (the server's uid and pid,
the layout's owner as tenant) granted the restore (``RESTORE_CLAIMED``), its
GPU memory made (``RESTORE_LOADING``), the copier reading the snapshot into
it (``RESTORE_FINISHED``), then the session closed.  The history shows each
step like a client's.  Before the listener accepts anyone: no client waits
behind a half-done restore and no take-over meets a session without a socket.

Only what fits: a layout the GPU budget or the device has no room for stays
on disk (nothing is evicted to make room for a warm-up); a snapshot that does
not read back is dropped as at any restore.  Readers then find the layouts on
the GPU and import at once.
"""

from __future__ import annotations

import logging
import os
import time

import trio

from ...cuda.interface import OutOfMemory
from ...fsm import (
    Grant,
    Rejection,
    RequestedLockType,
    SnapshotUnreadable,
    decide_session,
    gpu_shortfall,
)
from ..edge.admission import FdsExhausted
from .core import ServiceCore

log = logging.getLogger("gms.server.service.warm_start")


async def restore_recovered(core: ServiceCore) -> list[str]:
    """Restore every layout on the disk tier that fits, by name; the names restored."""
    state = core.state
    restored = []
    for name in sorted(n for n, layout in state.layouts.items() if layout.recovered):
        if await restore_one(core, name):
            restored.append(name)
    return restored


async def restore_one(core: ServiceCore, name: str) -> bool:
    """One layout from its snapshot onto the GPU; False (and why, logged) where it stays on disk."""
    layout = core.state.layouts[name]
    if gpu_shortfall(core.state, layout.held_bytes):
        log.info("restore at start: %r stays on disk (%d bytes do not fit the GPU budget)", name, layout.held_bytes)
        return False
    conn = core.new_conn()
    started = time.perf_counter()
    try:
        (opened,) = decide_session(
            core.state, conn, name, RequestedLockType.RO, tenant=layout.owner, may_read=True, may_write=False,
            uid=os.getuid(), gid=os.getgid(), pid=os.getpid(), limit_bytes=None, expect_hash=layout.layout_hash,
        )
        granted: list[Grant] = []
        core.open_session(conn, opened, granted.append)
    except Rejection as refused:
        log.warning("restore at start: %r stays on disk: %s", name, refused.message)
        return False
    try:
        if not granted or not granted[0].restore:  # (nothing else runs yet: the rules would say why)
            log.warning("restore at start: %r not granted a restore; it stays on disk", name)
            return False
        await core.placement.restore(conn, evict=False)
        await core.snapshots.restore(conn, trio.sleep_forever)
    except OutOfMemory:
        log.info("restore at start: %r stays on disk (the device has no room for %d bytes)", name, layout.held_bytes)
        return False
    except (FdsExhausted, SnapshotUnreadable, Rejection) as exc:
        log.warning("restore at start: %r not restored: %s", name, getattr(exc, "message", exc))
        return False
    finally:
        core.disconnect(conn)  # a restore cut short goes back to disk (RESTORE_ABORTED)
    took = time.perf_counter() - started
    log.info("restore at start: %r in device memory (%.1f MiB in %.2f s)", name, layout.held_bytes / 2**20, took)
    return True
