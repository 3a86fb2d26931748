"""A handshake, served: the session opened (the core decides), the lock waited
for (heartbeats to a client that asked), a restore of an evicted layout made
for the reader asked to (from the host tier, or from disk), and the answer.

Each function takes the session it serves, as much of it as ``Served`` says
(``gms.server.service.served``): its connection, what it waits on (``waits``,
sans I/O: what a take-over hands over) and its way of seeing its client go
(``until_gone``).
"""

from __future__ import annotations

import math

import trio

from ...fsm import Grant, SnapshotUnreadable, Tier
from ...fsm.events import LockTimeout
from ...fsm.folding import restore_source
from ...handover.words import Waiting
from ...wire import encode
from ...wire import messages as m
from ..edge.admission import FdsExhausted
from ..edge.netio import PeerGone, wait_or_hangup
from ..edge.reply import Reply, error_reply
from .placement import OutOfMemoryTimeout
from .served import Served

MIN_HEARTBEAT_MS = 100  # a client asking for more is told this often at most


async def handshake(s: Served, request: m.HandshakeRequest) -> Reply:
    waits = s.waits
    requested = s.core.handshake(s.conn, request, s.peer, s.on_grant, s.alive, s.turned_away)
    if waits.grant is not None:  # at once: nobody was ahead
        s.metrics.lock_waited(requested.value, 0.0)
        return await after_grant(s, request, waits.grant)
    timeout = math.inf if request.timeout_ms is None else request.timeout_ms / 1000
    waits.ask_lock(request, requested, timeout, trio.current_time())
    return await wait_for_lock(s)


async def wait_for_lock(s: Served) -> Reply:
    """Until the lock is granted, the wait times out, nothing will grant it (its
    layout's snapshot not served, no writer: answered at once), or the client hangs up."""
    waits = s.waits
    wait = waits.lock
    request, requested = wait.request, wait.requested
    hung_up = False
    if waits.grant is None and not waits.turned_away:
        granted = s.expect_grant()
        with trio.move_on_at(wait.deadline), s.quiesce.interruptible():
            hung_up = await wait_or_hangup(lambda: _until_granted(s, granted), s.until_gone)
    if waits.grant is None:
        waits.lock_ended()
        s.core.cancel_lock_request(s.conn)
        if hung_up:
            raise PeerGone("hung up while waiting for the lock")
        unserved = s.core.state.layout(request.layout).unserved if waits.turned_away else ""
        s.core.ledger.record([LockTimeout(s.conn, requested.value, request.timeout_ms or 0, unserved,
                                          layout=request.layout)])
        return Reply(response(s, None))
    waits.lock_ended()
    s.metrics.lock_waited(requested.value, trio.current_time() - wait.asked_at)
    return await after_grant(s, request, waits.grant)


async def _until_granted(s: Served, granted: trio.Event) -> None:
    """Wait for the grant, saying so now and then to a client that asked
    (``heartbeat_ms``): it then tells a wait from a server that hangs."""
    heartbeat_ms = getattr(s.waits.lock.request, "heartbeat_ms", None)
    if not heartbeat_ms:
        await granted.wait()
        return
    every = max(heartbeat_ms, MIN_HEARTBEAT_MS) / 1000
    while True:
        with trio.move_on_after(every):
            await granted.wait()
            return
        waited = int((trio.current_time() - s.waits.lock.asked_at) * 1000)
        s.channel.send_if_idle(encode(m.LockWaiting(waited)))


async def after_grant(s: Served, request: m.HandshakeRequest, grant: Grant) -> Reply:
    """The grant made: a restorer's memory and copy first, then the answer."""
    core = s.core
    restored = False  # by the copier: then the reader is granted a plain RO
    if grant.restore:
        if request.heartbeat_ms:  # a word before the restore's waits: this server is alive
            s.channel.send_if_idle(encode(m.LockWaiting(0)))
        layout = core.state.layout(request.layout)
        from_disk = restore_source(layout) is Tier.DISK
        try:
            with s.waiting_for(Waiting.RESTORE):
                await core.placement.with_memory(
                    s.conn, lambda: core.placement.restore(s.conn), layout.held_bytes, "restore",
                    s.until_gone, s.quiesce.interruptible,
                )
            if from_disk:  # only the server reads its disk: the copier fills the memory, or nobody does
                if core.snapshots is None:
                    raise SnapshotUnreadable(f"layout {layout.name!r} is on disk and this server keeps no disk tier")
                await core.snapshots.restore(s.conn, s.until_gone)
                restored = True
        except (OutOfMemoryTimeout, FdsExhausted, SnapshotUnreadable) as exc:
            return error_reply(exc, close_after=True)  # give the restore up: the next reader takes it
        if core.transfers is not None and not from_disk:
            restored = await core.transfers.restore(s.conn, s.until_gone)
    return Reply(response(s, grant, restored))


def response(s: Served, grant: Grant | None, restored: bool = False) -> m.HandshakeResponse:
    state = s.core.state
    session = state.sessions.get(s.conn)
    layout = state.layout(session.layout) if session else None
    device = s.core.device
    return m.HandshakeResponse(
        success=grant is not None,
        committed=bool(layout and layout.committed),
        granted_lock_type=None if grant is None else grant.granted.value,
        backend=device.backend,
        device=device.device,
        device_uuid=device.uuid,
        memory_layout_hash=(layout.layout_hash if layout else None) or "",
        layout=layout.name if layout else "",
        tenant=session.tenant if session else "",
        restore=grant is not None and grant.restore and not restored,
        max_frame_bytes=s.config.max_frame_bytes,
        unserved=layout.unserved if layout and grant is None else "",
    )
