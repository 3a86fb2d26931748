"""Lock transitions of the seed's tables, over real sockets to a real server."""

from __future__ import annotations

import array
import socket
import time

from gms.wire import encode
from gms.wire import messages as m

from .helpers import RawConn, build_layout, wait_until


def commit_layout(server, sizes=(2 << 20,)) -> str:
    writer = RawConn(server.socket)
    assert writer.handshake("RW").granted_lock_type == "RW"
    build_layout(writer, sizes)
    response = writer.call(m.CommitRequest())
    assert response.success and len(response.memory_layout_hash) == 64
    assert writer.closed_by_peer(), "the server closes a committed writer"
    writer.close()
    return response.memory_layout_hash


def test_every_transition_of_the_state_table(server):
    assert server.layout().state == "EMPTY"
    ro = RawConn(server.socket)
    ro.send(m.HandshakeRequest("RO", 100))
    assert ro.recv()[0].success is False, "EMPTY refuses RO (it waits, then times out)"

    writer = RawConn(server.socket)
    assert writer.handshake("RW") == m.HandshakeResponse(
        True, False, "RW", server.backend, 0, writer_uuid(server), "", "weights", "default",
        max_frame_bytes=16 << 20,  # the server's frame cap: the client refuses bigger requests itself
    )
    assert server.layout().state == "RW"  # EMPTY -> RW
    build_layout(writer)
    writer.close()  # RW -> EMPTY (abort)
    wait_until(lambda: server.layout().state == "EMPTY", what="RW_ABORT")
    assert server.layout().allocation_count == 0

    layout_hash = commit_layout(server)  # EMPTY -> RW -> COMMITTED
    state = server.state()
    assert (state.layout("weights").state, state.layout("weights").committed, state.layout("weights").memory_layout_hash) == ("COMMITTED", True, layout_hash)

    readers = [RawConn(server.socket) for _ in range(3)]
    for reader in readers:  # COMMITTED -> RO, RO -> RO
        response = reader.handshake("RO")
        assert (response.granted_lock_type, response.committed) == ("RO", True)
        assert response.memory_layout_hash == layout_hash
    assert server.layout().readers == 3
    readers.pop().close()  # RO -> RO (not last)
    wait_until(lambda: server.layout().readers == 2, what="RO_DISCONNECT")
    assert server.layout().state == "RO"
    for reader in readers:
        reader.close()  # RO -> COMMITTED (last)
    wait_until(lambda: server.layout().state == "COMMITTED", what="last RO_DISCONNECT")

    writer = RawConn(server.socket)
    writer.handshake("RW")  # COMMITTED -> RW: the layout is cleared at once
    state = server.state()
    assert (state.layout("weights").state, state.layout("weights").allocation_count, state.layout("weights").memory_layout_hash) == ("RW", 0, "")
    assert state.allocations_cleared >= 2
    writer.close()
    wait_until(lambda: server.layout().state == "EMPTY", what="the last RW_ABORT")
    # The history, read on the wire, in the seed's words and order (however the log
    # stores a reader's visit: READER_JOINED and READER_LEFT show as RO_CONNECT and
    # RO_DISCONNECT, the stored kind in logged_as, the session's fields beside it).
    rows = raw_history(server)
    assert [r["kind"] for r in rows if r["kind"] in SEED_KINDS] == [
        "RW_CONNECT", "RW_ABORT", "RW_CONNECT", "RW_COMMIT", *["RO_CONNECT"] * 3, *["RO_DISCONNECT"] * 3,
        "RW_CONNECT", "RW_ABORT"]
    seqs = [r["seq"] for r in rows]
    assert seqs == sorted(set(seqs)), "unique and increasing"
    assert not {"READER_JOINED", "READER_LEFT"} & {r["kind"] for r in rows}
    joined = [r for r in rows if r["kind"] == "RO_CONNECT"]
    assert all(r["logged_as"] == "READER_JOINED" and r["lock_type"] == "RO" and r["layout"] == "weights"
               and r["tenant"] for r in joined)


