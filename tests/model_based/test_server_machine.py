"""The real server, driven by a stateful machine, checked against the pure core."""

from __future__ import annotations

import os

from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from .server_machine import ServerMachine

# A server process per example makes these slower than the pure machine's.
EXAMPLES = int(os.environ.get("GMS_SERVER_MACHINE_EXAMPLES", "40"))


def test_server_matches_the_pure_core(tmp_path, backend):
    machine = type("Machine", (ServerMachine,), {"tmp_path": tmp_path, "backend": backend})
    run_state_machine_as_test(
        machine, settings=settings(max_examples=EXAMPLES, stateful_step_count=30, deadline=None)
    )
