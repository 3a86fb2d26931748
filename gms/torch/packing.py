"""Where tensors go: many tensors per allocation, few large allocations.

Allocation count is the lever on import time (one import/map per
allocation), so tensors are packed in order into allocations of up to
``pack_bytes``, each at an ``align``-byte boundary.  A tensor larger than a
pack gets an allocation of its own.  Pure: sizes in, placement out.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

DEFAULT_PACK_BYTES = 1 << 30
DEFAULT_ALIGN = 256


@attrs.frozen
class Placement:
    pack: int
    offset: int


@attrs.frozen
class PackPlan:
    pack_sizes: tuple[int, ...]
    placements: tuple[Placement, ...]  # one per input size, in input order


def _align(n: int, align: int) -> int:
    return -(-n // align) * align


def plan_packs(
    sizes: Sequence[int], pack_bytes: int = DEFAULT_PACK_BYTES, align: int = DEFAULT_ALIGN
) -> PackPlan:
    """Every size gets at least one byte, so every tensor has an offset inside its pack."""
    if pack_bytes <= 0 or align <= 0:
        raise ValueError("pack_bytes and align must be positive")
    pack_sizes: list[int] = []
    placements: list[Placement] = []
    used = 0
    for size in sizes:
        need = max(size, 1)
        if not pack_sizes or (used and _align(used, align) + need > pack_bytes):
            pack_sizes.append(0)
            used = 0
        offset = _align(used, align)
        used = offset + need
        pack_sizes[-1] = used
        placements.append(Placement(len(pack_sizes) - 1, offset))
    return PackPlan(tuple(pack_sizes), tuple(placements))
