"""Default socket paths: what servers and clients agree on without being told."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gms import paths
from gms.cuda import resolve_backend

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
