"""Clients ride through a server restart (issue 22, the client's part).

A server is SIGKILLed and a new one started on the same socket; the keeper
that will bring a restarted server back with every committed layout is not
here yet, so the tests republish the layout themselves (the same structure
has the same hash, whatever its ids and bytes).  Also the server's side of
it on the wire: ``expect_hash`` and the ``SessionEnded`` notice.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from gms import (
    BuildLostError,
    GMSClientMemoryManager,
    GMSUsageError,
    GrantedLockType,
    LockRevokedError,
    LockTimeoutError,
    RequestedLockType,
    ServerGoneError,
    StaleMemoryLayoutError,
)
from gms.client import admin
from gms.wire import messages as m

from .helpers import MiB, RawConn, wait_until
from .test_client import PAYLOAD, publish

SLACK_S = 10.0  # generous: deadlines are asserted as bounds, never speeds


def mapped_reader(socket_path: str, **options) -> tuple[GMSClientMemoryManager, int]:
    """A reader holding RO with "t0" mapped; returns it and the address of its bytes."""
    mgr = GMSClientMemoryManager(socket_path, **options)
    mgr.connect(RequestedLockType.RO)
    allocation_id, offset, _ = mgr.metadata_get("t0")
    return mgr, mgr.create_mapping(allocation_id) + offset


def restart(start_server, dead, *tensors: dict[str, bytes]):
    """SIGKILL ``dead``; a new server on its socket, with ``tensors`` published."""
    dead.kill()
    server = start_server(socket_path=dead.socket)
    for layout in tensors:
        publish(server.socket, layout)
    return server


# -- the server's side, on the wire -------------------------------------------


def test_expect_hash_grants_only_that_committed_layout_and_never_waits(server):
    empty = RawConn(server.socket)
    refused = empty.call(m.HandshakeRequest("RO", layout="weights", expect_hash="a" * 64))
    assert isinstance(refused, m.ErrorResponse) and refused.code == "STALE_LAYOUT", refused
    layout_hash, _ = publish(server.socket, {"t0": PAYLOAD})
    other = RawConn(server.socket).call(m.HandshakeRequest("RO", expect_hash="b" * 64))
    assert other.code == "STALE_LAYOUT" and layout_hash[:12] in other.error
    writer = RawConn(server.socket).call(m.HandshakeRequest("RW", expect_hash=layout_hash))
    assert writer.code == "INVALID_ARGUMENT", "expect_hash is for readers"
    for lock in ("RO", "RW_OR_RO"):
        granted = RawConn(server.socket).call(m.HandshakeRequest(lock, expect_hash=layout_hash))
        assert (granted.success, granted.granted_lock_type, granted.memory_layout_hash) == (True, "RO", layout_hash)
    assert empty.handshake("RO").success, "a refused handshake leaves the connection usable"


def test_a_revoked_session_gets_the_notice_before_its_connection_closes(server):
    publish(server.socket, {"t0": PAYLOAD})
    reader = RawConn(server.socket)
    assert reader.handshake("RO").success
    assert admin.revoke(server.socket, "weights") == 1
    notice, _ = reader.recv()
    assert notice == m.SessionEnded("revoked")
    assert reader.closed_by_peer()


# -- riding through ---------------------------------------------------------------


def test_a_reader_rides_through_a_restart_with_its_mappings_intact(start_server):
    first = start_server()
    layout_hash, _ = publish(first.socket, {"t0": PAYLOAD})
    mgr, va = mapped_reader(first.socket)
    second = restart(start_server, first, {"t0": PAYLOAD[::-1]})  # same structure, new ids and bytes
    assert second.layout().memory_layout_hash == layout_hash
    assert not mgr.is_connected
    assert mgr.read(va, len(PAYLOAD)) == PAYLOAD, "the mapping kept its memory while the server was gone"
    assert mgr.metadata_get("t0") is not None  # the next call rides through
    assert (mgr.is_connected, mgr.granted_lock_type, mgr.reconnects) == (True, GrantedLockType.RO, 1)
    assert second.layout().readers == 1
    assert mgr.read(va, len(PAYLOAD)) == PAYLOAD, "riding through touches no mapping"
    mgr.unmap_all_vas()
    mgr.remap_all_vas()  # the new server's allocations (new ids) at the same address
    assert mgr.read(va, len(PAYLOAD)) == PAYLOAD[::-1]
    mgr.close()


def test_a_call_made_while_the_server_is_down_waits_for_it(start_server, tmp_path):
    first = start_server()
    publish(first.socket, {"t0": PAYLOAD})
    mgr, va = mapped_reader(first.socket)
    first.kill()

    def come_back() -> None:
        # A server that serves the layout from its first answer (as a restarted
        # one will): prepared on a socket of its own, then moved into place.
        time.sleep(0.5)
        server = start_server(socket_path=str(tmp_path / "next.sock"))
        publish(server.socket, {"t0": PAYLOAD})
        os.rename(server.socket, first.socket)

    thread = threading.Thread(target=come_back)
    thread.start()
    try:
        assert mgr.metadata_list() == ["t0"]  # blocks, retrying with backoff, until a server answers
    finally:
        thread.join()
    assert mgr.reconnects == 1 and mgr.read(va, len(PAYLOAD)) == PAYLOAD
    mgr.close()


def test_another_structure_after_the_restart_is_stale(start_server):
    first = start_server()
    publish(first.socket, {"t0": PAYLOAD})
    mgr, va = mapped_reader(first.socket)
    second = restart(start_server, first, {"t0": PAYLOAD, "extra": b"x"})
    with pytest.raises(StaleMemoryLayoutError):
        mgr.metadata_list()
    assert not mgr.is_connected and second.layout().readers == 0
    assert mgr.read(va, len(PAYLOAD)) == PAYLOAD, "the old memory stays mapped until the caller lets it go"
    with pytest.raises(GMSUsageError):
        mgr.metadata_list()  # nothing left to take back
    mgr.close()


def test_a_restarted_empty_server_is_stale_at_once(start_server):
    first = start_server()
    publish(first.socket, {"t0": PAYLOAD})
    mgr, _ = mapped_reader(first.socket)
    restart(start_server, first)
    started = time.monotonic()
    with pytest.raises(StaleMemoryLayoutError):
        mgr.ensure_connected()
    assert time.monotonic() - started < SLACK_S, "no wait for a commit that may never come"
    mgr.close()


def test_no_server_coming_back_is_a_typed_error_after_the_deadline(start_server):
    first = start_server()
    publish(first.socket, {"t0": PAYLOAD})
    mgr, va = mapped_reader(first.socket, reconnect_timeout_s=0.5)
    first.kill()
    started = time.monotonic()
    with pytest.raises(ServerGoneError, match="within 0.5 s"):
        mgr.metadata_list()
    assert 0.5 <= time.monotonic() - started < 0.5 + SLACK_S
    assert mgr.read(va, len(PAYLOAD)) == PAYLOAD
    # Still a reader whose server went away: a later call tries again.
    second = start_server(socket_path=first.socket)
    publish(second.socket, {"t0": PAYLOAD})
    assert mgr.ensure_connected() is True and mgr.ensure_connected() is False
    mgr.close()


def test_riding_through_can_be_turned_off(start_server):
    first = start_server()
    publish(first.socket, {"t0": PAYLOAD})
    mgr, _ = mapped_reader(first.socket, reconnect_timeout_s=0)
    second = restart(start_server, first, {"t0": PAYLOAD})
    with pytest.raises(ServerGoneError, match="off"):
        mgr.metadata_list()
    mgr.unmap_all_vas()
    mgr.connect(RequestedLockType.RO)
    mgr.remap_all_vas()
    assert second.layout().readers == 1
    mgr.close()


def test_a_writer_mid_build_learns_its_build_is_gone(start_server):
    first = start_server()
    writer = GMSClientMemoryManager(first.socket)
    writer.connect(RequestedLockType.RW)
    writer.create_mapping(size=MiB, tag="weights")
    second = restart(start_server, first)
    wait_until(lambda: not writer.is_connected, what="the broken connection seen")
    with pytest.raises(BuildLostError):
        writer.ensure_connected()
    with pytest.raises(BuildLostError):
        writer.allocate_handle(MiB, "weights")  # every call says so, until connect()
    assert second.layout().state == "EMPTY", "no reconnect: a build is never taken back"
    writer.connect(RequestedLockType.RW)
    assert writer.granted_lock_type is GrantedLockType.RW
    writer.close()


def test_a_revoked_reader_never_reconnects(server):
    publish(server.socket, {"t0": PAYLOAD})
    mgr, va = mapped_reader(server.socket)
    assert admin.revoke(server.socket, "weights") == 1
    wait_until(lambda: not mgr.is_connected, what="the revoke seen")
    before = server.state().last_event_seq
    for _ in range(2):
        with pytest.raises(LockRevokedError):
            mgr.metadata_list()
    with pytest.raises(LockRevokedError):
        mgr.ensure_connected()
    assert not {"RO_CONNECT", "READER_JOINED"} & set(server.kinds(before)) and server.layout().readers == 0
    assert mgr.read(va, len(PAYLOAD)) == PAYLOAD
    mgr.unmap_all_vas()
    mgr.connect(RequestedLockType.RO)  # the caller may come back on purpose
    mgr.remap_all_vas()
    mgr.close()


def test_a_revoke_during_a_call_reaches_the_caller_as_revoked(start_server):
    """The notice arrives in place of a response: a writer waiting for memory is revoked."""
    server = start_server("--gpu-budget", str(4 * MiB))
    mgr = GMSClientMemoryManager(server.socket, layout="kv")
    mgr.connect(RequestedLockType.RW)
    hog = RawConn(server.socket)  # holds the whole budget, so the next allocation waits
    assert hog.handshake("RW", layout="hog").success
    assert isinstance(hog.call(m.AllocateRequest(4 * MiB, "x")), m.AllocateResponse)
    raised = []
    thread = threading.Thread(target=lambda: _catch(raised, mgr.allocate_handle, 2 * MiB, "kv"))
    thread.start()
    wait_until(lambda: "ALLOCATION_OOM_WAIT" in server.kinds(), what="the allocation waiting")
    assert admin.revoke(server.socket, "kv") == 1
    thread.join(30)
    assert len(raised) == 1 and isinstance(raised[0], LockRevokedError), raised
    assert not mgr.is_connected
    mgr.close()


def _catch(out: list, fn, *args) -> None:
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - handed to the test
        out.append(exc)


def test_the_wake_of_a_sleeping_reader_finds_its_layout_or_says_stale(start_server):
    """The seed's wake after a restart: the same layout wakes; on an empty server
    the wake waits for a commit (LockTimeoutError with a timeout), and
    remap_all_vas says stale when the commit is another layout."""
    first = start_server()
    publish(first.socket, {"t0": PAYLOAD})
    mgr, va = mapped_reader(first.socket)
    mgr.unmap_all_vas()
    mgr.abort()  # asleep
    second = restart(start_server, first, {"t0": PAYLOAD})
    mgr.connect(RequestedLockType.RO)
    mgr.remap_all_vas()
    assert mgr.read(va, len(PAYLOAD)) == PAYLOAD
    mgr.unmap_all_vas()
    mgr.abort()
    third = restart(start_server, second)
    with pytest.raises(LockTimeoutError):
        mgr.connect(RequestedLockType.RO, timeout_ms=200)
    publish(third.socket, {"other": PAYLOAD * 3})
    mgr.connect(RequestedLockType.RO)
    with pytest.raises(StaleMemoryLayoutError):
        mgr.remap_all_vas()
    mgr.close()
