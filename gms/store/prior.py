"""Events logged before this server's log began: kept by the keeper, shown, never folded.

A restarted server rebuilds its state from its keeper's base and the events
after that base.  What was logged before the base (by this node's earlier
servers) the keeper kept too, as the encoded batches the servers sent it;
the new server shows them in its history (``gms history``, and so ``gms
replay`` of a saved history covers the restart) but never folds them, and
decodes a batch only when a reader asks for it: a restart folds nothing
more for a long history (it still carries the bytes from the keeper).  They count against the log's bounds like its own
entries (their encoded bytes), and go first, oldest first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

import attrs


@attrs.frozen
class Batch:
    """Entries ``first_seq`` .. ``last_seq`` (``count`` of them: a crash's gap may
    lie between), encoded as the server sent them to its keeper."""

    first_seq: int
    last_seq: int
    count: int
    blob: bytes


class Prior:
    """The batches before a log's own entries, oldest first, decoded when read
    (``decode``: the encoding's reader; one batch decoded is kept for the next read)."""

    def __init__(self, batches: Iterable[Batch], decode: Callable[[bytes], list]) -> None:
        self.batches: deque[Batch] = deque(batches)
        self._decode = decode
        self._decoded: tuple[Batch, list] | None = None
        self.count = sum(b.count for b in self.batches)
        self.bytes = sum(len(b.blob) for b in self.batches)

    @property
    def first_seq(self) -> int | None:
        return self.batches[0].first_seq if self.batches else None

    def drop_oldest(self) -> None:
        batch = self.batches.popleft()
        self.count -= batch.count
        self.bytes -= len(batch.blob)

    def entries(self, batch: Batch) -> list:
        """``batch``'s entries; one that does not decode shows as none (a history
        probe never fails the server for a batch a keeper kept)."""
        if self._decoded is None or self._decoded[0] is not batch:
            try:
                entries = self._decode(batch.blob)
            except Exception:  # noqa: BLE001 - whatever the reader raises: nothing to show
                entries = []
            self._decoded = (batch, entries)
        return self._decoded[1]

    def since(self, since_seq: int, limit: int) -> list:
        """Entries with ``seq > since_seq``, oldest first, at most ``limit``."""
        out: list = []
        for batch in self.batches:
            if len(out) >= limit:
                break
            if batch.last_seq <= since_seq:
                continue
            out += [e for e in self.entries(batch) if e.seq > since_seq][: limit - len(out)]
        return out

    def entry(self, seq: int):
        for batch in self.batches:
            if batch.first_seq <= seq <= batch.last_seq:
                return next((e for e in self.entries(batch) if e.seq == seq), None)
        return None


def batches(rows: Iterable, before_seq: int) -> list[Batch]:
    """A keeper's history rows (``[first_seq, last_seq, count, blob]``) as batches:
    well-formed, ascending, all before ``before_seq``; others are left out."""
    out: list[Batch] = []
    last = 0
    for row in rows:
        try:
            first_seq, last_seq, count, blob = row
        except (TypeError, ValueError):
            continue
        if not (isinstance(blob, bytes) and all(isinstance(v, int) and not isinstance(v, bool)
                                                for v in (first_seq, last_seq, count))):
            continue
        if last < first_seq <= last_seq < before_seq and 0 < count <= last_seq - first_seq + 1:
            out.append(Batch(first_seq, last_seq, count, blob))
            last = last_seq
    return out
