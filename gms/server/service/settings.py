"""What one node's core runs with: its configuration resolved against its device
(``gms.server.assembly.settings_for``), declared once, frozen."""

from __future__ import annotations

import attrs

from ...fsm import Limits
from ...operator.policy import OPEN_POLICY, Policy
from .requests import DEFAULT_SCAN_CACHE_BYTES


@attrs.frozen
class Settings:
    server_uid: int  # its own uid: an admin's, and the only one (with root) that may take it over
    policy: Policy = OPEN_POLICY
    limits: Limits = attrs.field(factory=Limits)
    budget_bytes: int | None = None  # GPU bytes the node may hold (None: the device's)
    host_budget_bytes: int | None = None  # host copies (None: unbounded)
    disk_budget_bytes: int | None = None  # snapshots and loose files (None: what the disk holds)
    history_max_events: int = 10_000  # one GetEventHistory answer's bounds
    history_max_bytes: int = 8 << 20
    alloc_retry_interval: float = 0.05  # waiting for memory: how often, how long (None: as asked)
    alloc_retry_timeout: float | None = None
    scan_cache_bytes: int = DEFAULT_SCAN_CACHE_BYTES
