"""The gms calls ``gms.ray`` makes, in one place: finding a GPU's server,
reading what it lends, and opening a session bound to a byte limit."""

from __future__ import annotations

from ..client import GMSClientMemoryManager, get_runtime_state
from ..system import paths


def server_socket(device: int, backend: str, directory: str | None = None) -> str:
    """The socket of the gms server of ``device`` (in ``$GMS_SOCKET_DIR`` unless given)."""
    return paths.socket_path_in(directory or paths.socket_dir(), paths.device_id(device, backend))


def read_state(socket_path: str, timeout: float = 5.0):
    return get_runtime_state(socket_path, timeout=timeout)


def budget_bytes(state) -> int | None:
    """The bytes gms lends on this GPU: its budget (the device's size unless --gpu-budget)."""
    return state.budget_bytes if state.budget_bytes is not None else state.capacity_bytes


def used_bytes(state) -> int:
    """Layout bytes the server holds on the GPU now."""
    return state.used_bytes


def open_session(
    socket_path: str, *, device: int, layout: str, lock_type, timeout_ms: int | None, limit_bytes: int
) -> GMSClientMemoryManager:
    """A manager of ``layout`` on ``device``'s server, connected with ``limit_bytes``."""
    manager = GMSClientMemoryManager(socket_path, device=device, layout=layout)
    try:
        manager.connect(lock_type, timeout_ms, limit_bytes=limit_bytes)
    except BaseException:
        manager.close()
        raise
    return manager
