"""``gms serve --devices``: one isolated server process per device, restarted on its own."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from gms.client.probes import get_runtime_state
from gms.errors import GMSError

from gms.wire import messages as m

from .helpers import RawConn, build_layout, wait_until


@pytest.fixture
def tmp_path():
    # GPU UUIDs make long socket names; pytest's folders would pass AF_UNIX's 108 bytes.
    path = tempfile.mkdtemp(prefix="gms-", dir="/tmp")
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


def _alive(path: str) -> bool:
    try:
        return get_runtime_state(path, timeout=1).pid > 0
    except GMSError:
        return False


def start(tmp_path, backend: str, devices: str) -> subprocess.Popen:
    env = {**os.environ, "GMS_SOCKET_DIR": str(tmp_path)}
    return subprocess.Popen(
        [sys.executable, "-m", "gms", "serve", "--devices", devices, "--backend", backend,
         "--log-level", "warning"],
        env=env,
    )


def socket_of(tmp_path, backend: str, device: int) -> str:
    if backend == "cuda":
        from gms.cuda.vmm import device_uuid

        return str(tmp_path / f"gms_{device_uuid(device)}.sock")
    return str(tmp_path / f"gms_host-{device}.sock")


def test_supervisor_runs_one_server_per_device_and_stops_them(tmp_path, backend):
    devices = [0] if backend == "cuda" else [0, 1, 2]
    proc = start(tmp_path, backend, "all" if backend == "cuda" else "0,1,2")
    paths = [socket_of(tmp_path, backend, d) for d in devices]
    for path in paths:
        wait_until(lambda path=path: _alive(path), timeout=60, what=path)
    pids = {get_runtime_state(p).pid for p in paths}
    assert len(pids) == len(devices) and proc.pid not in pids, "one isolated process per device"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    assert not any(os.path.exists(p) for p in paths)


def _pid(path: str) -> int | None:
    try:
        return get_runtime_state(path, timeout=1).pid
    except GMSError:
        return None


def test_a_dead_server_is_restarted_alone_and_the_others_keep_serving(tmp_path):
    proc = start(tmp_path, "host", "0,1")
    try:
        doomed, healthy = (socket_of(tmp_path, "host", d) for d in (0, 1))
        for path in (doomed, healthy):
            wait_until(lambda path=path: _alive(path), timeout=60, what=path)
        writer = RawConn(healthy)
        writer.handshake("RW")
        build_layout(writer)
        layout_hash = writer.call(m.CommitRequest()).memory_layout_hash
        reader = RawConn(healthy)
        assert reader.handshake("RO").success
        healthy_pid, doomed_pid = _pid(healthy), _pid(doomed)

        os.kill(doomed_pid, signal.SIGKILL)
        wait_until(lambda: _pid(doomed) not in (None, doomed_pid), timeout=30, what="restart")
        assert proc.poll() is None, "the supervisor keeps running"
        state = get_runtime_state(healthy)
        assert state.pid == healthy_pid, "the other GPU's server was not touched"
        weights = state.layout("weights")
        assert (weights.state, weights.readers, weights.memory_layout_hash) == ("RO", 1, layout_hash)
        assert reader.call(m.MetadataGetRequest("t0")).found, "its client still reads"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_a_bad_policy_stops_the_supervisor_before_any_server(tmp_path):
    bad = tmp_path / "policy.toml"
    bad.write_text("[[tenant]]\nname = 'a'\nuids = [1]\nquota = 'lots'\n")
    run = subprocess.run(
        [sys.executable, "-m", "gms", "serve", "--devices", "0,1", "--backend", "host", "--policy", str(bad)],
        env={**os.environ, "GMS_SOCKET_DIR": str(tmp_path)}, capture_output=True, text=True, timeout=60,
    )
    assert run.returncode == 78
    assert f"{bad}:4: quota" in run.stderr
