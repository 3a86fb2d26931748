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


@pytest.mark.gpu
def test_on_two_gpus_a_dead_server_comes_back_alone_with_its_layout(tmp_path):
    """`--devices all` on a host of two GPUs (real VMM memory): GPU 0's server
    SIGKILLed; GPU 1's server, its layout and its reader are not touched, and
    GPU 0's server comes back with its layout from its own keeper."""
    import time

    from gms.cuda import cuda_device_count

    if cuda_device_count() < 2:
        pytest.skip("needs two GPUs")
    proc = start(tmp_path, "cuda", "all")
    try:
        doomed, healthy = (socket_of(tmp_path, "cuda", d) for d in (0, 1))
        for path in (doomed, healthy):
            wait_until(lambda path=path: _alive(path), timeout=120, what=path)
        hashes = {}
        for path in (doomed, healthy):
            writer = RawConn(path)
            writer.handshake("RW")
            build_layout(writer, sizes=(64 * 2**20, 256 * 2**20))
            hashes[path] = writer.call(m.CommitRequest()).memory_layout_hash
        reader = RawConn(healthy)
        assert reader.handshake("RO").success
        healthy_pid, doomed_pid = _pid(healthy), _pid(doomed)

        killed = time.monotonic()
        os.kill(doomed_pid, signal.SIGKILL)
        wait_until(lambda: _pid(doomed) not in (None, doomed_pid), timeout=60, what="restart")
        back = time.monotonic() - killed
        assert proc.poll() is None, "the supervisor keeps running"
        state = get_runtime_state(healthy)
        assert state.pid == healthy_pid, "the other GPU's server was not touched"
        weights = state.layout("weights")
        assert (weights.state, weights.readers, weights.memory_layout_hash) == ("RO", 1, hashes[healthy])
        assert reader.call(m.MetadataGetRequest("t0")).found, "its client still reads"
        assert get_runtime_state(doomed).layout("weights").memory_layout_hash == hashes[doomed]
        print(f"\nGPU 0's server SIGKILLed: serving again, its layout back, {back:.2f} s later")
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


def test_each_device_s_server_comes_back_with_its_layouts_from_its_own_keeper(tmp_path):
    proc = start(tmp_path, "host", "0,1")
    try:
        doomed, healthy = (socket_of(tmp_path, "host", d) for d in (0, 1))
        for path in (doomed, healthy):
            wait_until(lambda path=path: _alive(path), timeout=60, what=path)
        writer = RawConn(doomed)
        writer.handshake("RW")
        build_layout(writer)
        layout_hash = writer.call(m.CommitRequest()).memory_layout_hash
        healthy_pid, doomed_pid = _pid(healthy), _pid(doomed)
        os.kill(doomed_pid, signal.SIGKILL)
        wait_until(lambda: _pid(doomed) not in (None, doomed_pid), timeout=30, what="restart")
        assert get_runtime_state(doomed).layout("weights").memory_layout_hash == layout_hash
        assert _pid(healthy) == healthy_pid
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_servers_of_every_device_keep_their_layouts_in_a_keeper_of_another_process(tmp_path):
    """The Kubernetes pod's layout: `gms keeper` in one container, `gms serve
    --devices all --keeper-socket` in another; a server restarted alone resumes."""
    keeper_path = str(tmp_path / "keeper" / "keeper.sock")
    keeper = subprocess.Popen([sys.executable, "-m", "gms", "keeper", "--keeper-socket", keeper_path])
    env = {**os.environ, "GMS_SOCKET_DIR": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gms", "serve", "--devices", "0,1", "--backend", "host", "--log-level", "warning",
         "--keeper-socket", keeper_path, "--ready-dir", str(tmp_path)],
        env=env,
    )
    try:
        paths = [socket_of(tmp_path, "host", d) for d in (0, 1)]
        for path in paths:
            wait_until(lambda path=path: _alive(path), timeout=60, what=path)
        wait_until(lambda: sorted(p.name for p in tmp_path.glob("*.ready")) == ["device-0.ready", "device-1.ready"],
                   what="both servers ready")
        hashes = []
        for path in paths:
            writer = RawConn(path)
            writer.handshake("RW")
            build_layout(writer)
            hashes.append(writer.call(m.CommitRequest()).memory_layout_hash)
        doomed = _pid(paths[0])
        os.kill(doomed, signal.SIGKILL)  # the supervisor starts it again; the keeper hands it back
        wait_until(lambda: _pid(paths[0]) not in (None, doomed), timeout=30, what="restart")
        assert [get_runtime_state(p).layout("weights").memory_layout_hash for p in paths] == hashes
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        keeper.send_signal(signal.SIGTERM)
        assert keeper.wait(60) == 0


