"""``gms serve --devices``: one server process per device, stopped together."""

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

from .helpers import wait_until


@pytest.fixture
def tmp_path():
    # GPU UUIDs make long socket names; pytest's folders would pass AF_UNIX's 108 bytes.
    path = tempfile.mkdtemp(prefix="gms-", dir="/tmp")
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


def _alive(path: str) -> bool:
    try:
        return get_runtime_state(path, timeout=1).state == "EMPTY"
    except GMSError:
        return False


def start(tmp_path, backend: str, devices: str) -> subprocess.Popen:
    env = {**os.environ, "GMS_SOCKET_DIR": str(tmp_path)}
    return subprocess.Popen(
        [sys.executable, "-m", "gms", "serve", "--devices", devices, "--backend", backend,
         "--tag", "weights", "--log-level", "warning"],
        env=env,
    )


def socket_of(tmp_path, backend: str, device: int) -> str:
    if backend == "cuda":
        from gms.cuda.vmm import device_uuid

        return str(tmp_path / f"gms_{device_uuid(device)}_weights.sock")
    return str(tmp_path / f"gms_host-{device}_weights.sock")


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


def test_supervisor_stops_everything_when_one_server_dies(tmp_path):
    proc = start(tmp_path, "host", "0,1")
    paths = [socket_of(tmp_path, "host", d) for d in (0, 1)]
    for path in paths:
        wait_until(lambda path=path: _alive(path), timeout=60, what=path)
    os.kill(get_runtime_state(paths[0]).pid, signal.SIGKILL)
    assert proc.wait(60) != 0
    assert not os.path.exists(paths[1]), "the healthy server was stopped cleanly"
