"""Server-side limits on what one layout (and one node) may hold (all configurable).

They travel in ``SERVER_STARTED``, so the fold enforces the limits the server
ran with, and a replay (or a newer server taking over) enforces the same.
"""

from __future__ import annotations

import attrs

# Limits a log written before they existed did not enforce: folding such a log
# must not refuse what its server accepted, so they read as "no bound" there.
_ADDED_LATER = ("max_metadata_bytes", "tenant_metadata_quota", "tenant_max_layouts")


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
    max_metadata_bytes: int | None = 1 << 30
    # What a policy tenant gets where the policy names none (the fold reads each
    # tenant's resolved figures from SERVER_STARTED's ``tenant_limits``).
    tenant_metadata_quota: int | None = 64 << 20
    tenant_max_layouts: int | None = 256

    def as_dict(self) -> dict:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> Limits:
        """Unknown names are ignored: a log from a newer server still folds.
        Limits added since a log was written are absent from it: unbounded."""
        names = {field.name for field in attrs.fields(cls)}
        missing = {name: None for name in _ADDED_LATER if name not in values}
        return cls(**missing, **{k: v for k, v in values.items() if k in names})