# -- every option reaches every device's server (issue 59) ---------------------------------

# A value other than its default for each option of `gms serve` (None: a switch).  A new
# option fails the test below until it has one here, and then passes only if
# `--devices` hands it to each device's server.
SAMPLES = {
    "--backend": "host", "--policy": "/etc/gms/policy.toml", "--gpu-budget": "0.5", "--host-budget": "2GiB",
    "--no-host-tier": None, "--no-copier": None, "--disk-dir": "/srv/gms-disk", "--disk-budget": "3GiB",
    "--no-disk-tier": None, "--restore-at-start": None, "--host-pool": "auto", "--host-chunk": "32MiB",
    "--host-capacity": "8GiB", "--metrics-port": "9400", "--metrics-host": "0.0.0.0",
    "--alloc-retry-interval": "0.2", "--alloc-retry-timeout": "5", "--alloc-stock": "0", "--socket-mode": "660",
    "--max-frame-bytes": "8MiB", "--max-metadata-value-bytes": "2MiB", "--max-allocations": "99",
    "--max-metadata-keys": "98", "--max-layouts": "97", "--max-metadata-bytes": "1GiB",
    "--metadata-entry-bytes": "128", "--tenant-metadata-quota": "32MiB", "--tenant-max-layouts": "12",
    "--scan-cache-bytes": "1MiB", "--handshake-timeout": "3", "--max-connections-per-uid": "9",
    "--fd-reserve": "64", "--event-log-retain": "5000", "--event-log-bytes": "16MiB", "--log-level": "debug",
    "--no-keeper": None, "--no-spare": None, "--spare-after": "7", "--keeper-socket": "/run/k.sock",
    "--take-over": None, "--handover-timeout": "12", "--state-dir": "/srv/state", "--ready-dir": "/run/ready",
}
NOT_PASSED_ON = {"--help", "--devices", "--device", "--socket", "--keeper-fd"}  # the supervisor's own, or refused


def test_every_option_of_serve_reaches_each_device_s_server():
    from gms.cli import build_parser
    from gms.operator.supervisor import child_argv

    parser = build_parser()
    serve = next(a for a in parser._actions if a.dest == "command").choices["serve"]  # argparse has no public walk
    options = {a.option_strings[-1] for a in serve._actions if a.option_strings}
    assert options - NOT_PASSED_ON == set(SAMPLES), "an option of gms serve with no sample value here"
    words = ["serve", "--devices", "0,1"]
    for flag, value in SAMPLES.items():
        words += [flag] if value is None else [flag, value]
    parent = parser.parse_args(words)
    parent.argv = words
    argv = child_argv(parent, 1)
    child = parser.parse_args(argv[argv.index("gms") + 1:])
    mine, theirs = vars(parent), vars(child)
    assert {k for k in mine if mine[k] != theirs.get(k)} == {"devices", "device", "metrics_port", "argv"}
    assert (child.devices, child.device, child.metrics_port) == (None, 1, 9401)
    for flag, value in SAMPLES.items():  # and each as the user wrote it
        assert flag in argv and (value is None or argv[argv.index(flag) + 1] == value or flag == "--metrics-port")