SEED_KINDS = ("RW_CONNECT", "RW_COMMIT", "RW_ABORT", "RO_CONNECT", "RO_DISCONNECT")


def raw_history(server) -> list[dict]:
    """Every event row of the history probe, read over a raw connection (no client library)."""
    rows, since = [], 0
    while True:
        probe = RawConn(server.socket)
        probe.send(m.GetEventHistoryRequest(since))
        page, _ = probe.recv()
        probe.close()
        rows += page.events
        if page.scanned_seq >= page.last_seq or page.scanned_seq <= since:
            return rows
        since = page.scanned_seq


def test_a_reader_granted_from_the_queue_shows_as_the_seed_s_events_too(server):
    commit_layout(server)
    writer = RawConn(server.socket)
    writer.handshake("RW")  # COMMITTED -> RW
    queued = RawConn(server.socket)
    queued.send(m.HandshakeRequest("RO"))  # waits behind the writer: its session first, its lock later
    wait_until(lambda: server.layout().waiting_readers == 1, what="the reader queued")
    build_layout(writer)
    writer.call(m.CommitRequest())
    assert queued.recv()[0].granted_lock_type == "RO"
    at_once = RawConn(server.socket)
    assert at_once.handshake("RO").granted_lock_type == "RO"
    queued.close()
    at_once.close()
    wait_until(lambda: server.layout().state == "COMMITTED", what="both readers gone")
    rows = raw_history(server)
    lock_rows = [r for r in rows if r["kind"] in SEED_KINDS]
    assert [r["kind"] for r in lock_rows] == [
        "RW_CONNECT", "RW_COMMIT", "RW_CONNECT", "RW_COMMIT", "RO_CONNECT", "RO_CONNECT", "RO_DISCONNECT",
        "RO_DISCONNECT"]
    from_queue, immediate = lock_rows[4], lock_rows[5]
    assert "logged_as" not in from_queue  # recorded as RO_CONNECT itself, its SESSION_OPENED before it
    assert immediate["logged_as"] == "READER_JOINED"
    opened = [r for r in rows if r["kind"] == "SESSION_OPENED" and r["conn"] == from_queue["conn"]]
    assert len(opened) == 1 and opened[0]["seq"] < from_queue["seq"]
    # Each row folds back to the event the log holds (gms replay of a saved history).
    from gms.operator.postmortem import event_row, row_event

    for row in rows:
        event = row_event({k: (v.hex() if isinstance(v, bytes) else v) for k, v in row.items()})
        assert event_row(row["seq"], row["time"], event)["kind"] == row["kind"]


def writer_uuid(server) -> str:
    return server.state().device_uuid


def test_rw_or_ro_empty_gives_rw_and_committed_gives_ro(server):
    first = RawConn(server.socket)
    response = first.handshake("RW_OR_RO")
    assert (response.granted_lock_type, response.committed) == ("RW", False)
    build_layout(first)
    first.call(m.CommitRequest())
    second = RawConn(server.socket)
    response = second.handshake("RW_OR_RO")
    assert (response.granted_lock_type, response.committed) == ("RO", True)


def test_rw_or_ro_waits_for_the_writer_then_reads_its_commit(server):
    writer = RawConn(server.socket)
    writer.handshake("RW")
    waiter = RawConn(server.socket)
    waiter.send(m.HandshakeRequest("RW_OR_RO"))
    assert not waiter.readable(0.3), "RW_OR_RO must wait while a writer holds the lock"
    build_layout(writer)
    writer.call(m.CommitRequest())
    response, _ = waiter.recv()
    assert (response.granted_lock_type, response.committed) == ("RO", True)


