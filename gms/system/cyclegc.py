"""The cyclic garbage collector of a server process: the log is not walked again and again.

CPython's collector walks every object it tracks in a full (generation-2)
collection, and it runs one whenever what survived into the old generation
since the last one is a quarter of what that one found.  A server's heap is
mostly its event log and its state (up to a million entries kept: frozen
attrs objects, immutable maps, no cycles among them), so every full
collection walked all of it, on the loop every client waits behind:
100,000 handshakes' 400,000 events cost eight full collections, 11% of the
time, the longest 106 ms (``python bench/gc_pauses.py``, 2-core host;
docs/results/gc_pauses_2core.json).

So after each full collection what survived it is frozen (``gc.freeze``:
moved where the collector never looks), and the next one walks only what
came since.  Frozen objects are still freed when their last reference goes
(the log's trimmed entries, a closed session's objects): only a frozen
object that later dies inside a reference cycle is not, until the heap is
thawed, every ``THAW_AFTER_S``: then the next full collection walks
everything once (an hour's one long pause instead of one every few
thousand requests).  Counting the frozen objects would walk them, so the
policy goes by the clock alone.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator

THAW_AFTER_S = 3600.0


class FrozenHeap:
    """The policy, as a collector callback (:func:`install` adds one to this process)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, thaw_after_s: float = THAW_AFTER_S) -> None:
        self._clock = clock
        self.thaw_after_s = thaw_after_s
        self._thawed_at = clock()
        self._thawing = False  # unfrozen: the next full collection walks everything
        self.freezes = 0
        self.thaws = 0

    def __call__(self, phase: str, info: dict) -> None:
        if phase != "stop" or info["generation"] != 2:
            return
        if not self._thawing and self._clock() - self._thawed_at >= self.thaw_after_s:
            gc.unfreeze()  # merged into the old generation: the next full collection finds their cycles
            self._thawing = True
            self._thawed_at = self._clock()
            self.thaws += 1
            return
        self._thawing = False
        gc.freeze()
        self.freezes += 1


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No collection while a node is rebuilt (a restart's journal, a take-over's
    image): hundreds of thousands of new objects without a cycle among them,
    which each collection on the way walked again (decoding 100,000 metadata
    entries took 7.0 us each with the collector on, 1.5 off; 2-core host).
    What was made is frozen once, at the end."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def install() -> FrozenHeap:
    """Freeze what is alive now (the modules, the startup's objects) and
    freeze again after each full collection (once per server process).  No
    collection first: a full walk of the startup's heap is milliseconds on a
    restart's path, and the few cycles the imports left wait for the first
    thaw."""
    gc.freeze()
    policy = FrozenHeap()
    gc.callbacks.append(policy)
    return policy

