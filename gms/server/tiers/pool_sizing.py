"""How much pinned host memory the pool keeps when nobody sized it (``--host-pool auto``, the default).

Pinning costs about 0.24 s per GiB on the H100 host, 13 times the D2H copy
it prepares, so a ``system`` publish into chunks pinned at its commit runs
at 16 to 24 times the copy's floor.  What a build has allocated on the GPU
is what its publish may copy, and a build takes seconds to fill (weights
read from disk): so the pool pins while a writer builds, as the build
grows, and its publish finds the chunks made.  Once the build ends (its
commit took what it needed, or it needed none, or it aborted) the target
falls and the pool gives the rest back: **idle pinned memory is at most what
the builds under way have allocated, and only while they build.**

What counts, from the state (the log's word, read on the loop):

* the allocations of layouts a writer is building, but those tagged as
  scratch (``kv_cache``, ``cuda_graph``: a KV cache is built for an engine's
  whole life and never published);
* not a layout whose last commit kept no host copy (``device``,
  ``unpinned``): it is rebuilt the same way, as a rule (learned while the
  server runs; a new server pins for its first build of each);
* at most ``cap_bytes`` (half the host's memory, or the host budget's room:
  ``HostMemory`` keeps the pool within it as for any pool).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from itertools import islice

from ...fsm import NodeState
from ...fsm.state import SCRATCH_TAGS, Residency

POLL_S = 0.1  # how often the pool looks at the builds (a 64 MiB chunk pins in ~14 ms)
# Allocations counted per look.  A count walks the build's allocations (on the
# 2-core host 0.48 ms at 3,000, 1.2 ms at 6,000, more when they are cold; twice
# that on a GPU host's CPU), a stall of the loop ten times a second.  In slices
# of this many, a look costs under 0.1 ms (bench/pool_look.py) and a big
# build's count finishes a few looks later (its memory, immutable, counted as
# it was).
SLICE = 256


def whole_chunks(allocations: Iterable, chunk_bytes: int) -> int:
    """The bytes of whole chunks in each allocation not tagged as scratch, summed."""
    return sum(a.aligned_size - a.aligned_size % chunk_bytes for a in allocations if a.tag not in SCRATCH_TAGS)


def half_the_host() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError):
        return 0


class PoolSizing:
    def __init__(self, node: Callable[[], NodeState], cap_bytes: int | None = None) -> None:
        self._node = node
        self.cap_bytes = half_the_host() if cap_bytes is None else cap_bytes
        self._kept_no_copy: set[str] = set()  # layouts last committed without a host copy
        self._counted: dict[str, tuple[int, int]] = {}  # building layout -> (its held bytes, what counts)
        # building layout -> (its held bytes, the allocations still to count then, the count so far)
        self._counting: dict[str, tuple[int, Iterator, int]] = {}

    def target(self, chunk_bytes: int) -> int:
        """Bytes the pool should hold now: the whole chunks of ``chunk_bytes`` the
        builds' publishes would take from it (each allocation's rest is made
        exactly, at its publish), within the cap (the budget's room aside)."""
        demand = 0
        counted: dict[str, tuple[int, int]] = {}
        for name, layout in self._node().layouts.items():
            if layout.committed:
                if layout.residency is Residency.SYSTEM:
                    self._kept_no_copy.discard(name)
                else:
                    self._kept_no_copy.add(name)
                continue
            if layout.writer is None or not layout.held_bytes or name in self._kept_no_copy:
                continue
            done = self._counted.get(name, (-1, 0))
            if done[0] != layout.held_bytes:  # recounted only as the build grows
                done = self._count(name, layout, chunk_bytes, done)
            counted[name] = done
            demand += done[1]
        self._counted = counted
        for name in [name for name in self._counting if name not in counted]:
            del self._counting[name]
        return min(demand, self.cap_bytes - self.cap_bytes % chunk_bytes)

    def _count(self, name: str, layout, chunk_bytes: int, done: tuple[int, int]) -> tuple[int, int]:
        """One slice more of the layout's count: the finished count, or until
        it is, the last one (the part counted so far, for a first count)."""
        held, rest, partial = self._counting.pop(name, None) or (layout.held_bytes, iter(layout.allocations.values()), 0)
        batch = list(islice(rest, SLICE))
        partial += whole_chunks(batch, chunk_bytes)
        if len(batch) < SLICE:
            return held, partial
        self._counting[name] = (held, rest, partial)
        return done if done[0] >= 0 else (-1, partial)
