"""Clients never hang or lie: deadlines on every reply, broken connections,
the server's frame cap, the hash after commit (issue 21, the client's part).

"A server that accepts but never answers" is a plain listening socket: the
kernel completes connects into its backlog and buffers what clients send,
and nothing ever answers.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest

import gms
from gms import (
    BuildLostError,
    GMSClientMemoryManager,
    GMSUsageError,
    GrantedLockType,
    RequestedLockType,
    RequestTooLargeError,
    ResponseTimeoutError,
    ServerGoneError,
)
from gms.client import admin
from gms.wire import FrameDecoder, decode, encode
from gms.wire import messages as m

from .helpers import MiB, wait_until
from .test_client import PAYLOAD, publish

SLACK_S = 5.0  # generous: a deadline is asserted as "returned", never as a speed


@pytest.fixture
def silent_socket(tmp_path):
    """A listener that never answers (nothing accepts: the backlog takes the connects)."""
    path = str(tmp_path / "silent.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    yield path
    listener.close()


class HandshakeOnly:
    """A fake server that answers handshakes (host backend) and nothing after them."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(8)
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            decoder = FrameDecoder()
            while (body := decoder.next_frame()) is None:
                decoder.feed(conn.recv(4096))
            assert isinstance(decode(body), m.HandshakeRequest)
            conn.sendall(encode(m.HandshakeResponse(True, True, "RO", "host", memory_layout_hash="h" * 64)))

    def close(self) -> None:
        self.listener.close()
        for conn in self.conns:
            conn.close()


def returns_within(seconds: float, call):
    """Run ``call``; the exception it raised (or None), checking it returned in time."""
    started = time.monotonic()
    try:
        call()
        raised = None
    except Exception as exc:  # noqa: BLE001 - returned to the test
        raised = exc
    took = time.monotonic() - started
    assert took < seconds, f"{call} took {took:.1f} s, past its deadline of {seconds} s"
    return raised


def test_probes_and_admin_verbs_give_up_on_a_server_that_never_answers(silent_socket):
    calls = [
        lambda: gms.get_runtime_state(silent_socket, timeout=0.3),
        lambda: gms.get_event_history(silent_socket, timeout=0.3),
        lambda: list(gms.client.iter_event_history(silent_socket, timeout=0.3)),
        lambda: admin.revoke(silent_socket, "weights", timeout=0.3),
        lambda: admin.evict(silent_socket, "weights", timeout=0.3),
        lambda: admin.pin(silent_socket, "weights", timeout=0.3),
    ]
    for call in calls:
        raised = returns_within(0.3 + SLACK_S, call)
        assert isinstance(raised, ResponseTimeoutError) and isinstance(raised, TimeoutError), raised
        assert "no answer" in str(raised)


def test_the_cli_has_a_timeout_and_exits_non_zero_on_it(silent_socket):
    for command in (["status"], ["history"], ["revoke", "kv"], ["evict", "kv"], ["pin", "kv"]):
        started = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "gms", *command, "--socket", silent_socket, "--timeout", "0.5"],
            capture_output=True, text=True, timeout=60,
        )
        assert out.returncode == 1, (command, out.stderr)
        assert "no answer" in out.stderr and "--timeout" in out.stderr, out.stderr
        assert time.monotonic() - started < 30, "the command waited far past its timeout"
    help_text = subprocess.run([sys.executable, "-m", "gms", "status", "--help"], capture_output=True, text=True)
    assert "--timeout" in help_text.stdout and "default 10" in help_text.stdout


def test_connect_with_a_timeout_returns_from_a_server_that_never_answers(silent_socket, server):
    mgr = GMSClientMemoryManager(silent_socket, call_timeout_s=0.5)
    raised = returns_within(0.2 + 0.5 + SLACK_S, lambda: mgr.connect(RequestedLockType.RO, timeout_ms=200))
    assert isinstance(raised, ResponseTimeoutError), raised
    assert not mgr.is_connected and mgr.granted_lock_type is None
    # Reusable: the same manager, pointed at a server that answers.
    publish(server.socket, {"t0": PAYLOAD})
    mgr.socket_path = server.socket
    mgr.connect(RequestedLockType.RO, timeout_ms=5000)
    assert mgr.granted_lock_type is GrantedLockType.RO
    mgr.close()


def test_a_call_the_server_never_answers_times_out_and_the_manager_reconnects(tmp_path):
    fake = HandshakeOnly(str(tmp_path / "fake.sock"))
    try:
        mgr = GMSClientMemoryManager(fake.path, call_timeout_s=0.3)
        mgr.connect(RequestedLockType.RO)
        raised = returns_within(0.3 + SLACK_S, mgr.metadata_list)
        assert isinstance(raised, ResponseTimeoutError), raised
        assert not mgr.is_connected, "a timed-out stream is never read again"
        with pytest.raises(GMSUsageError):
            mgr.metadata_list()  # a timeout is no server restart: nothing to ride through
        mgr.connect(RequestedLockType.RO)  # and the manager is reusable
        assert mgr.is_connected
        mgr.close()
    finally:
        fake.close()


