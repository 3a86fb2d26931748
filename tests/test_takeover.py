"""Live take-over: ``gms serve --take-over`` replaces a running server, nothing lost, no client told.

Real processes and sockets on the host backend.  The connections handed over
are in every state a session can be in at a quiet point: holding RO (with
bytes of its next request read ahead), building RW, queued for a lock (in
order), waiting for a lock with a deadline, waiting for memory, restoring an
evicted layout half-way, connected and silent.  Each goes on on the new
server as if nothing happened.  A take-over that does not happen (the new
server refuses or dies, another device, a version it cannot read) leaves the
old server serving every one of them.  A version-1 state (the frozen
fixture) is read by a server of today, handed over by a stand-in for an old
server speaking the protocol.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import msgpack
import pytest

from gms.client.probes import get_runtime_state
from gms.handover import frames
from gms.handover.image import READABLE_VERSIONS
from gms.server.restart.takeover import abort, request_take_over
from gms.wire import FrameDecoder, decode, encode
from gms.wire import messages as m

from .handover_fixtures import ALLOCATIONS, FIXTURE
from .helpers import MiB, RawConn, ServerProcess, build_layout, connect_as, wait_until
from .test_restart import (  # noqa: F401 - the autouse fixture
    _kill_servers,
    killed,
    pattern,
    publish_raw,
    read_through,
    server_process,
    write_through,
)

AS_ROOT = os.geteuid() == 0


def take_over(old: ServerProcess, *args: str, keeper: bool = False) -> ServerProcess:
    new = server_process(old.tmp_path, "--take-over", *args, socket_path=old.socket, keeper=keeper)
    return new


class Scene:
    """A server with a connection in every state a quiet point can find one in."""

    def __init__(self, server: ServerProcess) -> None:
        path = server.socket
        self.server = server
        self.weights_hash, self.weights = publish_raw(path, "weights", (2 * MiB, 2 * MiB))
        self.cold_hash, _ = publish_raw(path, "cold", (2 * MiB,), "system")
        assert RawConn(path).call(m.EvictRequest("cold")).tier == "host"
        # Holding RO, with 7 bytes of its next request read ahead by the server.
        self.reader = RawConn(path)
        assert self.reader.handshake("RO").success
        self.next_request = encode(m.MetadataGetRequest("t1"))
        self.reader.send_raw(self.next_request[:7])
        # Building RW.
        self.builder = RawConn(path)
        assert self.builder.handshake("RW", layout="kv").success
        self.built = build_layout(self.builder, (2 * MiB,), tag="kv")
        # Queued behind the reader, in this order: a writer, then a reader.
        self.queued_writer = RawConn(path)
        self.queued_writer.send(m.HandshakeRequest("RW", None, "weights"))
        wait_until(lambda: server.layout("weights").waiting_writers == 1, what="the writer queued")
        self.queued_reader = RawConn(path)
        self.queued_reader.send(m.HandshakeRequest("RO", None, "weights"))
        wait_until(lambda: server.layout("weights").waiting_readers == 1, what="the reader queued")
        # Waiting for a lock with a deadline (RO on kv, held RW).
        self.deadline_s = 4.0
        self.impatient = RawConn(path)
        self.impatient.send(m.HandshakeRequest("RO", int(self.deadline_s * 1000), "kv"))
        self.impatient_since = time.monotonic()
        wait_until(lambda: server.layout("kv").waiting_readers == 1, what="the impatient reader queued")
        # Restoring cold half-way: GPU memory made, host copies exported, not done.
        self.restorer = RawConn(path)
        granted = self.restorer.handshake("RO", layout="cold")
        assert granted.restore
        (self.cold_allocation,) = self.restorer.call(m.ListAllocationsRequest()).allocations
        # Waiting for memory: the capacity is spent until the builder frees.
        self.hungry = RawConn(path)
        assert self.hungry.handshake("RW", layout="big").success
        self.hungry.send(m.AllocateRequest(8 * MiB, "big"))
        wait_until(lambda: any(e.kind == "ALLOCATION_OOM_WAIT" for e in server.events()), what="an OOM wait")
        # Connected, silent.
        self.silent = RawConn(path)

    def goes_on(self, server: ServerProcess) -> None:
        """Every connection carries on, on ``server``, as if nothing happened."""
        path = server.socket
        # The reader's request completes from the bytes read ahead.
        self.reader.send_raw(self.next_request[7:])
        got, _ = self.reader.recv()
        assert got == m.MetadataGetResponse(True, got.allocation_id, 1, b"meta1")
        for n, a in enumerate(sorted(self.weights, key=lambda a: a.layout_slot)):
            assert read_through(self.reader, a.allocation_id, a.aligned_size) == pattern(n, a.aligned_size)
        # The builder goes on, its ids and slots as they were.
        listed = self.builder.call(m.ListAllocationsRequest()).allocations
        assert [a.allocation_id for a in listed] == [a.allocation_id for a in self.built]
        assert self.builder.call(m.FreeAllocationRequest(self.built[0].allocation_id)).success
        # ... which lets the hungry writer's allocation through.
        allocated, _ = self.hungry.recv(timeout=20)
        assert isinstance(allocated, m.AllocateResponse) and allocated.size == 8 * MiB, allocated
        # The restore finishes.
        a = self.cold_allocation
        self.restorer.send(m.ExportHostCopiesRequest([a.allocation_id]))
        _, (host_fd,) = self.restorer.recv()
        os.close(host_fd)
        write_through(self.restorer, a.allocation_id, a.aligned_size, pattern(0, a.aligned_size))
        done = self.restorer.call(m.RestoreDoneRequest())
        assert done.memory_layout_hash == self.cold_hash
        # The deadline kept counting through the hand-over.
        timed_out, _ = self.impatient.recv(timeout=self.deadline_s + 10)
        waited = time.monotonic() - self.impatient_since
        assert timed_out.success is False and self.deadline_s - 0.1 <= waited < self.deadline_s + 3, waited
        # The queue keeps its order: the writer first once the reader leaves, then the reader.
        self.reader.close()
        granted, _ = self.queued_writer.recv(timeout=20)
        assert (granted.success, granted.granted_lock_type) == (True, "RW")
        assert not self.queued_reader.readable(0.2), "the reader still waits behind the writer"
        build_layout(self.queued_writer, (2 * MiB,))
        assert self.queued_writer.call(m.CommitRequest()).success
        granted, _ = self.queued_reader.recv(timeout=20)
        assert (granted.success, granted.granted_lock_type) == (True, "RO")
        # The silent one speaks now.
        assert self.silent.handshake("RO", layout="cold").success
        assert get_runtime_state(path).layout("cold").readers == 2


def test_a_take_over_carries_every_session_in_every_state_and_no_client_notices(tmp_path):
    old = server_process(tmp_path, "--host-capacity", "14MiB", "--no-copier")  # a client restores
    scene = Scene(old)
    last_seq = old.state().last_event_seq
    started = time.monotonic()
    new = take_over(old, "--host-capacity", "14MiB", "--no-copier")
    took = time.monotonic() - started
    assert old.proc.wait(30) == 0, "the old server exits once it has handed over"
    state = new.state()
    assert state.pid == new.pid != old.pid
    assert (state.layout("weights").memory_layout_hash, state.layout("weights").readers) == (scene.weights_hash, 1)
    assert state.layout("kv").state == "RW" and state.layout("cold").tier == "restoring"
    assert state.waiting == 3, "two queued on weights, one on kv"
    resumed = new.events(last_seq)
    assert (resumed[0].seq, resumed[0].kind, resumed[0].fields["mode"], resumed[0].fields["old_pid"]) == (
        last_seq + 1, "SERVER_RESUMED", "take-over", old.pid,
    )
    scene.goes_on(new)
    assert took < 20
    new.stop()


def test_the_sessions_of_a_take_over_that_did_not_happen_go_on_on_the_old_server(tmp_path):
    old = server_process(tmp_path, "--host-capacity", "14MiB", "--no-copier")
    scene = Scene(old)
    offer = request_take_over(old.socket, 10)  # this test is the new server, and changes its mind
    assert offer is not None and offer.image.state.layout("kv").writer is not None
    assert len(offer.conn_fds) == 8 and offer.image.queues == (("weights", (4, 5)), ("kv", (6,))) or offer.image.queues
    offer.close_fds()
    abort(offer.sock, "changed its mind")
    wait_until(lambda: "did not happen" in old.log, what="the old server resuming")
    assert old.proc.poll() is None
    scene.goes_on(old)
    # A new server that dies in the middle of it: the same.
    died = socket.socket(socket.AF_UNIX)
    died.connect(old.socket)
    died.sendall(encode(m.TakeOverRequest(list(READABLE_VERSIONS), 1)))
    decoder = FrameDecoder()
    while (body := decoder.next_frame()) is None:
        decoder.feed(died.recv(65536))
    assert isinstance(decode(body), m.TakeOverResponse)
    died.close()
    wait_until(lambda: old.log.count("did not happen") == 2, what="the second resume")
    assert old.state().layout("weights").state == "RO" and old.proc.poll() is None
    old.stop()


def test_a_take_over_by_a_server_of_another_device_is_refused_and_the_old_one_serves_on(tmp_path):
    old = server_process(tmp_path)
    layout_hash, _ = publish_raw(old.socket, "weights", (MiB,))
    reader = RawConn(old.socket)
    assert reader.handshake("RO").success
    refused = subprocess.run(
        [sys.executable, "-m", "gms", "serve", "--no-keeper", "--backend", "host", "--device", "1",
         "--socket", old.socket, "--take-over"],
        capture_output=True, text=True, timeout=60,
    )
    assert refused.returncode == 75 and "this server serves host device host-1" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr
    assert reader.call(m.MetadataGetRequest("t0")).found and old.state().pid == old.pid
    assert old.layout("weights").memory_layout_hash == layout_hash


def test_a_new_server_that_reads_no_version_the_old_one_writes_is_refused_before_any_pause(tmp_path):
    old = server_process(tmp_path)
    asked = RawConn(old.socket).call(m.TakeOverRequest([99], 1))
    assert asked.code == "STATE_VIOLATION" and "reads [99]" in asked.error
    assert "take-over by pid" in old.log and "pausing" not in old.log


@pytest.mark.skipif(not AS_ROOT, reason="needs root: a client of another uid")
def test_only_the_server_s_uid_or_root_may_take_it_over(shared_tmp):
    folder = shared_tmp
    old = server_process(folder, "--socket-mode", "666")
    stranger = connect_as(old.socket, 23999)
    refused = stranger.call(m.TakeOverRequest(list(READABLE_VERSIONS), 1))
    assert refused.code == "PERMISSION_DENIED"
    assert old.proc.poll() is None


def test_a_take_over_under_keepers_leaves_the_new_keeper_holding_the_node(tmp_path):
    old = server_process(tmp_path, keeper=True)
    layout_hash, _ = publish_raw(old.socket, "weights", (MiB,))
    reader = RawConn(old.socket)
    assert reader.handshake("RO").success
    old_server = old.server_pid()
    new = take_over(old, keeper=True)
    assert old.proc.wait(30) == 0, "the old keeper is done: its server was taken over"
    assert not os.path.exists(f"/proc/{old_server}")
    assert reader.call(m.MetadataGetRequest("t0")).found
    killed(new)  # the new server crashes: its keeper holds the node
    assert new.layout("weights").memory_layout_hash == layout_hash
    assert reader.closed_by_peer()
    assert new.stop() == 0


# -- a server speaking the protocol, handing over a state of its own making ------------------


class OldServer:
    """What an old server does in a take-over, done by hand: it hands over
    ``image`` (bytes, any version) with memfds for the fixture's allocations,
    its listening socket and one idle client's socket; then waits for the verdict."""

    def __init__(self, path: str, image: bytes) -> None:
        self.path = path
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(path)
        self.listener.listen(8)
        self.image = image
        self.memory = {}
        for layout, allocation_id, size, aligned in ALLOCATIONS:
            tiers = ["gpu"] if layout in ("weights", "kv", "warm") else []
            tiers += ["host"] if layout in ("cold", "warm") else []
            for tier in tiers:
                fd = os.memfd_create(f"old-{allocation_id}")
                os.ftruncate(fd, aligned)
                os.pwrite(fd, pattern(ALLOCATIONS.index((layout, allocation_id, size, aligned)), aligned), 0)
                self.memory[f"{tier}:{allocation_id}"] = fd
        self.client, self.clients_end = socket.socketpair()  # conn 9 of the fixture: connected, silent
        self.verdict: str | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def asked(self) -> socket.socket:
        """The connection that asks for a take-over (probes meanwhile go unanswered)."""
        while True:
            conn, _ = self.listener.accept()
            decoder = FrameDecoder()
            while (body := decoder.next_frame()) is None:
                decoder.feed(conn.recv(65536))
            if isinstance(decode(body), m.TakeOverRequest):
                return conn
            conn.close()

    def _serve(self) -> None:
        conn = self.asked()
        conn.sendall(encode(m.TakeOverResponse(1, 4242)))
        frames.send_frame(conn, "image", {"image": self.image})
        keyed = [*self.memory.items(), ("listener", self.handed_listener()), ("conn:9", self.clients_end.fileno())]
        frames.send_fds(conn, "fds", keyed)
        frames.send_frame(conn, "end")
        frame = frames.recv_frame(conn, frames.FrameReader())
        self.verdict = f"{frame.kind}: {frame.body.get('reason', '')}"
        if frame.kind == "commit":
            frames.send_frame(conn, "bye")
        conn.close()

    def handed_listener(self) -> int:
        return self.listener.fileno()

    def close(self) -> None:
        for fd in self.memory.values():
            os.close(fd)
        self.listener.close()
        self.client.close()
        self.clients_end.close()


