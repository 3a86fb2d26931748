"""The memory layout hash: a SHA-256 over the layout's structure.

Allocations are taken in layout-slot order and identified by their rank in
that order, never by id, so the same structure built twice hashes the same.
The encoding is length-prefixed (big-endian u64), so no two layouts share
a byte stream.  It is part of the protocol contract (docs/protocol.md).
"""

from __future__ import annotations

import hashlib
import operator
import struct
from collections.abc import Iterable

from .errors import InvariantViolation
from .state import Allocation, MetadataEntry

_DOMAIN = b"gms-layout-v1\x00"
_u64 = struct.Struct(">Q").pack
_u64x3 = struct.Struct(">QQQ").pack  # an entry's allocation rank, offset and value length, together
_key = operator.itemgetter(0)


def _blob(data: bytes) -> bytes:
    return _u64(len(data)) + data


def compute_layout_hash(
    allocations: Iterable[Allocation], metadata: Iterable[MetadataEntry]
) -> str:
    # A restart checks every committed layout's hash before it serves (200,000
    # entries in about a quarter of a second on the 2-core host): the entry loop
    # is kept to one pack and four appends.
    ranked = sorted(allocations, key=lambda a: a.layout_slot)
    rank = {a.allocation_id: i for i, a in enumerate(ranked)}
    entries = sorted(metadata, key=_key)
    parts = [_DOMAIN, _u64(len(ranked))]
    for a in ranked:
        parts += (_u64(a.size), _u64(a.aligned_size), _blob(a.tag.encode()))
    parts.append(_u64(len(entries)))
    add = parts.append
    for key, allocation_id, offset, value in entries:
        try:
            allocation_rank = rank[allocation_id]
        except KeyError:
            raise InvariantViolation(
                f"metadata {key!r} points to missing allocation {allocation_id!r}"
            ) from None
        encoded = key.encode()
        add(_u64(len(encoded)))
        add(encoded)
        add(_u64x3(allocation_rank, offset, len(value)))
        add(value)
    return hashlib.sha256(b"".join(parts)).hexdigest()
