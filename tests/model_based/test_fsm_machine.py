"""The stateful property test of the pure core, and proof that it bites."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from gms.fsm import InvariantViolation, State
import gms.fsm.folding as folding
from gms.fsm.events import MetadataDeleted, RoDisconnect, RwAbort, RwConnect

from .fsm_machine import FsmMachine


def test_core_state_machine():
    # Examples and steps come from the active Hypothesis profile (conftest).
    run_state_machine_as_test(FsmMachine)


# Each planted bug is a fold step that is subtly wrong; the machine must fail.
PLANTED_BUGS = {
    "rw-abort-keeps-layout": (
        RwAbort,
        lambda s, e: State(
            allocations=s.allocations, metadata=s.metadata, next_layout_slot=s.next_layout_slot
        ),
    ),
    "rw-connect-keeps-committed-layout": (
        RwConnect,
        lambda s, e: State(
            writer=e.conn,
            allocations=s.allocations,
            metadata=s.metadata,
            next_layout_slot=s.next_layout_slot,
        ),
    ),
    "ro-disconnect-drops-every-reader": (
        RoDisconnect,
        lambda s, e: State(
            committed=True,
            allocations=s.allocations,
            metadata=s.metadata,
            layout_hash=s.layout_hash,
            next_layout_slot=s.next_layout_slot,
        ),
    ),
    "metadata-delete-is-a-no-op": (MetadataDeleted, lambda s, e: s),
}


@pytest.mark.parametrize("bug", sorted(PLANTED_BUGS))
def test_machine_finds_planted_fold_bug(bug, monkeypatch):
    event_type, wrong_step = PLANTED_BUGS[bug]
    monkeypatch.setitem(folding._STEPS, event_type, wrong_step)
    with pytest.raises((AssertionError, InvariantViolation)):
        run_state_machine_as_test(
            FsmMachine,
            settings=settings(
                max_examples=500,
                stateful_step_count=40,
                phases=[Phase.generate],  # finding it is the point, not shrinking it
                database=None,
                deadline=None,
                suppress_health_check=list(HealthCheck),
            ),
        )
