"""The real server, driven by a stateful machine, checked against the pure core."""

from __future__ import annotations

import os

import pytest

from .server_machine import ServerMachine, run_machine

# A server process per example makes these slower than the pure machine's.
EXAMPLES = int(os.environ.get("GMS_SERVER_MACHINE_EXAMPLES", "40"))


@pytest.mark.parametrize("copier", ["clients", "copier"])
def test_server_matches_the_pure_core(backend, copier):
    run_machine(ServerMachine, backend, copier == "copier", EXAMPLES, steps=30)
