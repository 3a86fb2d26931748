"""Restart and take-over that never lose, roll back or hand a node to a stranger (issue 32).

Each test is one way the keeper and the take-over lost, rolled back or gave
away every layout, reproduced with the server as shipped (keeper on, the
host backend, real processes and sockets), and what happens now:

* a policy the node does not fit (a quota lowered under what a tenant holds):
  the next server applies it, after a crash and in a take-over: the tenant
  keeps and serves what it holds, cannot grow until it is under the quota,
  and `gms status` says so; no other tenant notices (issue 48);
* a keeper that reads nothing for seconds (SIGSTOP): nothing waits on it but
  the answers that tell of a lasting change; a reader goes on; when it reads
  again it catches up, and a crash after brings back the node as it is, not
  as it was before the stall;
* SIGKILLs of the server and of two successors early in their start-up;
  a ready file that cannot be written: nothing lost, nothing discarded;
* a journal that cannot be resumed nor saved (its folder unwritable): kept;
* a keeper that dies: the server starts another, which keeps the node;
* a memory wait under a keeper is woken when the keeper lets the memory go;
* a server that accepts and never answers: ``connect()`` gives up;
* the seed's wake: ``remap_all_vas``, not ``connect``, says the layout changed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from gms import (
    GMSClientMemoryManager,
    RequestedLockType,
    ResponseTimeoutError,
    StaleMemoryLayoutError,
)
from gms.errors import LockTimeoutError
from gms.handover.words import Leaving, Say
from gms.wire import messages as m

from .helpers import MiB, RawConn, build_layout, descendants, kill_tree, state_or_none, wait_until
from .test_restart import _kill_servers, kept, killed, listing, pattern, publish_raw, read_through  # noqa: F401

AS_ROOT = os.geteuid() == 0
POLICY = """
[[tenant]]
name = "team"
uids = [{uid}]
quota = "{quota}"
write = ["*"]
"""


def policy(tmp_path, quota: str):
    path = tmp_path / "policy.toml"
    path.write_text(POLICY.format(uid=os.getuid(), quota=quota))
    return path


def server_pids(server) -> list[int]:
    """The keeper's children (its servers), as the kernel lists them."""
    return [pid for pid in descendants(server.pid) if _cmdline(pid).count("serve")]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


# -- a configuration the node does not fit ------------------------------------------------------------


def _over_quota_then_under(socket_path: str, allocations, quota: int) -> None:
    """The tenant over its lowered quota keeps and serves what it holds, cannot grow,
    and grows again once under it."""
    from gms.cli.inspect import status_table
    from gms.client.probes import get_runtime_state

    state = get_runtime_state(socket_path)
    team = state.tenant("team")
    assert (team.used_bytes, team.quota_bytes) == (16 * MiB, quota)
    assert "quota (cannot grow)" in status_table(socket_path, state).splitlines()[-1]
    reader = RawConn(socket_path)
    assert reader.handshake("RO").success
    for n, a in enumerate(allocations):  # what it holds is served
        assert read_through(reader, a.allocation_id, a.aligned_size) == pattern(n, a.aligned_size)
    reader.close()
    grower = RawConn(socket_path)
    assert grower.handshake("RW", layout="more").success
    refused = grower.call(m.AllocateRequest(MiB, "w"))
    assert refused.code == "QUOTA_EXCEEDED", refused
    grower.close()
    rebuild = RawConn(socket_path)  # a writer's grant clears the layout: the tenant is under its quota
    assert rebuild.handshake("RW").success
    assert isinstance(rebuild.call(m.AllocateRequest(quota, "w")), m.AllocateResponse)
    assert get_runtime_state(socket_path).tenant("team").used_bytes == quota
    rebuild.close()


