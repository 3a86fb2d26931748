"""Refusals slowed for a uid that keeps asking past its limits (gms/server/edge/tarpit.py)."""

from __future__ import annotations

from gms.server.edge.tarpit import DELAY_S, FREE_PER_S, Tarpit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_first_refusals_of_a_second_are_free_then_each_waits():
    clock = Clock()
    pit = Tarpit(clock)
    delays = [pit.delay(7) for _ in range(FREE_PER_S + 5)]
    assert delays == [0.0] * FREE_PER_S + [DELAY_S] * 5


def test_a_new_second_starts_free_and_uids_are_counted_apart():
    clock = Clock()
    pit = Tarpit(clock)
    for _ in range(FREE_PER_S + 1):
        pit.delay(7)
    assert pit.delay(8) == 0.0, "another uid pays nothing for uid 7's refusals"
    clock.now += 1.0
    assert pit.delay(7) == 0.0, "a second later, uid 7 starts free again"
