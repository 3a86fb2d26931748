"""Memory made free wakes a waiting allocation at once, whatever made it free.

Black-box, over real sockets to a real server: an allocation waits for room
under the GPU budget while another layout fills it; then room is made by a
writer's RW_CONNECT clearing that layout, by its writer's abort, by an
admin's revoke, or by its last reader leaving so that it can be evicted.
The waiting allocation must be granted well before the server's retry timer
could have found the room: the timer's ticks are at 1, 3, 7, ... ms after
the wait began (doubling up to ``--alloc-retry-interval``, here 30 s), so
room made 2.2 s into the wait is seen by the timer only at 4.095 s.  Before
the one write path, RW_CONNECT (and a reader leaving) woke nobody.
"""

from __future__ import annotations

import time

import pytest

from gms.wire import messages as m

from .helpers import MiB, RawConn, wait_until

BUDGET = 8 * MiB
TRIGGER_AFTER_S = 2.2  # between the timer's ticks at 2.047 s and 4.095 s
WAKE_WITHIN_S = 0.5


def writer(server, layout: str, size: int = 0) -> RawConn:
    conn = RawConn(server.socket)
    assert conn.call(m.HandshakeRequest("RW", None, layout)).success
    if size:
        assert isinstance(conn.call(m.AllocateRequest(size)), m.AllocateResponse)
    return conn


def committed(server, layout: str, residency: str) -> None:
    conn = writer(server, layout, BUDGET)
    assert conn.call(m.CommitRequest(residency)).success


@pytest.mark.parametrize("how", ["rw_connect", "abort", "revoke", "last_reader_leaves"])
def test_room_made_any_way_wakes_a_waiting_allocation_at_once(start_server, how):
    server = start_server("--gpu-budget", str(BUDGET), "--alloc-retry-interval", "30")
    holder = None
    if how == "rw_connect":
        committed(server, "old", "device")  # pinned: never evicted for the waiter
    elif how in ("abort", "revoke"):
        holder = writer(server, "old", BUDGET)
    else:
        committed(server, "old", "unpinned")
        holder = RawConn(server.socket)  # a reader keeps it in use, so not evictable
        assert holder.call(m.HandshakeRequest("RO", None, "old")).success

    waiter = writer(server, "new")
    waiter.send(m.AllocateRequest(2 * MiB))
    waiting = wait_until(
        lambda: [e for e in server.events() if e.kind == "ALLOCATION_OOM_WAIT"], what="the allocation waiting"
    )
    began_s = waiting[0].mono_ns / 1e9  # the server's CLOCK_MONOTONIC, the same as ours
    time.sleep(max(0.0, began_s + TRIGGER_AFTER_S - time.monotonic()))

    made_room_at = time.monotonic()
    if how == "rw_connect":
        rebuilder = writer(server, "old")  # RW_CONNECT clears the committed layout: its memory goes
    elif how == "abort":
        holder.sock.close()
    elif how == "revoke":
        assert RawConn(server.socket).call(m.RevokeRequest("old")).sessions == 1
    else:
        holder.sock.close()  # RO_DISCONNECT: nothing released, but "old" may now be evicted
    response, _ = waiter.recv(timeout=10)
    woke_after_s = time.monotonic() - made_room_at

    assert isinstance(response, m.AllocateResponse), response
    assert woke_after_s < WAKE_WITHIN_S, f"woken {woke_after_s:.2f} s after the room was made: by the timer"
    if how == "rw_connect":
        rebuilder.sock.close()
