"""The node's accounting by tier, as data: for each tier, the total the node keeps,
the budget that bounds it, a layout's bytes there, and the words a refusal uses.

The fold (``gms.fsm.node``) moves every total the same way (the layout's bytes there
after the event, less before), holds every budget the same way, and the invariants
(``gms.fsm.invariants``) recompute every total from the layouts the same way; a new
tier is a row here (and its fields in ``NodeState``: the handover image and the
wire's status name them), not a branch in each.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import attrs

from .releases import MemoryTier
from .state import LayoutState


@attrs.frozen
class TierAccount:
    tier: MemoryTier
    total: str  # the NodeState field: bytes the node holds there
    budget: str  # the NodeState field that bounds it (None: unbounded)
    what: str  # the total, as a refusal names it
    # A layout's bytes there: named, read by attrgetter (the fold asks it of two layouts per event).
    held: Callable[[LayoutState], int] = attrs.field(converter=operator.attrgetter)
    # A total past its budget is a broken invariant (the rules never let a server
    # start under what the node holds there); a disk budget may be lowered under the
    # snapshots kept, which then only may not grow (``hold``).
    strict: bool = True


ACCOUNTS = (
    TierAccount(MemoryTier.GPU, "gpu_bytes", "budget_bytes", "the GPU's bytes", "gpu_bytes"),
    TierAccount(MemoryTier.HOST, "host_bytes", "host_budget_bytes", "the host tier's bytes", "host_bytes"),
    TierAccount(MemoryTier.DISK, "disk_bytes", "disk_budget_bytes", "the disk tier's bytes", "disk_held", strict=False),
)
