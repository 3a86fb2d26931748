"""Server-side limits on what one layout (and one node) may hold (all configurable).

They travel in ``SERVER_STARTED``, so the fold enforces the limits the server
ran with, and a replay (or a newer server taking over) enforces the same.
"""

from __future__ import annotations

import attrs


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

    def as_dict(self) -> dict:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> Limits:
        """Unknown names are ignored: a log from a newer server still folds."""
        names = {field.name for field in attrs.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})