def test_a_server_of_today_takes_over_from_a_version_1_state(tmp_path):
    path = str(tmp_path / "old.sock")
    old = OldServer(path, FIXTURE.read_bytes())
    try:
        new = server_process(tmp_path, "--take-over", socket_path=path)
        old.thread.join(10)
        assert old.verdict == "commit: "
        state = new.state()
        rows = {row.name: row for row in state.layouts}
        # The fixture's sessions came without their sockets: gone, as after a crash
        # (conn 9, connected and silent, came with its socket: below).
        assert sorted(rows) == ["cold", "warm", "weights"] and state.sessions == 0
        assert (rows["weights"].state, rows["warm"].tier, rows["cold"].tier) == ("COMMITTED", "host", "host")
        resumed = next(e for e in new.events() if e.kind == "SERVER_RESUMED")
        assert (resumed.fields["state_version"], resumed.fields["old_pid"], resumed.fields["mode"]) == (
            1, os.getpid(), "take-over",  # the old server as the kernel names it (here: this process), not as it says
        )
        reader = RawConn(path)
        assert reader.handshake("RO").success
        for allocation_id, slot in (("w0", 0), ("w1", 1)):
            aligned = next(a[3] for a in ALLOCATIONS if a[1] == allocation_id)
            assert read_through(reader, allocation_id, aligned) == pattern(slot, aligned)
        assert reader.call(m.MetadataGetRequest("w1.t")).value == b"meta-w1"
        silent = RawConn.from_socket(old.client)  # conn 9 goes on, on the new server, without its session:
        assert silent.call(m.MetadataGetRequest("w1.t")).code == "NOT_CONNECTED"  # "send HandshakeRequest first"
        assert silent.handshake("RO").success  # ... which it may, on the connection it has
        assert silent.call(m.MetadataGetRequest("w1.t")).value == b"meta-w1"
        refused = silent.handshake("RO", layout="cold")  # one session a connection: the rules refuse a second
        assert (refused.code, refused.error) == ("STATE_VIOLATION", "this connection has already handshaken")
        new.stop()
    finally:
        old.close()


