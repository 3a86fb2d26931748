"""The real server, driven by a stateful machine, checked against the pure core."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from .server_machine import ServerMachine

# A server process per example makes these slower than the pure machine's.
EXAMPLES = int(os.environ.get("GMS_SERVER_MACHINE_EXAMPLES", "40"))


@pytest.mark.parametrize("copier", ["clients", "copier"])
def test_server_matches_the_pure_core(backend, copier):
    # Tenants connect as other uids: the socket's folder must let them in
    # (pytest's own folders are private to root).
    folder = tempfile.mkdtemp(prefix="gms-machine-", dir="/tmp")
    os.chmod(folder, 0o755)
    try:
        machine = type(
            "Machine", (ServerMachine,),
            {"tmp_path": Path(folder), "backend": backend, "copier": copier == "copier"},
        )
        run_state_machine_as_test(
            machine, settings=settings(max_examples=EXAMPLES, stateful_step_count=30, deadline=None)
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
