"""Stopping and restarting the service as the README and `gms status` say:
`gms stop` ends the keeper, its server, the spare and the copier, releasing
every layout; `gms restart` (or SIGHUP to the keeper) starts the next server
with every layout kept; `gms status` names the processes and the budget as the
history does, and calls the host backend's memory what it is."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from gms import GMSClientMemoryManager, RequestedLockType
from gms.system.procs import gone

from .helpers import MiB, ServerProcess, wait_until


def gms(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gms", *args], capture_output=True, text=True, timeout=120,
                          env=env)


def commit_layout(path: str, name: str = "weights") -> str:
    writer = GMSClientMemoryManager(path, layout=name)
    writer.connect(RequestedLockType.RW)
    allocation_id, _ = writer.allocate_handle(2 * MiB, tag="weights")
    writer.metadata_put("w", allocation_id, 0, b"1")
    writer.commit()
    reader = GMSClientMemoryManager(path, layout=name)
    reader.connect(RequestedLockType.RO)
    try:
        return reader.get_memory_layout_hash()
    finally:
        reader.close()


def test_gms_stop_ends_the_keeper_its_server_spare_and_copier(tmp_path):
    service = ServerProcess(tmp_path, keeper=True)
    spare = service.wait_for_spare()
    state = service.state()
    assert state.keeper_pid == service.pid == state.service_pid
    family = {service.pid, state.pid, spare, state.copier_pid}
    assert len(family) == 4 and 0 not in family
    commit_layout(service.socket)

    out = gms("stop", "--socket", service.socket)
    assert out.returncode == 0, out.stderr
    assert f"pid {service.pid} (the keeper)" in out.stdout
    assert service.proc.wait(10) == 0
    wait_until(lambda: all(gone(pid) for pid in family), timeout=10, what="every process of the service gone")
    assert not os.path.exists(service.socket)


def test_gms_restart_starts_the_next_server_with_every_layout(tmp_path):
    service = ServerProcess(tmp_path, keeper=True)
    try:
        layout_hash = commit_layout(service.socket)
        before = service.state()
        out = gms("restart", "--socket", service.socket)
        assert out.returncode == 0, out.stderr
        after = service.state()
        assert after.pid != before.pid and f"{before.pid} -> {after.pid}" in out.stdout
        assert after.keeper_pid == before.keeper_pid == service.pid  # the same keeper, the same service
        assert after.layout("weights").memory_layout_hash == layout_hash
        assert service.proc.poll() is None
    finally:
        service.kill()


def test_sighup_to_the_keeper_restarts_its_server(tmp_path):
    service = ServerProcess(tmp_path, keeper=True)
    try:
        layout_hash = commit_layout(service.socket)
        old = service.server_pid()
        os.kill(service.pid, signal.SIGHUP)

        def restarted() -> bool:
            try:
                return service.server_pid() != old
            except Exception:  # noqa: BLE001 - between servers
                return False

        wait_until(restarted, timeout=30, what="the next server")
        assert service.state().layout("weights").memory_layout_hash == layout_hash
        assert service.proc.poll() is None
    finally:
        service.kill()


def test_without_a_keeper_restart_is_refused_and_stop_stops_the_server(tmp_path):
    server = ServerProcess(tmp_path)  # --no-keeper
    state = server.state()
    assert (state.keeper, state.keeper_pid, state.service_pid) == ("none", 0, server.pid)
    out = gms("restart", "--socket", server.socket)
    assert out.returncode == 1 and "without a keeper" in out.stderr
    assert server.state().pid == server.pid  # untouched
    out = gms("stop", "--socket", server.socket)
    assert out.returncode == 0, out.stderr
    assert server.proc.wait(10) == 0 and not os.path.exists(server.socket)


def test_gms_stop_refuses_a_pid_that_is_not_gms(tmp_path, monkeypatch):
    from gms.cli import control

    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        with pytest.raises(control.ControlError, match="not a gms process"):
            control.signal_process(sleeper.pid, signal.SIGTERM, "a stranger")
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()


def test_status_names_the_host_backend_the_budget_and_who_to_signal(tmp_path):
    service = ServerProcess(tmp_path, keeper=True)
    try:
        commit_layout(service.socket)
        out = gms("status", "--socket", service.socket)
        assert out.returncode == 0, out.stderr
        rows = {line.split()[0]: line for line in out.stdout.splitlines() if line.strip()}
        assert "host memory (memfd)" in rows["device"] and "gpu" not in rows
        assert "no budget (the whole capacity)" in rows["memory"]
        assert "no budget" in rows["host"]
        assert f"pid {service.pid}" in rows["keeper"]
        assert f"SIGTERM to pid {service.pid}, the keeper" in rows["stop"]
        assert "gms restart" in rows["server"]
        assert rows["weights"].split()[3] == "device"  # the TIER column
        history = gms("history", "--socket", service.socket)
        assert "budget_bytes=None" in history.stdout  # the same budget: none set
        with_budget = ServerProcess(tmp_path, "--gpu-budget", "64MiB")
        out = gms("status", "--socket", with_budget.socket)
        assert "budget 64.0 MiB" in out.stdout
        with_budget.kill()
    finally:
        service.kill()


def test_under_a_supervisor_gms_stop_stops_every_device(tmp_path):
    env = {**os.environ, "GMS_SOCKET_DIR": str(tmp_path)}
    log = open(tmp_path / "supervisor.log", "wb")
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "gms", "serve", "--devices", "0,1", "--backend", "host", "--no-spare",
         "--log-level", "warning"], env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        def answers(device: int) -> bool:
            return gms("status", "--backend", "host", "--device", str(device), env=env).returncode == 0

        wait_until(lambda: answers(0) and answers(1), timeout=60, what="both devices' servers")
        out = gms("status", "--json", "--backend", "host", "--device", "1", env=env)
        assert f'"service_pid": {supervisor.pid}' in out.stdout
        out = gms("stop", "--backend", "host", "--device", "1", env=env)
        assert out.returncode == 0, out.stderr
        assert "supervisor" in out.stdout
        assert supervisor.wait(30) == 0
        assert not any(p.suffix == ".sock" for p in tmp_path.iterdir())
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()
        log.close()


def test_gms_version_says_the_release_it_is():
    from gms import __version__

    out = gms("--version")
    assert out.returncode == 0 and out.stdout.startswith(f"gms {__version__} (Python "), out


def test_gms_stop_from_another_installation_names_the_service_and_asks_for_its_socket(tmp_path, monkeypatch, capsys):
    """Issue 63: a second clone's CI ran `gms stop` and stopped the user's service,
    every layout with it.  On the default socket, `gms stop` and `gms restart`
    act only on a service that runs from their own Python; another is named, and
    stopped only when its socket is given."""
    from gms.cli import main
    from gms.system import paths

    monkeypatch.setenv("GMS_SOCKET_DIR", str(tmp_path))
    path = paths.socket_path(0, "host")
    service = ServerProcess(tmp_path, keeper=True, socket_path=path)
    assert service.state().python_prefix == sys.prefix
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "another-clone" / ".venv"))
    for verb in ("stop", "restart"):
        assert main([verb, "--backend", "host"]) == 1
        assert f"runs from {service.state().python_prefix}" in capsys.readouterr().err
    assert service.proc.poll() is None and service.state().python_prefix != sys.prefix
    assert main(["stop", "--socket", path]) == 0
    assert service.proc.wait(10) == 0


def test_every_command_and_option_says_what_it_is():
    """Issue 63: options with no help, log levels with no choices.  Every verb and
    every option of every verb is described (hidden ones aside)."""
    import argparse

    from gms.cli import build_parser

    parser = build_parser()
    (verbs,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert {c.dest: bool(c.help) for c in verbs._choices_actions} == dict.fromkeys(verbs.choices, True)
    silent = [
        (verb, action.option_strings or action.dest)
        for verb, sub in verbs.choices.items() for action in sub._actions
        if not isinstance(action, argparse._HelpAction) and not action.help
    ]
    assert silent == [], silent
    assert parser.parse_args(["serve", "--log-level", "WARNING"]).log_level == "warning"
