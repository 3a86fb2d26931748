"""gms.fsm.replace: the fold's fast attrs.evolve gives the same values, and refuses what evolve refuses."""

import attrs
import pytest
from immutables import Map

from gms.fsm.node import NodeState, TenantState
from gms.fsm.replace import replace
from gms.fsm.state import Allocation, LayoutState, Residency, Tier


def test_replace_equals_evolve():
    layout = LayoutState("weights", writer=3, readers=frozenset({4}), residency=Residency.SYSTEM)
    changes = dict(writer=None, committed=True, tier=Tier.HOST, allocations=Map({"a": Allocation("a", 1, 2, "t", 0)}))
    new = replace(layout, **changes)
    assert new == attrs.evolve(layout, **changes)
    assert hash(new) == hash(attrs.evolve(layout, **changes))
    assert layout.writer == 3 and not layout.committed  # the original is untouched
    node = NodeState(started=True, tick=7)
    assert replace(node, tick=8) == attrs.evolve(node, tick=8)


def test_replace_stays_frozen_and_refuses_unknown_fields():
    tenant = replace(TenantState("a"), used_bytes=5)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        tenant.used_bytes = 6
    with pytest.raises(TypeError, match="used_byte"):
        replace(tenant, used_byte=1)


def test_replace_refuses_classes_it_would_get_wrong():
    @attrs.frozen
    class Slotted:
        x: int

    @attrs.frozen(slots=False)
    class Validated:
        x: int = attrs.field(validator=attrs.validators.instance_of(int))

    for value in (Slotted(1), Validated(1)):
        with pytest.raises(TypeError, match="dict-backed"):
            replace(value, x=2)