def test_rw_or_ro_takes_over_when_the_writer_aborts(server):
    writer = RawConn(server.socket)
    writer.handshake("RW")
    build_layout(writer)
    waiters = [RawConn(server.socket) for _ in range(2)]
    for n, waiter in enumerate(waiters, 1):
        waiter.send(m.HandshakeRequest("RW_OR_RO"))  # queued in this order
        wait_until(lambda n=n: server.layout().waiting_readers == n, what=f"{n} waiting")
    writer.close()  # abort
    first, _ = waiters[0].recv()
    assert (first.granted_lock_type, first.committed) == ("RW", False)
    assert not waiters[1].readable(0.3), "only one of them becomes the writer"
    build_layout(waiters[0])
    waiters[0].call(m.CommitRequest())
    second, _ = waiters[1].recv()
    assert second.granted_lock_type == "RO"


def test_writer_priority_holds_new_readers_back(server):
    commit_layout(server)
    reader = RawConn(server.socket)
    reader.handshake("RO")
    writer = RawConn(server.socket)
    writer.send(m.HandshakeRequest("RW"))
    wait_until(lambda: server.layout().waiting_writers == 1, what="writer waiting")
    late_reader = RawConn(server.socket)
    late_reader.send(m.HandshakeRequest("RO"))
    assert not late_reader.readable(0.3), "no reader is admitted while a writer waits"
    assert not writer.readable(0.1)
    reader.close()
    response, _ = writer.recv()
    assert response.granted_lock_type == "RW"
    assert not late_reader.readable(0.2)
    build_layout(writer)
    writer.call(m.CommitRequest())
    response, _ = late_reader.recv()
    assert response.granted_lock_type == "RO"


def test_a_timed_out_writer_stops_blocking_readers(server):
    commit_layout(server)
    reader = RawConn(server.socket)
    reader.handshake("RO")
    writer = RawConn(server.socket)
    writer.send(m.HandshakeRequest("RW", 300))
    wait_until(lambda: server.layout().waiting_writers == 1, what="writer waiting")
    blocked = RawConn(server.socket)
    blocked.send(m.HandshakeRequest("RO"))
    response, _ = writer.recv()
    assert response.success is False
    response, _ = blocked.recv()  # the writer left the queue: the reader goes in
    assert response.granted_lock_type == "RO"


def test_lock_timeout_fails_the_handshake_and_closes(server):
    holder = RawConn(server.socket)
    holder.handshake("RW")
    started = time.monotonic()
    late = RawConn(server.socket)
    response = late.handshake("RW", timeout_ms=250)
    waited = time.monotonic() - started
    assert response.success is False and response.granted_lock_type is None
    assert 0.2 <= waited < 5
    assert late.closed_by_peer()
    timeouts = [e for e in server.events() if e.kind == "LOCK_TIMEOUT"]
    assert timeouts and timeouts[0].fields == {"layout": "weights", "lock_type": "RW", "timeout_ms": 250, "unserved": ""}
    assert server.layout().state == "RW", "the holder is untouched"


def test_a_waiter_that_hangs_up_never_gets_the_lock(server):
    commit_layout(server)
    reader = RawConn(server.socket)
    reader.handshake("RO")
    doomed = RawConn(server.socket)
    doomed.send(m.HandshakeRequest("RW"))
    wait_until(lambda: server.layout().waiting_writers == 1, what="writer waiting")
    doomed.close()
    wait_until(lambda: server.layout().waiting_writers == 0, what="dead waiter removed")
    reader.close()
    wait_until(lambda: server.layout().state == "COMMITTED", what="reader gone")
    # The dead writer was never granted, so the committed layout survived.
    assert server.layout().allocation_count == 1
    assert "RW_CONNECT" not in server.kinds()[-3:]


