"""The memory layout hash: a SHA-256 over the layout's structure.

Allocations are taken in layout-slot order and identified by their rank in
that order, never by id, so the same structure built twice hashes the same.
The encoding is length-prefixed (big-endian u64), so no two layouts share
a byte stream.  It is part of the protocol contract (docs/protocol.md).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable

from .errors import InvariantViolation
from .state import Allocation, MetadataEntry

_DOMAIN = b"gms-layout-v1\x00"
_u64 = struct.Struct(">Q").pack


def _blob(data: bytes) -> bytes:
    return _u64(len(data)) + data


def compute_layout_hash(
    allocations: Iterable[Allocation], metadata: Iterable[MetadataEntry]
) -> str:
    ranked = sorted(allocations, key=lambda a: a.layout_slot)
    rank = {a.allocation_id: i for i, a in enumerate(ranked)}
    entries = sorted(metadata, key=lambda m: m.key)
    parts = [_DOMAIN, _u64(len(ranked))]
    for a in ranked:
        parts += (_u64(a.size), _u64(a.aligned_size), _blob(a.tag.encode()))
    parts.append(_u64(len(entries)))
    for m in entries:
        try:
            allocation_rank = rank[m.allocation_id]
        except KeyError:
            raise InvariantViolation(
                f"metadata {m.key!r} points to missing allocation {m.allocation_id!r}"
            ) from None
        parts += (
            _blob(m.key.encode()),
            _u64(allocation_rank),
            _u64(m.offset_bytes),
            _blob(m.value),
        )
    return hashlib.sha256(b"".join(parts)).hexdigest()
