"""The copier's table of host chunks: which are mapped, being mapped, in use, released.

Shared by the copier's threads (the link's reader, the mapping thread, the
two copy workers, the unmapper), so every step takes its lock; a change wakes
whoever waits for one (a copy for its chunks, the unmapper for a pause).  A chunk goes

    expected (sent to be mapped) --mapped--> live --released--> unmapped
                                                  \\--released while a copy uses it--> doomed --copy ends--> unmapped

and one released while it is still being mapped is unmapped once mapped.
The server never reuses an id; if it did, the old mapping would go.  What to
unmap is returned, never unmapped here: the unmapper does that between copies.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from .engine import Mapped


class ChunkMaps:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # anything below changed
        self._chunks: dict[str, Mapped] = {}
        self._refs: dict[str, int] = {}  # chunk -> copies using it
        self._doomed: set[str] = set()  # released by the server while in use
        self._mapping: dict[str, list[int]] = {}  # sent to be mapped, not mapped yet: their sizes, in order
        self._released_early: dict[str, int] = {}  # of those, how many were released meanwhile
        self._copying = 0  # copies under way; the unmapping waits for none

    def expect(self, ids: Iterable[str], sizes: Iterable[int]) -> None:
        """Chunks sent to be mapped (a copy sent after them waits for them)."""
        with self._lock:
            for chunk, size in zip(ids, sizes):
                self._mapping.setdefault(chunk, []).append(size)

    def mapped(self, chunk: str, mapping: Mapped) -> Mapped | None:
        """An expected chunk is mapped; returns a mapping to let go (this one, if the
        chunk was released meanwhile; an older one of the same id), or None."""
        with self._changed:
            pending = self._mapping[chunk]
            pending.pop(0)
            if not pending:
                del self._mapping[chunk]
            dropped = self._released_early.get(chunk, 0)
            if dropped:  # released before it was mapped
                self._released_early[chunk] = dropped - 1
                if dropped == 1:
                    del self._released_early[chunk]
                old = mapping
            else:
                old = self._chunks.pop(chunk, None)
                self._chunks[chunk] = mapping
            self._changed.notify_all()
        return old

    def release(self, chunks: Iterable[str]) -> list[Mapped]:
        """The server released them: the mappings to let go now (those in use go
        when their copy ends; those being mapped, once mapped)."""
        now = []
        with self._lock:
            for chunk in chunks:
                if self._refs.get(chunk):
                    self._doomed.add(chunk)
                    continue
                if chunk in self._mapping:  # each mapping sent before the release goes once made
                    self._released_early[chunk] = len(self._mapping[chunk])
                if chunk in self._chunks:
                    now.append(self._chunks.pop(chunk))
        return now

    def claim(self, chunks: list[str], sizes: list[int]) -> str:
        """A copy of ``sizes`` bytes into or out of ``chunks`` (one per move) holds
        them until :meth:`end_copy`; '' or why it may not."""
        with self._lock:
            live = {c: self._live_size(c) for c in chunks}
            missing = [c for c, size in live.items() if size is None]
            if missing:
                return f"{len(missing)} chunks are not mapped here (e.g. {missing[0]!r})"
            if any(size > live[chunk] for chunk, size in zip(chunks, sizes)):
                return "a move is larger than its chunk"
            for chunk in live:
                self._refs[chunk] = self._refs.get(chunk, 0) + 1
        return ""

    def _live_size(self, chunk: str) -> int | None:
        """The size of the chunk a copy sent now would use (mapped, or being mapped
        and not released since); None if there is none.  With the lock held."""
        if chunk in self._doomed:
            return None
        pending = self._mapping.get(chunk, ())
        if len(pending) > self._released_early.get(chunk, 0):
            return pending[-1]
        mapped = self._chunks.get(chunk)
        return None if mapped is None else mapped.size

    def start_copy(self, chunks: Iterable[str], stopping: Callable[[], bool]) -> None:
        """A copy begins once the chunks it names that are still being mapped are."""
        wanted = set(chunks)
        with self._changed:
            self._copying += 1
            self._changed.wait_for(lambda: wanted.isdisjoint(self._mapping) or stopping())

    def addresses(self, chunks: Iterable[str]) -> dict[str, int]:
        with self._lock:
            return {c: self._chunks[c].va for c in set(chunks)}

    def end_copy(self, chunks: Iterable[str]) -> list[Mapped]:
        """A copy that used ``chunks`` ended: the mappings released meanwhile, to let go."""
        now = []
        with self._changed:
            self._copying -= 1
            self._changed.notify_all()
            for chunk in set(chunks):
                self._refs[chunk] -= 1
                if not self._refs[chunk]:
                    del self._refs[chunk]
                    if chunk in self._doomed:
                        self._doomed.discard(chunk)
                        now.append(self._chunks.pop(chunk, None))  # None: its mapping failed (we stop)
        return [mapped for mapped in now if mapped is not None]

    def wait_quiet(self, timeout: float) -> None:
        """Until no copy runs (or ``timeout``)."""
        with self._changed:
            self._changed.wait_for(lambda: not self._copying, timeout=timeout)

    def wake_all(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def take_all(self) -> list[Mapped]:
        """Every live mapping, the table emptied (the copier's end)."""
        with self._lock:
            everything, self._chunks = list(self._chunks.values()), {}
        return everything