def test_a_dead_waiter_with_a_pipelined_request_never_gets_the_lock(server):
    """Regression (tests/reliability): a queued writer that sent a second request
    and then died was granted RW after its death, clearing the committed layout.
    Its hang-up hid behind the unread request; the kernel reports it (POLLHUP)."""
    commit_layout(server)
    reader = RawConn(server.socket)
    reader.handshake("RO")
    doomed = RawConn(server.socket)
    doomed.send(m.HandshakeRequest("RW"))
    wait_until(lambda: server.layout().waiting_writers == 1, what="writer waiting")
    doomed.send(m.GetStateHashRequest())  # read by nobody while the handshake waits
    time.sleep(0.05)
    doomed.close()
    reader.close()  # frees the lock at once: the dead writer must not be granted it
    wait_until(lambda: server.state().sessions == 0, what="both sessions closed")
    assert server.layout().state == "COMMITTED"
    assert server.layout().allocation_count == 1
    assert server.kinds().count("RW_CONNECT") == 1, "only the writer that committed"


def test_a_dead_waiter_that_sent_its_own_socket_never_gets_the_lock(server):
    """Regression (tests/reliability): a queued writer that sent its own socket's
    fd with a pipelined request and then died stayed alive in the server's eyes
    (the socket lived on, in flight in the server's receive queue), was granted
    RW and cleared the committed layout.  Waits now read requests ahead, which
    drops the fds that came with them."""
    commit_layout(server)
    reader = RawConn(server.socket)
    reader.handshake("RO")
    doomed = RawConn(server.socket)
    doomed.send(m.HandshakeRequest("RW"))
    wait_until(lambda: server.layout().waiting_writers == 1, what="writer waiting")
    own = array.array("i", [doomed.sock.fileno()])
    doomed.sock.sendmsg([encode(m.GetStateHashRequest())], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, own)])
    doomed.close()
    wait_until(lambda: server.layout().waiting_writers == 0, what="the dead writer seen as dead")
    reader.close()
    wait_until(lambda: server.state().sessions == 0, what="both sessions closed")
    assert (server.layout().state, server.layout().allocation_count) == ("COMMITTED", 1)
    assert server.kinds().count("RW_CONNECT") == 1, "only the writer that committed"


def test_pipelining_more_than_a_frame_while_waiting_drops_the_connection(start_server):
    server = start_server("--max-frame-bytes", "4KiB")
    commit_layout(server)
    reader = RawConn(server.socket)
    reader.handshake("RO")
    greedy = RawConn(server.socket)
    greedy.send(m.HandshakeRequest("RW"))
    wait_until(lambda: server.layout().waiting_writers == 1, what="writer waiting")
    for _ in range(3):
        greedy.send(m.MetadataGetRequest("k" * 2000))
    assert greedy.closed_by_peer()
    dropped = [e for e in server.events() if e.kind == "CONNECTION_DROPPED"]
    assert "pipelined while waiting for the answer to HandshakeRequest" in dropped[-1].fields["reason"]
    assert server.layout().state == "RO", "the reader is untouched"
    reader.close()


def test_commit_releases_the_lock_before_answering(server):
    writer = RawConn(server.socket)
    writer.handshake("RW")
    build_layout(writer)
    waiting = RawConn(server.socket)
    waiting.send(m.HandshakeRequest("RO"))
    wait_until(lambda: server.layout().waiting_readers == 1, what="reader waiting")
    writer.send(m.CommitRequest())
    commit, _ = writer.recv()
    assert commit.success
    # By the time the writer reads its answer, the reader was already granted.
    response, _ = waiting.recv(timeout=5)
    assert response.granted_lock_type == "RO"
    kinds = server.kinds()
    assert kinds.index("RW_COMMIT") < kinds.index("RO_CONNECT")


def test_second_handshake_on_a_connection_is_refused(server):
    conn = RawConn(server.socket)
    conn.handshake("RW")
    response = conn.call(m.HandshakeRequest("RW"))
    assert isinstance(response, m.ErrorResponse) and response.code == "STATE_VIOLATION"
    assert server.layout().state == "RW"
