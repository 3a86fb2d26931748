"""``Ledger.make_then_record``: decide, await what the decision needs, decide
again, record or undo (the host tier's copies and a publish through the
copier go this way).  Its control flow alone, over a recorder that keeps
what it is given; the real fold is tested through those requests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gms.fsm import StateViolation
from gms.fsm.events import HostCopyCreated
from gms.server.service.ledger import Ledger


def event(allocation_id: str) -> HostCopyCreated:
    return HostCopyCreated(1, allocation_id, layout="w")


class Recorder(SimpleNamespace):
    def __init__(self) -> None:
        super().__init__(folded=[], recorded=[])

    def fold(self, events):
        self.folded.append(list(events))

    def record(self, events):
        self.recorded.append(list(events))


async def test_the_same_decision_after_the_await_is_kept_and_recorded():
    ledger, done = Recorder(), []

    async def make():
        return ["chunk"]

    out = await Ledger.make_then_record(ledger, lambda: [event("a")], make, done.append, changed="x",
                                        keep=lambda made: done.append(("kept", made)))
    assert out == [event("a")] and ledger.recorded == [[event("a")]] and ledger.folded == [[event("a")]]
    assert done == [("kept", ["chunk"])]  # kept, never undone


async def test_a_decision_that_changed_during_the_await_is_undone_not_recorded():
    ledger, undone, world = Recorder(), [], ["a"]

    async def make():
        world[:] = ["b"]  # another request changed the layout meanwhile
        return ["chunk"]

    with pytest.raises(StateViolation, match="changed meanwhile"):
        await Ledger.make_then_record(ledger, lambda: [event(i) for i in world], make, undone.append,
                                      changed="changed meanwhile")
    assert undone == [["chunk"]] and ledger.recorded == []


async def test_a_refusal_before_the_await_makes_nothing():
    ledger, made = Recorder(), []

    def refuse(events):
        raise StateViolation("refused")

    ledger.fold = refuse

    async def make():
        made.append(1)

    with pytest.raises(StateViolation, match="refused"):
        await Ledger.make_then_record(ledger, lambda: [event("a")], make, lambda m: None, changed="x")
    assert made == []
