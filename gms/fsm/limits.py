"""Server-side limits on what one layout (and one node) may hold (all configurable).

They travel in ``SERVER_STARTED``, so the fold enforces the limits the server
ran with, and a replay (or a newer server taking over) enforces the same.
"""

from __future__ import annotations

import attrs

# Limits a log written before they existed did not enforce: folding such a log
# must not refuse what its server accepted, so they read as "no bound" there
# (and its metadata entries as charged nothing but their bytes).
_ADDED_LATER = {
    "max_metadata_bytes": None, "tenant_metadata_quota": None, "tenant_max_layouts": None, "metadata_entry_bytes": 0,
}


@attrs.frozen
class Limits:
    max_layouts: int = 4096
    max_allocations: int = 1 << 20
    max_metadata_keys: int = 1 << 20
    max_metadata_value_bytes: int = 1 << 20
    max_key_bytes: int = 1024
    max_tag_bytes: int = 256
    # None: no cap beyond what the backend can create (the server sets the
    # device's size, so an impossible request is refused, not waited on).
    max_allocation_bytes: int | None = None
    # Metadata (keys and values) lives in the daemon's RAM, not on the GPU:
    # bounded for the whole node, and per tenant by its metadata quota.
    max_metadata_bytes: int | None = 256 << 20
    # What a policy tenant gets where the policy names none (the fold reads each
    # tenant's resolved figures from SERVER_STARTED's ``tenant_limits``).
    tenant_metadata_quota: int | None = 64 << 20
    tenant_max_layouts: int | None = 256
    # What a metadata entry costs beyond its key and value, charged to its owner's
    # metadata quota and to the node's bound: the daemon's RAM per entry (its
    # tuple, the maps' nodes, the index; about 220 bytes measured, docs/operations.md).
    # Without it, 2 million 6-byte entries passed as 12 MB and cost 1.3 GiB.
    metadata_entry_bytes: int = 256

    def as_dict(self) -> dict:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> Limits:
        """Unknown names are ignored: a log from a newer server still folds.
        Limits added since a log was written are absent from it: unbounded."""
        names = {field.name for field in attrs.fields(cls)}
        missing = {name: absent for name, absent in _ADDED_LATER.items() if name not in values}
        return cls(**missing, **{k: v for k, v in values.items() if k in names})