def test_a_state_version_this_server_cannot_read_is_refused_and_the_old_one_serves_on(tmp_path):
    path = str(tmp_path / "old.sock")
    future = max(READABLE_VERSIONS) + 1
    newer = msgpack.packb([b"gms-state", future, b"a future server's state"], use_bin_type=True)
    old = OldServer(path, newer)
    try:
        refused = subprocess.run(
            [sys.executable, "-m", "gms", "serve", "--no-keeper", "--backend", "host", "--socket", path,
             "--take-over"],
            capture_output=True, text=True, timeout=60,
        )
        old.thread.join(10)
        assert refused.returncode == 75
        readable = ", ".join(map(str, READABLE_VERSIONS))
        assert f"hand-over format version {future}; this server reads version(s) {readable}" in refused.stderr, (
            refused.stderr
        )
        assert old.verdict.startswith("abort: ") and f"version {future}" in old.verdict
    finally:
        old.close()


def test_a_take_over_refused_after_the_new_keeper_took_the_node_leaves_it_nothing(tmp_path):
    """The old server answers the commit with an abort (it serves on): the new
    server's keeper has been given the node provisionally, and must let it go."""
    path = str(tmp_path / "old.sock")

    class Fickle(OldServer):
        def _serve(self) -> None:
            conn = self.asked()
            conn.sendall(encode(m.TakeOverResponse(1, 4242)))
            frames.send_frame(conn, "image", {"image": self.image})
            keyed = [*self.memory.items(), ("listener", self.listener.fileno())]
            frames.send_fds(conn, "fds", keyed)
            frames.send_frame(conn, "end")
            frame = frames.recv_frame(conn, frames.FrameReader())
            self.verdict = frame.kind
            frames.send_frame(conn, "abort", {"reason": "changed its mind"})
            conn.close()

    old = Fickle(path, FIXTURE.read_bytes())
    try:
        new = subprocess.run(
            [sys.executable, "-m", "gms", "serve", "--backend", "host", "--socket", path, "--take-over"],
            capture_output=True, text=True, timeout=60,
        )
        assert old.verdict == "commit"
        assert new.returncode == 75, new.stderr  # the keeper: the old server serves on
        assert "the old server serves on" in new.stderr
    finally:
        old.close()


