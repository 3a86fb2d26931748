"""The server's collector policy (gms.system.cyclegc), on CPython's real collector."""

from __future__ import annotations

import gc
import weakref

import pytest

from gms.system.cyclegc import FrozenHeap


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


@pytest.fixture
def policy():
    clock = [0.0]
    heap = FrozenHeap(clock=lambda: clock[0], thaw_after_s=60.0)
    heap.clock = clock
    gc.collect()
    gc.callbacks.append(heap)
    try:
        yield heap
    finally:
        gc.callbacks.remove(heap)
        gc.unfreeze()


def test_a_full_collection_freezes_what_survived_it_and_later_garbage_is_still_collected(policy):
    survivor = Node()
    gc.collect()
    assert policy.freezes == 1 and gc.get_freeze_count() > 0
    assert gc.is_tracked(survivor) and not any(o is survivor for o in gc.get_objects())  # frozen: not walked
    young = weakref.ref(Node())  # made and dropped after the freeze
    gc.collect()
    assert young() is None
    del survivor


def test_a_frozen_cycle_waits_for_the_thaw_then_is_collected(policy):
    old = Node()
    gone = weakref.ref(old)
    gc.collect()  # frozen alive
    del old
    gc.collect()
    assert gone() is not None, "a frozen object is not walked before the thaw"
    policy.clock[0] = 61.0
    gc.collect()  # the thaw: unfrozen at its end, not frozen again
    assert policy.thaws == 1 and gc.get_freeze_count() == 0
    gc.collect()  # walks everything once, then freezes again
    assert gone() is None
    assert policy.freezes == 3 and gc.get_freeze_count() > 0


def test_young_collections_neither_freeze_nor_thaw(policy):
    gc.collect(0)
    gc.collect(1)
    assert policy.freezes == 0 and gc.get_freeze_count() == 0
