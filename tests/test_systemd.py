"""The keeper under systemd: everything it holds also in the service manager's fd store.

Against ``tests/fake_systemd.py`` (a manager built to systemd's documented
semantics; no systemd runs here): the keeper and its server are killed
together, as a unit's control group is, and the unit started again gets
every fd back through ``$LISTEN_FDS``; the new keeper's first server serves
the same layouts.  And the protocol's corners: names, a foreign
``LISTEN_PID``, an abstract notify socket.
"""

from __future__ import annotations

import os
import socket
import sys
import time

import pytest

from gms.keeper.systemd import fdname, key_of, read_journal
from gms.system import sdnotify
from gms.wire import messages as m

from .fake_systemd import FakeSystemd
from .helpers import MiB, RawConn, state_or_none, wait_until
from .test_restart import pattern, publish_raw, read_through


def test_a_unit_killed_whole_comes_back_from_the_fd_store(tmp_path):
    manager = FakeSystemd(tmp_path)
    path = str(tmp_path / "gms.sock")
    argv = [sys.executable, "-m", "gms", "serve", "--backend", "host", "--socket", path, "--log-level", "warning"]
    env = {**os.environ}
    try:
        manager.start(argv, env)
        assert manager.ready.wait(30), "READY=1 once the first server serves"
        layout_hash, weights = publish_raw(path, "weights", (2 * MiB, 3 * MiB))
        cold_hash, _ = publish_raw(path, "cold", (MiB,), "system")
        assert RawConn(path).call(m.EvictRequest("cold")).tier == "host"
        scratch_hash, (scratch,) = publish_raw(path, "scratch", (MiB,), "unpinned")
        assert RawConn(path).call(m.EvictRequest("scratch")).tier == "none"  # dropped: out of the store too
        want = {"listener"} | {f"gpu:{a.allocation_id}" for a in weights}

        def stored():  # the keeper mirrors what the server tells it, a moment later
            held = {key_of(n) for n in manager.names()} - {None}
            gpu = {k for k in held if not k.startswith("host:")}
            return gpu == want and sum(k.startswith("host:") for k in held) == 1

        wait_until(stored, what="the store holding the listener, the GPU memory and cold's host copy")
        # Once more after a while: on a busy machine the store may hold that set before
        # scratch's fd (stored, then removed as it is dropped) has even reached it.
        time.sleep(0.5)
        wait_until(stored, what="the store settled: scratch's memory out of it")
        names = manager.names()
        assert f"gms-gpu-{scratch.allocation_id}" not in names
        journals = [n for n in names if n.startswith("gms-journal-")]
        assert len(journals) == 1, "a new journal replaces the old one"

        manager.kill()  # the keeper and its server, together
        probe = RawConn(path)  # the manager holds the socket: no ECONNREFUSED
        probe.send(m.GetRuntimeStateRequest())
        assert not probe.readable(0.2)

        manager.start(argv, env)
        assert manager.ready.wait(30)
        answer, _ = probe.recv(timeout=30)
        assert answer.layout("weights").memory_layout_hash == layout_hash
        state = wait_until(lambda: state_or_none(path), what="the restarted unit")
        assert state.layout("cold").tier == "host" and state.layout("cold").memory_layout_hash == cold_hash
        reader = RawConn(path)
        assert reader.handshake("RO").success
        for n, a in enumerate(sorted(weights, key=lambda a: a.layout_slot)):
            assert read_through(reader, a.allocation_id, a.aligned_size) == pattern(n, a.aligned_size)
        reader.close()
        resumed = [e for e in RawConn(path).call(m.GetEventHistoryRequest()).events if e["kind"] == "SERVER_RESUMED"]
        assert resumed and "systemd" in resumed[-1]["reason"]
        assert manager.stop() == 0
        assert [n for n in manager.names() if n.startswith("gms-gpu-")] == [], "a clean stop lets everything go"
    finally:
        if manager.main_pid is not None:
            manager.kill()
        manager.close()


def test_store_names_are_valid_fdnames_and_map_back():
    for key in ("listener", "gpu:0123abcd", "host:ffee", "host:ffee/4194304/2097152"):  # a chunk of a copy
        name = fdname(key)
        assert sdnotify.valid_fdname(name) and key_of(name) == key
    assert not sdnotify.valid_fdname("gpu:x") and not sdnotify.valid_fdname("") and not sdnotify.valid_fdname("a b")
    with pytest.raises(ValueError):
        sdnotify.store_fds("bad:name", [0])


def test_fds_passed_to_another_process_are_not_taken(monkeypatch):
    monkeypatch.setenv("LISTEN_FDS", "2")
    monkeypatch.setenv("LISTEN_PID", str(os.getpid() + 1))
    monkeypatch.setenv("LISTEN_FDNAMES", "a:b")
    assert sdnotify.listen_fds() == []
    assert "LISTEN_FDS" not in os.environ, "unset either way, as sd_listen_fds(unset_environment=1)"


def test_names_for_fds_passed_to_this_process():
    """As the manager execs a unit: fds at 3.., LISTEN_PID the process's own."""
    import subprocess

    script = (
        "import os; from gms.system import sdnotify; fds = sdnotify.listen_fds(); "
        "print(fds, os.get_inheritable(3), 'LISTEN_FDS' in os.environ)"
    )
    out = subprocess.run(
        ["sh", "-c", f'LISTEN_PID=$$ LISTEN_FDS=2 LISTEN_FDNAMES=gms-listener exec "$0" -c "{script}" '
         "3</dev/null 4</dev/null", sys.executable],
        capture_output=True, text=True, timeout=60,
    )
    assert out.stdout.strip() == "[(3, 'gms-listener'), (4, 'unknown')] False False", out


def test_notify_reaches_an_abstract_socket_with_its_fds(monkeypatch):
    name = f"gms-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    memfd = os.memfd_create("journal")
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", f"@{name}")
        assert sdnotify.store_fds("gms-journal-1", [memfd])
        data, ancillary, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(4))
        assert data == b"FDSTORE=1\nFDNAME=gms-journal-1\nFDPOLL=0" and len(ancillary) == 1
        os.close(int.from_bytes(ancillary[0][2][:4], sys.byteorder))
        monkeypatch.delenv("NOTIFY_SOCKET")
        assert sdnotify.notify("READY=1") is False, "no manager: nothing sent, no error"
    finally:
        sock.close()
        os.close(memfd)


def test_a_journal_cut_short_ends_at_its_last_whole_record():
    from gms.keeper.systemd import SystemdMirror

    mirror = SystemdMirror()
    mirror.on_journal("base", b"BASE")
    mirror.on_journal("events", b"E1")
    os.write(mirror.journal, b"\x02\x00\x00")  # a record the keeper died writing
    assert read_journal(mirror.journal) == (b"BASE", [b"E1"])
    os.close(mirror.journal)