# -- issue 21's admission and issue 23's copier, through a take-over -----------------------------


def test_host_copies_in_chunks_go_to_the_new_server_and_its_keeper_and_restore_there(tmp_path):
    """Copies the old server's copier filled in chunks travel with the take-over
    (each chunk named by its place in its copy): the new server, with another
    chunk size, holds them whole, hands them to its keeper, and restores
    through its own copier; after a crash its keeper's next server does too."""
    from .test_copier import copier_running, publish, read
    from .test_restart import _memfds

    sizes = (6 * MiB, 3 * MiB)  # 4 + 2 MiB (a pool chunk, an exact one); 4 MiB (one pool chunk)
    old = server_process(tmp_path, "--host-pool", "8MiB", "--host-chunk", "4MiB")
    wait_until(lambda: old.state().host_pool_bytes == 8 * MiB, timeout=30, what="the pool")
    wait_until(lambda: copier_running(old), timeout=60, what="the copier")
    layout_hash = publish(old, "m", sizes)
    new = take_over(old, "--host-pool", "4MiB", "--host-chunk", "2MiB", keeper=True)
    assert old.proc.wait(30) == 0
    state = new.state()
    assert (state.host_handle_count, state.host_used_bytes) == (2, 10 * MiB)
    wait_until(lambda: len(_memfds(new.pid)) == 5, what="the new keeper holding 2 allocations and 3 chunks")
    assert RawConn(new.socket).call(m.EvictRequest("m")).tier == "host"
    wait_until(lambda: copier_running(new), timeout=60, what="the new server's copier")
    granted = RawConn(new.socket).handshake("RO", layout="m")
    assert (granted.success, granted.restore) == (True, False), "restored by the new server's copier"
    read(new, "m", sizes)
    assert RawConn(new.socket).call(m.EvictRequest("m")).tier == "host"
    killed(new)
    wait_until(lambda: copier_running(new), timeout=60, what="the restarted server's copier")
    granted = RawConn(new.socket).handshake("RO", layout="m")
    assert (granted.success, granted.restore, granted.memory_layout_hash) == (True, False, layout_hash)
    read(new, "m", sizes)
    assert new.stop() == 0


