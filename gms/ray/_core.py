"""Every call ``gms.ray`` makes into the gms core API that is being rewritten.

The core is moving to one server per GPU (one socket, many named layouts),
per-session byte limits (``connect(..., limit_bytes=)``) and a GPU budget in
the runtime state.  Each such call is here, feature-detected, so the rest of
``gms.ray`` is written against the new API and the rebase touches one file.
"""

from __future__ import annotations

import inspect

from .. import errors, paths
from ..client import GMSClientMemoryManager, get_runtime_state

# Today's servers are one per (device, tag); any tag's state names its device.
_TODAY_TAG = "weights"


def _one_socket_per_gpu() -> bool:
    return "tag" not in inspect.signature(paths.socket_path).parameters


def server_socket(device: int, backend: str, directory: str | None = None) -> str:
    """The socket of the gms server of ``device`` (in ``$GMS_SOCKET_DIR`` unless given)."""
    directory = directory or paths.socket_dir()
    device_id = paths.device_id(device, backend)
    if _one_socket_per_gpu():
        return paths.socket_path_in(directory, device_id)  # NEW: gms_<uuid | host-N>.sock
    return paths.socket_path_in(directory, device_id, _TODAY_TAG)


def read_state(socket_path: str, timeout: float = 5.0):
    return get_runtime_state(socket_path, timeout=timeout)


def budget_bytes(state) -> int | None:
    """The bytes gms lends on this GPU: its budget, or (today) the device's total."""
    budget = getattr(state, "budget_bytes", None)  # NEW: = capacity unless --gpu-budget
    return budget if budget is not None else state.device_total_bytes


def used_bytes(state) -> int:
    """Bytes the server holds for clients now."""
    used = getattr(state, "used_bytes", None)  # NEW
    return used if used is not None else state.server_handle_bytes


def has_session_limits() -> bool:
    """Whether this gms client can narrow a session to a byte limit at connect."""
    return "limit_bytes" in inspect.signature(GMSClientMemoryManager.connect).parameters


def quota_exceeded_error() -> type[BaseException] | None:
    return getattr(errors, "QuotaExceededError", None)  # NEW


def open_session(
    socket_path: str, *, device: int, layout: str, lock_type, timeout_ms: int | None, limit_bytes: int
) -> GMSClientMemoryManager:
    """A manager of ``layout`` on ``device``'s server, connected with ``limit_bytes``."""
    manager = GMSClientMemoryManager(socket_path, device=device, layout=layout)  # NEW: layout=
    try:
        manager.connect(lock_type, timeout_ms, limit_bytes=limit_bytes)  # NEW: limit_bytes=
    except BaseException:
        manager.close()
        raise
    return manager