def test_a_reader_whose_server_died_is_disconnected_and_reusable(start_server, tmp_path):
    first = start_server()
    publish(first.socket, {"t0": PAYLOAD})
    mgr = GMSClientMemoryManager(first.socket, reconnect_timeout_s=0)  # no riding through here
    mgr.connect(RequestedLockType.RO)
    va = mgr.create_mapping(mgr.metadata_get("t0")[0])
    first.kill()
    wait_until(lambda: not mgr.is_connected, what="the kernel's word that the server is gone")
    assert mgr.granted_lock_type is None
    with pytest.raises(ServerGoneError):
        mgr.metadata_list()
    assert mgr.read(va + 4096, len(PAYLOAD)) == PAYLOAD, "the mapping outlives its server"
    second = start_server(socket_path=first.socket)
    publish(second.socket, {"t0": PAYLOAD})
    mgr.unmap_all_vas()
    mgr.connect(RequestedLockType.RO)  # the same manager connects again
    mgr.remap_all_vas()
    assert mgr.read(va + 4096, len(PAYLOAD)) == PAYLOAD
    mgr.close()


def test_a_broken_pipe_leaves_a_writer_disconnected_and_reusable(start_server):
    first = start_server()
    writer = GMSClientMemoryManager(first.socket)
    writer.connect(RequestedLockType.RW)
    va = writer.create_mapping(size=2 * MiB, tag="weights")
    first.kill()
    second = start_server(socket_path=first.socket)
    with pytest.raises(BuildLostError, match="the build is gone"):
        writer.metadata_put("k", writer.mappings[0].allocation_id, 0, b"v")  # EPIPE or EOF
    assert not writer.is_connected
    writer.unmap_all_vas()
    writer.connect(RequestedLockType.RW)
    writer.reallocate_all_handles("weights")
    writer.remap_all_vas()
    writer.write(va, b"rebuilt")
    assert writer.read(va, 7) == b"rebuilt"
    assert second.layout().allocation_count == 1
    writer.close()


def test_a_request_over_the_servers_frame_cap_is_refused_before_sending(start_server):
    server = start_server("--max-frame-bytes", str(2 * MiB))
    mgr = GMSClientMemoryManager(server.socket)
    mgr.connect(RequestedLockType.RW)
    allocation_id, _ = mgr.allocate_handle(2 * MiB, "weights")
    before = server.state().last_event_seq
    with pytest.raises(RequestTooLargeError) as caught:
        mgr.metadata_put("big", allocation_id, 0, b"x" * (3 * MiB))
    assert (caught.value.limit, caught.value.size > 3 * MiB) == (2 * MiB, True)
    with pytest.raises(RequestTooLargeError):
        mgr.metadata_put("huge", allocation_id, 0, bytes(256 * MiB))  # refused at once, never sent
    assert mgr.is_connected and mgr.metadata_put("small", allocation_id, 0, b"ok")  # the session goes on
    kinds = [e.kind for e in server.events(before)]
    assert kinds == ["METADATA_PUT"], "nothing of the big requests reached the server"
    mgr.close()


def test_the_default_frame_cap_applies_before_the_handshake_names_one(silent_socket):
    with pytest.raises(RequestTooLargeError) as caught:
        gms.client.probes.one_shot(
            silent_socket, m.GetEventHistoryRequest(layout="x" * (17 * MiB)), m.GetEventHistoryResponse, 1.0
        )
    assert caught.value.limit == 16 * MiB


def test_the_hash_after_commit_needs_no_connection(server):
    writer = GMSClientMemoryManager(server.socket)
    writer.connect(RequestedLockType.RW)
    writer.create_mapping(size=MiB, tag="weights")
    assert writer.get_memory_layout_hash() == "", "no hash while a writer builds"
    writer.commit()
    assert not writer.is_connected
    committed = server.layout().memory_layout_hash
    assert committed and writer.get_memory_layout_hash() == committed
    assert GMSClientMemoryManager(server.socket).get_memory_layout_hash() == "", "none known, none kept"
    writer.connect(RequestedLockType.RO)
    assert writer.get_memory_layout_hash() == committed  # connected: the server's, by a round trip
    writer.close()


def test_memory_waits_are_not_cut_by_the_call_timeout(start_server):
    """An allocation may wait for memory as long as the server keeps trying."""
    server = start_server("--gpu-budget", str(4 * MiB))
    holder = GMSClientMemoryManager(server.socket, layout="a")
    holder.connect(RequestedLockType.RW)
    holder.allocate_handle(4 * MiB, "x")
    waiter = GMSClientMemoryManager(server.socket, layout="b", call_timeout_s=0.2)
    waiter.connect(RequestedLockType.RW)
    done = {}
    thread = threading.Thread(target=lambda: done.update(id=waiter.allocate_handle(2 * MiB, "x")))
    thread.start()
    wait_until(lambda: "ALLOCATION_OOM_WAIT" in server.kinds(), what="the allocation waiting for memory")
    time.sleep(0.5)  # past call_timeout_s
    holder.close()
    thread.join(30)
    assert "id" in done and waiter.is_connected
    waiter.close()