@pytest.mark.skipif(not AS_ROOT, reason="needs root: clients of another uid")
def test_handed_connections_count_against_their_uid_s_cap_on_the_new_server(shared_tmp):
    """Admission (issue 21) on the new server: the handed connections are counted
    in, never refused, and hold their uid to its cap like any others."""
    folder = shared_tmp
    args = ("--socket-mode", "666", "--max-connections-per-uid", "2")
    old = server_process(folder, *args)
    publish_raw(old.socket, "weights", (MiB,))
    held = [connect_as(old.socket, 23999) for _ in range(2)]
    for conn in held:
        assert conn.handshake("RO").success
    new = take_over(old, *args)
    assert old.proc.wait(30) == 0
    refused, _ = connect_as(new.socket, 23999).recv()  # answered at accept, before any request
    assert (refused.code, refused.limit, refused.used) == ("LIMIT_EXCEEDED", "max_connections_per_uid", 2), refused
    assert held[0].call(m.MetadataGetRequest("t0")).found, "the handed ones go on"
    held[0].close()
    wait_until(lambda: new.state().sessions == 1, what="the handed connection's end")
    assert connect_as(new.socket, 23999).call(m.GetRuntimeStateRequest()).sessions == 1, "room again"
    new.stop()


# -- all or nothing: fds (issue 59) ------------------------------------------------------------