def test_a_policy_the_node_does_not_fit_is_applied_and_holds_the_tenant_where_it_is(tmp_path):
    """Was (issue 32): the next server exited 70 and released every layout.  Was (issue 48):
    it refused the node (exit 78, retried with back-off) and nothing was served, to any
    tenant, until the operator changed the policy back.  Now the policy is applied."""
    import re
    import urllib.request

    path = policy(tmp_path, "64MiB")
    server = kept(tmp_path, "--policy", str(path), "--metrics-port", "0", "--log-level", "info")
    layout_hash, allocations = publish_raw(server.socket, "weights", (8 * MiB, 8 * MiB))
    path.write_text(POLICY.format(uid=os.getuid(), quota="4MiB"))  # lowered under what the team holds
    before = len(server.log)
    killed(server)  # the next server (the spare, which reads the policy again) serves at once
    assert server.layout("weights").memory_layout_hash == layout_hash
    port = wait_until(lambda: re.findall(r"metrics on http://[^:]+:(\d+)/", server.log[before:]),
                      what="the new server's metrics port")[-1]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'gms_tenant_over_bound{bound="quota",tenant="team"} 1.0' in text
    _over_quota_then_under(server.socket, allocations, 4 * MiB)
    assert server.proc.poll() is None


def test_a_take_over_with_a_policy_the_node_does_not_fit_applies_it(tmp_path):
    """Was: refused with 75 (issue 32's fix for an exit 70 that unlinked the live socket)."""
    path = policy(tmp_path, "64MiB")
    old = kept(tmp_path, "--policy", str(path))
    layout_hash, allocations = publish_raw(old.socket, "weights", (8 * MiB, 8 * MiB))
    tight = tmp_path / "tight.toml"
    tight.write_text(POLICY.format(uid=os.getuid(), quota="4MiB"))
    log = open(tmp_path / "new.log", "wb")
    new = subprocess.Popen(
        [sys.executable, "-m", "gms", "serve", "--backend", "host", "--socket", old.socket, "--take-over",
         "--no-keeper", "--policy", str(tight)], stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        assert old.proc.wait(30) == 0  # taken over: its keeper retires
        wait_until(lambda: (s := state_or_none(old.socket)) and s.pid == new.pid, timeout=30, what="the new server")
        assert old.layout("weights").memory_layout_hash == layout_hash
        _over_quota_then_under(old.socket, allocations, 4 * MiB)
    finally:
        new.kill()
        new.wait()
        log.close()


# -- a keeper that stalls ----------------------------------------------------------------------


def test_a_stopped_keeper_holds_up_only_lasting_answers_and_a_crash_after_it_rolls_nothing_back(tmp_path):
    """Was: every client froze ~4 s, the server took the keeper for gone and never
    reattached, and the next crash brought the node back as before the stall."""
    server = kept(tmp_path)
    first_hash, _ = publish_raw(server.socket, "weights", (2 * MiB,))
    publish_raw(server.socket, "other", (MiB,))
    keeper = server.pid
    os.kill(keeper, signal.SIGSTOP)
    try:
        # Writes pile up past the keeper's socket buffer: the writer's own requests
        # are answered (a writer building loses its build in a crash anyway), its
        # commit waits for the keeper.
        writer = RawConn(server.socket)
        assert writer.handshake("RW", layout="weights").success  # clears the committed layout
        allocation = writer.call(m.AllocateRequest(2 * MiB, "w"))
        for n in range(192):
            value = bytes([n]) * (32 << 10)
            assert writer.call(m.MetadataPutRequest(f"k{n}", allocation.allocation_id, 0, value), 5).success
        writer.send(m.CommitRequest())
        assert not writer.readable(3.0), "the commit is not answered before the keeper has it"
        state = server.state()
        assert state.keeper == "behind" and state.keeper_backlog_bytes > 0 and state.keeper_behind_s > 1
        # A reader of another layout is not held up meanwhile.
        started = time.monotonic()
        reader = RawConn(server.socket)
        assert reader.handshake("RO", layout="other").success
        reader.close()
        assert time.monotonic() - started < 1.0
    finally:
        os.kill(keeper, signal.SIGCONT)
    committed, _ = writer.recv(timeout=30)
    assert committed.success
    wait_until(lambda: server.state().keeper == "attached", what="the keeper caught up")
    assert "the keeper went away" not in server.log
    killed(server)
    after = server.layout("weights")
    assert after.memory_layout_hash == committed.memory_layout_hash != first_hash, "not rolled back"
    reader = RawConn(server.socket)
    assert reader.handshake("RO").success
    assert reader.call(m.MetadataGetRequest("k191")).value == bytes([191]) * (32 << 10)


# -- kills early in start-up, a full disk --------------------------------------------------------


def test_three_kills_in_a_row_early_in_start_up_lose_nothing(tmp_path):
    """Was: the server, then two successors early in start-up, SIGKILLed within 0.8 s:
    the keeper took it for a crash loop and discarded a good journal."""
    server = kept(tmp_path)
    layout_hash, _ = publish_raw(server.socket, "weights", (4 * MiB,))
    killed_pids = {server.server_pid()}
    os.kill(server.server_pid(), signal.SIGKILL)
    for _ in range(2):  # each successor as soon as it exists
        pid = wait_until(lambda: next((p for p in server_pids(server) if p not in killed_pids), None),
                         timeout=30, interval=0.001, what="the next server")
        os.kill(pid, signal.SIGKILL)
        killed_pids.add(pid)
    state = wait_until(lambda: state_or_none(server.socket), timeout=60, what="a server again")
    assert state.pid not in killed_pids
    assert state.layout("weights").memory_layout_hash == layout_hash
    assert "starts EMPTY" not in server.log and "discard" not in server.log.lower()


def test_a_ready_file_that_cannot_be_written_costs_nothing(tmp_path):
    """Was: a full disk under --ready-dir made the resumed server's clean-up release every layout."""
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")  # a file where the folder should be: every write there fails
    server = kept(tmp_path, "--ready-dir", str(blocked / "ready"))
    layout_hash, _ = publish_raw(server.socket, "weights", (4 * MiB,))
    killed(server)
    assert server.layout("weights").memory_layout_hash == layout_hash
    assert "the ready file" in server.log


def test_a_journal_that_cannot_be_resumed_nor_saved_is_kept(tmp_path):
    """Was: a full disk under --state-dir at resume lost the node (the server exited 1
    and its keeper, taking it for a bad option, closed every fd).  The journal here
    does not rebuild and cannot be saved: the server refuses it, and its keeper
    (this test, standing in) still holds every fd and the journal."""
    from gms.fsm.events import RoConnect
    from gms.handover import frames
    from gms.handover.image import (
        STATE_VERSION,
        ServerInfo,
        StateImage,
        encode_entries,
        encode_image,
    )
    from gms.keeper.store import Store
    from gms.store import LogEntry

    from .handover_fixtures import rich_log

    log = rich_log()
    base = encode_image(StateImage(STATE_VERSION, ServerInfo(1, "host", 0, "host-0", True), log.last_seq, 20,
                                   log.state))
    bad = encode_entries([LogEntry(log.last_seq + 1, 0, 0, RoConnect(8, layout="nothing"))])
    store = Store()
    store.base, store.tails = base, [bad]
    store.fds = {f"gpu:{i}": os.memfd_create(i) for i in ("w0", "w1")}
    blocked = tmp_path / "file"
    blocked.write_text("")
    keeper_path = str(tmp_path / "keeper.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(keeper_path)
    listener.listen(1)
    server = subprocess.Popen(
        [sys.executable, "-m", "gms", "serve", "--backend", "host", "--socket", str(tmp_path / "gms.sock"),
         "--keeper-socket", keeper_path, "--state-dir", str(blocked / "saved")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        conn, _ = listener.accept()
        with conn:
            reader = frames.FrameReader()
            assert frames.recv_frame(conn, reader).kind == "hello"
            body, keyed = store.handback()
            frames.send_frame(conn, "handback", body)
            frames.send_fds(conn, "fds", keyed)
            frames.send_frame(conn, "end")
            said = []
            try:
                while True:
                    frame = frames.recv_frame(conn, reader)
                    said.append((store.apply(frame), frame.body.get("why")))
            except frames.ChannelClosed:
                pass
        output = server.communicate(timeout=30)[0]
        assert server.returncode == 78, output
        assert said == [(Say.STOPPING, Leaving.UNRESUMABLE)], "it told its keeper to keep the node"
        assert sorted(store.fds) == ["gpu:w0", "gpu:w1"] and store.base == base, "nothing let go"
        assert "could not be saved" in output
    finally:
        server.kill()
        listener.close()
        store.close()


# -- a keeper that dies ------------------------------------------------------------------


def test_a_server_whose_keeper_died_starts_another_which_keeps_the_node(tmp_path):
    """Was: the server exited with its keeper (and every layout with it)."""
    server = kept(tmp_path)
    layout_hash, _ = publish_raw(server.socket, "weights", (4 * MiB,))
    serving = server.server_pid()
    os.kill(server.pid, signal.SIGKILL)
    state = wait_until(lambda: (s := state_or_none(server.socket)) and s.keeper == "attached" and s.keepers_lost and s,
                       timeout=30, what="a new keeper attached")
    assert state.pid == serving, "the same server serves on"
    new_keeper = next(p for p in descendants(serving) if "gms keeper" in _cmdline(p))  # the server's child
    try:
        os.kill(serving, signal.SIGKILL)  # and the new keeper brings the node back
        state = wait_until(lambda: (s := state_or_none(server.socket)) and s.pid != serving and s, timeout=30,
                           what="the new keeper's server")
        assert state.layout("weights").memory_layout_hash == layout_hash
    finally:
        kill_tree(new_keeper)


# -- memory freed wakes its waiter -------------------------------------------------------------


def test_memory_freed_under_a_keeper_wakes_the_allocation_waiting_for_it(tmp_path):
    """Was: the waiter noticed only on its retry timer (0.52 s at --alloc-retry-interval 5,
    against 3-9 ms without a keeper): the keeper still held the freed memory's fd."""
    server = kept(tmp_path, "--host-capacity", "16MiB", "--alloc-retry-interval", "5")
    holder = RawConn(server.socket)
    assert holder.handshake("RW", layout="a").success
    held = holder.call(m.AllocateRequest(12 * MiB, "w"))
    waiter = RawConn(server.socket)
    assert waiter.handshake("RW", layout="b").success
    waiter.send(m.AllocateRequest(12 * MiB, "w"))
    wait_until(lambda: any(e.kind == "ALLOCATION_OOM_WAIT" for e in server.events()), what="the wait")
    time.sleep(3)  # its retry timer has backed off to seconds
    freed_at = time.monotonic()
    assert holder.call(m.FreeAllocationRequest(held.allocation_id)).success
    got, _ = waiter.recv(timeout=20)
    assert isinstance(got, m.AllocateResponse), got
    assert time.monotonic() - freed_at < 1.0, "woken by the keeper's word, not the timer"


# -- a server that accepts and never answers -----------------------------------------------------


@pytest.fixture
def mute(tmp_path):
    """A socket that accepts connections and never says a word."""
    path = str(tmp_path / "mute.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(8)
    accepted = []
    threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True).start()
    yield path
    listener.close()


def test_connect_gives_up_on_a_server_that_accepts_and_never_answers(mute):
    """Was: connect() without timeout_ms blocked for good (still blocked after 100 s
    with call_timeout_s=5)."""
    mgr = GMSClientMemoryManager(mute, call_timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(ResponseTimeoutError):
        mgr.connect(RequestedLockType.RO)
    assert time.monotonic() - started < 5


def test_connect_with_the_default_deadline_gives_up_within_ten_heartbeats(mute, monkeypatch):
    """Was (issue 48): a waiting client expects a heartbeat every second, yet gave a
    mute server the whole 60 s call timeout, and said it waited "within None s"."""
    from gms.client import link, manager

    assert link.FIRST_WORD_S == 10 * link.HEARTBEAT_MS / 1000 < manager.DEFAULT_CALL_TIMEOUT_S
    monkeypatch.setattr(link, "FIRST_WORD_S", 0.5)  # (the test waits half a second, not ten)
    started = time.monotonic()
    with pytest.raises(ResponseTimeoutError) as caught:
        GMSClientMemoryManager(mute).connect(RequestedLockType.RO)  # call_timeout_s: the default 60 s
    assert time.monotonic() - started < 5
    assert "said nothing for 0.5 s" in str(caught.value) and "None" not in str(caught.value)


def test_a_lock_wait_longer_than_call_timeout_s_is_waited_out(tmp_path):
    """The heartbeat's other side: a real wait is told apart from a hang."""
    server = kept(tmp_path)
    writer = RawConn(server.socket)
    assert writer.handshake("RW").success
    mgr = GMSClientMemoryManager(server.socket, call_timeout_s=1.0)
    done = []
    thread = threading.Thread(target=lambda: done.append(mgr.connect(RequestedLockType.RO)))
    thread.start()
    time.sleep(2.5)
    build_layout(writer, (MiB,))
    assert writer.call(m.CommitRequest()).success
    thread.join(10)
    assert done == [None] and mgr.granted_lock_type.value == "RO"
    mgr.close()


# -- the seed's wake ---------------------------------------------------------------------------


def test_the_seed_s_wake_raises_stale_from_remap_not_connect(tmp_path):
    """``unmap_all_vas(); abort(); ... connect(RO); remap_all_vas()``: code written to
    the seed catches StaleMemoryLayoutError around remap_all_vas."""
    server = kept(tmp_path)
    publish_raw(server.socket, "weights", (MiB,))
    mgr = GMSClientMemoryManager(server.socket)
    mgr.connect(RequestedLockType.RO)
    mgr.create_mapping(allocation_id=listing(server.socket, "weights")[0][0])
    mgr.unmap_all_vas()
    mgr.abort()
    publish_raw(server.socket, "weights", (MiB, MiB))  # republished while it slept
    mgr.connect(RequestedLockType.RO)  # granted: the seed's connect does not judge the layout
    with pytest.raises(StaleMemoryLayoutError):
        mgr.remap_all_vas()
    mgr.abort()
    # A writer building: the wake waits for its commit, then remap says stale.
    writer = RawConn(server.socket)
    assert writer.handshake("RW").success
    with pytest.raises(LockTimeoutError):
        mgr.connect(RequestedLockType.RO, timeout_ms=300)
    woke = threading.Thread(target=mgr.connect, args=(RequestedLockType.RO,))
    woke.start()
    build_layout(writer, (2 * MiB,))  # (another structure: the hash is structural)
    assert writer.call(m.CommitRequest()).success
    woke.join(10)
    with pytest.raises(StaleMemoryLayoutError):
        mgr.remap_all_vas()
    mgr.close()


def test_a_server_reattaches_to_a_keeper_container_that_restarted(tmp_path):
    """``--keeper-socket``: was, a keeper container that restarted left its server
    serving without one for good (the next crash lost the node)."""
    from .test_restart import server_process, start_keeper

    keeper_path = str(tmp_path / "keeper.sock")
    with open(tmp_path / "keeper.log", "wb") as log:
        keeper = start_keeper(keeper_path, log)
        first = server_process(tmp_path, "--keeper-socket", keeper_path)
        try:
            layout_hash, _ = publish_raw(first.socket, "weights", (2 * MiB,))
            keeper.kill()
            keeper.wait()
            wait_until(lambda: first.state().keeper == "gone", what="the keeper missed")
            assert first.state().keepers_lost == 1
            os.unlink(keeper_path)
            keeper = start_keeper(keeper_path, log)  # the container again
            wait_until(lambda: first.state().keeper == "attached", timeout=30, what="the server attached again")
            first.kill()  # and a crash now loses nothing
            second = server_process(tmp_path, "--keeper-socket", keeper_path, socket_path=first.socket)
            assert second.layout("weights").memory_layout_hash == layout_hash
        finally:
            keeper.kill()
