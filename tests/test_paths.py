"""Default socket paths: what servers and clients agree on without being told."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gms.cuda import resolve_backend
from gms.system import paths

UUID = "GPU-7b2830dd-3a98-dffe-f0be-c470a89bb1be"


def test_a_deep_socket_folder_gets_a_short_stable_name():
    deep = "/" + "d" * 60  # the full name would take 111 bytes
    assert paths.socket_path_in("/run/gms", UUID) == f"/run/gms/gms_{UUID}.sock"
    short = paths.socket_path_in(deep, UUID)
    assert len(os.fsencode(short)) <= paths.MAX_SOCKET_PATH_BYTES
    assert short == paths.socket_path_in(deep, UUID)
    assert short != paths.socket_path_in(deep, UUID.replace("7b", "7c"))


def test_a_socket_folder_too_deep_for_any_name_is_a_clear_error(tmp_path):
    deep = tmp_path / ("d" * paths.MAX_SOCKET_PATH_BYTES)
    with pytest.raises(ValueError, match="GMS_SOCKET_DIR"):
        paths.socket_path_in(deep, UUID)
    out = subprocess.run(
        [sys.executable, "-m", "gms", "serve", "--backend", "host"],
        env={**os.environ, "GMS_SOCKET_DIR": str(deep)}, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 1
    assert "GMS_SOCKET_DIR" in out.stderr and "Traceback" not in out.stderr


def test_gms_backend_decides_what_auto_means(monkeypatch):
    monkeypatch.setenv("GMS_BACKEND", "host")
    assert resolve_backend("auto", 0) == "host"
    assert paths.socket_path(0).endswith("gms_host-0.sock")
    assert resolve_backend("cuda", 0) == "cuda"  # an explicit choice wins
    monkeypatch.setenv("GMS_BACKEND", "tpu")
    with pytest.raises(ValueError, match="unknown backend"):
        resolve_backend("auto", 0)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to be another user")
def test_a_user_s_own_server_comes_before_root_s(shared_tmp, monkeypatch):
    """A user who started `gms serve` themselves reaches it, even where root runs one
    too; without their own, they reach root's (the README's first five minutes)."""
    import socket as sockets

    uid = 24123
    system, runtime = shared_tmp / "run-gms", shared_tmp / "xdg"
    system.mkdir()
    runtime.mkdir()
    os.chown(runtime, uid, -1)
    root_s = sockets.socket(sockets.AF_UNIX)
    root_s.bind(str(system / "gms_host-0.sock"))
    monkeypatch.setattr(paths, "SYSTEM_DIR", str(system))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.delenv("GMS_SOCKET_DIR", raising=False)

    def as_user(bind_own: bool) -> str:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: the user
            try:
                os.setuid(uid)
                if bind_own:
                    (runtime / "gms").mkdir()
                    sockets.socket(sockets.AF_UNIX).bind(str(runtime / "gms" / "gms_host-0.sock"))
                os.write(write, paths.socket_path(0, "host").encode())
            finally:
                os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        with os.fdopen(read) as f:
            return f.read()

    try:
        assert as_user(bind_own=False) == str(system / "gms_host-0.sock")
        assert as_user(bind_own=True) == str(runtime / "gms" / "gms_host-0.sock")
    finally:
        root_s.close()