def _nofile(limit: int):
    def set_limit():
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    return set_limit


def _allocate(path: str, count: int) -> None:
    from gms import GMSClientMemoryManager, RequestedLockType

    writer = GMSClientMemoryManager(path, layout="many")
    writer.connect(RequestedLockType.RW)
    for _ in range(count):
        writer.allocate_handle(4096, tag="t")
    writer.commit()


def test_a_take_over_short_of_fds_is_refused_before_anything_is_taken(tmp_path):
    """Once, a new server that ran out of fds mid-hand-over died, and its keeper's
    next server served an empty node on the old server's own listener: two servers
    on one socket.  Now the new server sees it cannot take the node whole before it
    takes anything, says why, and the old server serves on alone."""
    old = server_process(tmp_path, keeper=True)
    _allocate(old.socket, 3000)
    old_pid = old.server_pid()
    new = subprocess.run(
        [sys.executable, "-m", "gms", "serve", "--backend", "host", "--socket", old.socket, "--take-over",
         "--log-level", "warning"],
        capture_output=True, text=True, timeout=120, preexec_fn=_nofile(3000),
    )
    assert new.returncode == 75, new.stderr  # its keeper: the take-over did not happen
    assert "the hand-over carries 3001 fds" in new.stderr and "ulimit -n" in new.stderr, new.stderr
    states = [get_runtime_state(old.socket) for _ in range(10)]
    assert {s.pid for s in states} == {old_pid}, "one server answers on the socket"
    assert states[-1].layout("many").allocation_count == 3000 and states[-1].layout("many").committed


