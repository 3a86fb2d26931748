"""Many named layouts in one server: independent locks, one log, the post-mortem, metrics."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest

import gms
from gms import GMSClientMemoryManager, RequestedLockType
from gms.client.admin import revoke
from gms.wire import messages as m

from .helpers import MiB, RawConn, build_layout, wait_until


def publish(socket: str, layout: str, payload: bytes, residency: str | None = None) -> str:
    writer = GMSClientMemoryManager(socket, layout=layout)
    writer.connect(RequestedLockType.RW)
    allocation_id, _ = writer.allocate_handle(4 * MiB, tag="weights")
    va = writer.create_mapping(allocation_id)
    writer.write(va, payload)
    writer.metadata_put("payload", allocation_id, 0, str(len(payload)).encode())
    writer.commit(residency)
    writer.close()
    return gms.get_runtime_state(socket).layout(layout).memory_layout_hash


def read(socket: str, layout: str) -> bytes:
    with GMSClientMemoryManager(socket, layout=layout) as reader:
        reader.connect(RequestedLockType.RO, timeout_ms=10_000)
        allocation_id, offset, length = reader.metadata_get("payload")
        va = reader.create_mapping(allocation_id)
        return reader.read(va + offset, int(length))


def test_layouts_lock_independently(server):
    publish(server.socket, "model-b", b"bytes of b")
    writer = RawConn(server.socket)
    assert writer.handshake("RW", layout="model-a").success  # a writer rebuilding model A...
    build_layout(writer)
    assert read(server.socket, "model-b") == b"bytes of b"  # ...never blocks readers of model B
    reader_of_a = RawConn(server.socket)
    reader_of_a.send(m.HandshakeRequest("RO", 200, "model-a"))
    assert reader_of_a.recv()[0].success is False, "A's readers wait for A's writer"
    rows = {row.name: row.state for row in server.state().layouts}
    assert rows == {"model-a": "RW", "model-b": "COMMITTED"}


def test_weights_and_kv_cache_are_ordinary_layouts(server):
    kv = GMSClientMemoryManager(server.socket, layout="kv_cache")
    kv.connect(RequestedLockType.RW)
    kv.create_mapping(size=2 * MiB, tag="kv_cache")
    publish(server.socket, "weights", b"w")
    state = server.state()
    assert (state.layout("kv_cache").state, state.layout("weights").state) == ("RW", "COMMITTED")
    assert state.used_bytes == 6 * MiB and state.tenant("default").used_bytes == 6 * MiB
    kv.close()
    wait_until(lambda: server.state().used_bytes == 4 * MiB, what="the KV cache released")


@pytest.mark.parametrize("name", ["", "bad name", "../x", "x" * 200, "é"])
def test_odd_layout_names_get_a_clear_error_and_nothing_changes(server, name):
    conn = RawConn(server.socket)
    response = conn.handshake("RW", layout=name)
    assert isinstance(response, m.ErrorResponse) and response.code == "INVALID_ARGUMENT"
    assert "layout name" in response.error
    assert conn.handshake("RW", layout="fine").success, "the connection can still handshake"
    assert [row.name for row in server.state().layouts] == ["fine"]


def test_admin_verbs_on_unknown_layouts_are_clear_errors(server):
    """Issue 63: every admin verb answers a name the node never had the same way."""
    for verb in (gms.client.admin.evict, gms.client.admin.pin, revoke):
        with pytest.raises(gms.GMSServerError, match="no layout 'ghost'") as error:
            verb(server.socket, "ghost")
        assert error.value.code == "UNKNOWN_LAYOUT"
    # Revoking stays idempotent: a layout nobody holds (its holder died first) revokes nothing.
    publish(server.socket, "idle", b"x")
    assert revoke(server.socket, "idle") == 0
    assert server.state().pid  # still serving


def test_history_filters_by_layout_and_replay_rebuilds_the_status(server, tmp_path):
    publish(server.socket, "model-a", b"a")
    publish(server.socket, "model-b", b"b")
    RawConn(server.socket).handshake("RO", layout="model-a")
    only_a = list(gms.client.iter_event_history(server.socket, layout="model-a"))
    assert only_a and all(e.layout == "model-a" for e in only_a)
    assert len(only_a) < len(server.events())

    log = tmp_path / "log.jsonl"
    with open(log, "w") as out:
        subprocess.run([sys.executable, "-m", "gms", "history", "--json", "--socket", server.socket],
                       stdout=out, check=True, timeout=60)
    replay = subprocess.run([sys.executable, "-m", "gms", "replay", str(log), "--json"],
                            capture_output=True, text=True, timeout=60)
    assert replay.returncode == 0, replay.stderr
    replayed = json.loads(replay.stdout)
    live = server.state()
    assert replayed["last_event_seq"] == live.last_event_seq
    assert {r["name"]: (r["state"], r["memory_layout_hash"], r["bytes"]) for r in replayed["layouts"]} == {
        r.name: (r.state, r.memory_layout_hash, r.bytes) for r in live.layouts
    }
    table = subprocess.run([sys.executable, "-m", "gms", "replay", str(log)], capture_output=True, text=True)
    assert "every invariant holds" in table.stdout and "model-a" in table.stdout
    # A log's state, not a server's: no socket, keeper, copier or process to signal (issue 63).
    heads = [line.split()[0] for line in table.stdout.splitlines() if line.strip()]
    assert heads[0] == "log" and not {"socket", "keeper", "copier", "server", "stop"} & set(heads), heads

    # A log cut by retention cannot be rebuilt from the file alone: replay says so.
    lines = log.read_text().splitlines()
    (tmp_path / "cut.jsonl").write_text("\n".join(lines[3:]) + "\n")
    cut = subprocess.run([sys.executable, "-m", "gms", "replay", str(tmp_path / "cut.jsonl")],
                         capture_output=True, text=True, timeout=60)
    assert cut.returncode == 2 and "dropped by the server's retention" in cut.stderr
    (tmp_path / "gap.jsonl").write_text("\n".join(lines[:3] + lines[4:]) + "\n")
    gap = subprocess.run([sys.executable, "-m", "gms", "replay", str(tmp_path / "gap.jsonl")],
                         capture_output=True, text=True, timeout=60)
    assert gap.returncode == 2 and "filtered" in gap.stderr


def test_status_shows_layouts_and_tenants(server):
    publish(server.socket, "model-a", b"a")
    out = subprocess.run([sys.executable, "-m", "gms", "status", "--socket", server.socket],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert "model-a" in out.stdout and "COMMITTED" in out.stdout and "TENANT" in out.stdout
    as_json = json.loads(subprocess.run(
        [sys.executable, "-m", "gms", "status", "--json", "--socket", server.socket],
        capture_output=True, text=True, timeout=60).stdout)
    assert [r["name"] for r in as_json["layouts"]] == ["model-a"]
    assert as_json["tenants"][0]["name"] == "default"


def test_status_into_a_reader_that_went_away_ends_quietly(server):
    """``gms status | head``: the reader may leave before gms writes; gms then ends
    as a Unix tool killed by SIGPIPE would (141), without a traceback."""
    import os

    publish(server.socket, "model-a", b"a")
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before a byte is written
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # as a user's shell has it
    try:
        out = subprocess.run([sys.executable, "-m", "gms", "status", "--socket", server.socket],
                             stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60, env=env)
    finally:
        os.close(write_end)
    assert out.returncode == 141 and out.stderr == ""


def test_metrics_endpoint(start_server):
    server = start_server("--metrics-port", "0", "--log-level", "info")
    port = wait_until(lambda: _metrics_port(server), what="metrics port in the log")
    publish(server.socket, "model-a", b"a")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for needle in (
        'gms_layout_bytes{layout="model-a",tier="device"} 4.194304e+06',
        'gms_tenant_used_bytes{tenant="default"} 4.194304e+06',
        "gms_capacity_bytes", "gms_budget_bytes", "gms_sessions 0.0", "gms_device_used_bytes 4.194304e+06",
        f'gms_server_info{{backend="{server.backend}",device="0",uuid="{server.state().device_uuid}"}} 1.0',
        'gms_events_total{kind="RW_COMMIT"} 1.0',
        'gms_layout_transitions_total{kind="load",layout="model-a"} 1.0',
        "gms_allocate_seconds_count 1.0", 'gms_lock_wait_seconds_count{mode="RW"} 1.0',
    ):
        assert needle in text, needle


def _metrics_port(server) -> int | None:
    for line in server.log.splitlines():
        if "metrics on http://" in line:
            return int(line.rsplit(":", 1)[1].split("/")[0])
    return None
