"""What the event log keeps in memory, estimated cheaply enough to count on every append.

An entry costs its objects (the entry, the event, its ints: about 256 bytes
measured with tracemalloc on CPython 3.11) plus its strings, bytes and dicts
(a metadata value is most of a MetadataPut).  A retained chunk's start state
shares almost everything with the live state (persistent maps); what it keeps
alive on its own is metadata the live state has since dropped or replaced,
and only the oldest chunk's start state (the snapshot) can hold any that no
kept event holds too: every value a later chunk's start state holds was put
by a kept event, or was there at the snapshot already.  What a start state
holds of the maps' structure is charged to the events that changed a map:
the nodes a put or a delete copies (its path) stay alive in the start state
of its chunk.  Measured with tracemalloc, 200,000 puts into one layout held
523 bytes each where the count said 287 (issue 59); with the path, 543.
"""

from __future__ import annotations

import functools

import attrs

from ..fsm.events import Event
from ..fsm.node import NodeState

ENTRY_BYTES = 256
PATH_BYTES = 256  # a metadata put or delete: the map nodes it copied, kept by its chunk's start state
_PATHS = frozenset({"METADATA_PUT", "METADATA_DELETED"})
# Past this many keys a changed layout's metadata is counted whole rather than
# compared entry by entry (the comparison runs at each chunk boundary).
_COMPARE_KEYS = 10_000


@functools.cache
def _payload(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in attrs.fields(cls) if f.type in ("str", "bytes", "dict"))


def entry_bytes(event: Event) -> int:
    """The memory one logged event holds, roughly (never less than its payload)."""
    total = ENTRY_BYTES + (PATH_BYTES if event.KIND in _PATHS else 0)
    for name in _payload(type(event)):
        value = getattr(event, name)
        total += len(repr(value)) if isinstance(value, dict) else len(value)
    return total


def pinned_bytes(snapshot: NodeState, live: NodeState) -> int:
    """Metadata bytes ``snapshot`` keeps alive that ``live`` does not hold (an upper bound)."""
    total = 0
    for name, layout in snapshot.layouts.items():
        now = live.layouts.get(name)
        if now is not None and now.metadata is layout.metadata:
            continue
        if now is None or len(layout.metadata) > _COMPARE_KEYS:
            total += layout.metadata_bytes
            continue
        for key, entry in layout.metadata.items():
            if now.metadata.get(key) is not entry:
                total += len(key.encode()) + len(entry.value)
    return total
