"""Everything one server (one device, one tag, one socket) is configured with."""

from __future__ import annotations

import attrs

from ..fsm import Limits
from ..wire import DEFAULT_MAX_FRAME_BYTES


@attrs.frozen
class ServerConfig:
    socket_path: str
    device: int = 0
    tag: str = "weights"
    backend: str = "auto"
    host_capacity: int | None = None
    alloc_retry_interval: float = 0.5
    alloc_retry_timeout: float | None = None
    socket_mode: int = 0o600
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    limits: Limits = Limits()
    event_log_retain: int | None = 1_000_000
    history_max_events: int = 10_000
    history_max_bytes: int = 8 << 20