def test_a_node_of_ten_thousand_allocations_is_taken_over_under_the_machine_s_limits(tmp_path):
    """Under keepers (the default), as users run it; the new server raises its soft
    limit to the hard one and needs the allocations' fds and one frame's more."""
    import resource

    from gms.system.fds import handover_need

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < handover_need(10_001) + 256:
        pytest.skip("this machine's hard open-files limit is below what 10,000 allocations need")
    old = server_process(tmp_path, keeper=True)
    _allocate(old.socket, 10_000)
    old_pid = old.server_pid()
    new = take_over(old, keeper=True)
    assert old.proc.wait(60) == 0, "the old keeper is done: its server was taken over"
    states = [get_runtime_state(new.socket) for _ in range(10)]
    assert len({s.pid for s in states}) == 1 and states[0].pid != old_pid
    assert states[-1].layout("many").allocation_count == 10_000


def test_a_writer_putting_all_along_a_pre_copied_take_over_loses_no_answered_put(tmp_path):
    """Issue 59: the node is sent while the old server serves on; the pause then
    carries only the events since.  A writer putting metadata before, during and
    after the take-over finds every put it was answered for on the new server."""
    import re

    old = server_process(tmp_path, "--log-level", "info")  # (its line names the base's event)
    writer = RawConn(old.socket)
    assert writer.handshake("RW", layout="kv").success
    (allocation,) = build_layout(writer, (2 * MiB,))
    answered: list[str] = []
    stop = threading.Event()

    def put() -> None:
        while not stop.is_set():
            key = f"k{len(answered)}"
            assert writer.call(m.MetadataPutRequest(key, allocation.allocation_id, 0, b"v")).success
            answered.append(key)

    thread = threading.Thread(target=put)
    thread.start()
    try:
        wait_until(lambda: len(answered) > 50, what="puts before")
        new = take_over(old)
        assert old.proc.wait(30) == 0
        after = len(answered)
        wait_until(lambda: len(answered) > after + 50, what="puts on the new server")
    finally:
        stop.set()
        thread.join(30)
    assert set(answered) <= set(writer.call(m.MetadataListRequest()).keys)
    base = int(re.search(r"sending the node as of event (\d+)", old.log).group(1))
    resumed = next(e for e in new.events() if e.kind == "SERVER_RESUMED")
    assert resumed.seq - 1 > base, "events came after the base, carried by the tail"
    writer.close()
    new.stop()


@pytest.mark.parametrize("retain", [None, 16])
def test_a_tail_is_the_events_since_the_base_or_the_whole_image_where_the_log_dropped_some(retain):
    """The old server's tail, and the node the new one makes of it, in process."""
    from gms.fsm.events import MetadataPut
    from gms.handover.image import STATE_VERSION, ServerInfo, StateImage
    from gms.server.restart.takeover import handed_image, tail_body
    from gms.store import EventLog

    from .fsm_events import started
    from .fsm_events import writer as writing

    log = EventLog(retain=retain, chunk_size=4)
    for event in [started(), *writing(1, "kv")]:
        log.append(event)
    server = ServerInfo(pid=1, backend="host", device=0, device_uuid="host-0", host_tier=True)

    def image() -> StateImage:
        return StateImage(STATE_VERSION, server, log.last_seq, 2, log.state, (), ())

    base = image()
    from gms.fsm.events import AllocationCreated

    log.append(AllocationCreated(1, "a0", MiB, MiB, "kv", 0, layout="kv"))
    for n in range(40):
        log.append(MetadataPut(1, f"k{n}", "a0", 0, b"v", layout="kv"))
    body = tail_body(log, base, image(), fds=3)
    assert ("entries" in body) == (retain is None), "the events since, unless the log dropped some"
    handed = handed_image(base, body)
    assert handed.state == log.state and handed.last_seq == log.last_seq
