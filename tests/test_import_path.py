"""No gms process runs code from the folder it was started in, nor from a path
another user can write (issue 48): a ``gms`` package planted in the working
folder of a root ``gms serve`` is never imported, by the keeper, the server,
the spare, the copier, a replacement keeper or the ``--devices`` supervisor's
children."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gms.system import launch

from .helpers import kill_tree, state_or_none, wait_until


def gms_command() -> list[str]:
    """``gms`` as a user runs it: the console script beside this interpreter."""
    script = Path(sys.executable).with_name("gms")
    return [str(script)] if script.exists() else [sys.executable, "-P", "-m", "gms"]


def plant(folder: Path) -> Path:
    """A ``gms`` package in ``folder`` whose every module leaves a mark when imported."""
    marker = folder / "PLANTED-CODE-RAN"
    code = f"import pathlib, os\npathlib.Path({str(marker)!r}).write_text(str(os.getpid()))\n"
    for module in ("__init__.py", "__main__.py", "copier/__init__.py", "copier/__main__.py"):
        (folder / "gms" / module).parent.mkdir(parents=True, exist_ok=True)
        (folder / "gms" / module).write_text(code)
    return marker


def test_a_gms_package_planted_in_the_working_folder_never_runs(shared_tmp):
    folder = shared_tmp
    folder.chmod(0o1777)  # as /tmp: anyone may plant a file here
    marker = plant(folder)
    sock = str(folder / "s.sock")
    log = open(folder / "serve.log", "wb")
    keeper = subprocess.Popen(
        [*gms_command(), "serve", "--backend", "host", "--socket", sock, "--spare-after", "0.2"],
        cwd=folder, stdout=log, stderr=subprocess.STDOUT,
    )
    servers: list[int] = []
    try:
        first = wait_until(lambda: state_or_none(sock), timeout=60, what="the server")
        servers.append(first.pid)
        assert first.copier == "running" or wait_until(lambda: state_or_none(sock).copier == "running", timeout=30)
        os.kill(first.pid, signal.SIGKILL)  # the keeper starts the next (the spare, started in this folder)
        second = wait_until(lambda: (s := state_or_none(sock)) and s.pid != first.pid and s, timeout=60,
                            what="the next server")
        servers.append(second.pid)
        os.kill(keeper.pid, signal.SIGKILL)  # the server starts a keeper of its own in its place
        wait_until(lambda: (s := state_or_none(sock)) and s.keeper == "attached" and s.keepers_lost, timeout=60,
                   what="a replacement keeper")
        assert state_or_none(sock).pid == second.pid
    finally:
        for pid in [keeper.pid, *servers]:  # (the replacement keeper and its spare are the server's children)
            kill_tree(pid)
        keeper.wait()
        log.close()
    assert not marker.exists(), f"planted code ran in pid {marker.read_text()}"


def test_the_devices_supervisor_s_children_never_run_planted_code(shared_tmp):
    folder = shared_tmp
    folder.chmod(0o1777)
    marker = plant(folder)
    env = {**os.environ, "GMS_SOCKET_DIR": str(folder / "run")}
    log = open(folder / "serve.log", "wb")
    supervisor = subprocess.Popen(
        [*gms_command(), "serve", "--devices", "0", "--backend", "host", "--no-spare"],
        cwd=folder, stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    try:
        path = str(folder / "run" / "gms_host-0.sock")
        wait_until(lambda: state_or_none(path), timeout=60, what="device 0's server")
    finally:
        kill_tree(supervisor.pid)
        supervisor.wait()
        log.close()
    assert not marker.exists(), f"planted code ran in pid {marker.read_text()}"


@pytest.mark.skipif(os.geteuid() != 0, reason="judges paths as root does")
def test_import_paths_others_can_write_are_refused(shared_tmp):
    open_dir = shared_tmp / "open"
    open_dir.mkdir(mode=0o777)
    open_dir.chmod(0o777)
    closed = shared_tmp / "closed"
    closed.mkdir(mode=0o755)
    sticky_child = Path("/tmp") / shared_tmp.name / "closed"  # /tmp is sticky: a closed folder under it is fine
    assert launch.safe_import_path(str(closed)) and launch.safe_import_path(str(sticky_child))
    assert not launch.safe_import_path(str(open_dir))
    assert not launch.safe_import_path(str(open_dir / "not-yet"))  # whoever writes it could make it
    assert not launch.safe_import_path("")  # the working folder
    assert not launch.safe_import_path("relative/path")
    os.chown(closed, 12345, -1)
    assert not launch.safe_import_path(str(closed))  # another user's

    saved = list(sys.path)
    try:
        sys.path[:0] = ["", str(open_dir)]
        dropped = launch.drop_unsafe_import_paths()
        assert dropped == ["", str(open_dir)] and sys.path == saved
    finally:
        sys.path[:] = saved
    env = launch.child_env({"PYTHONPATH": f":rel:{open_dir}:{shared_tmp}"})
    assert env["PYTHONPATH"] == str(shared_tmp) and env["PYTHONSAFEPATH"] == "1"
