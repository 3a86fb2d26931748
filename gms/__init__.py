"""gms: a GPU Memory Service.

A per-GPU daemon owns GPU memory (CUDA VMM, or host memory where there is no
GPU) and hands it to processes as file descriptors; the connection is the
lock.  Client code imports the manager from here::

    from gms import GMSClientMemoryManager, RequestedLockType
"""

from .client import (
    EventHistory,
    GMSClientMemoryManager,
    HandleInfo,
    HistoryEvent,
    get_event_history,
    get_runtime_state,
)
from .errors import (
    GMSConnectionError,
    GMSError,
    GMSProtocolError,
    GMSServerError,
    GMSUsageError,
    LockTimeoutError,
    QuotaExceededError,
    StaleMemoryLayoutError,
)
from .fsm import GrantedLockType, RequestedLockType, Residency
from .paths import socket_path

__version__ = "0.1.0"

__all__ = [
    "EventHistory",
    "GMSClientMemoryManager",
    "GMSConnectionError",
    "GMSError",
    "GMSProtocolError",
    "GMSServerError",
    "GMSUsageError",
    "GrantedLockType",
    "HandleInfo",
    "HistoryEvent",
    "LockTimeoutError",
    "QuotaExceededError",
    "RequestedLockType",
    "Residency",
    "StaleMemoryLayoutError",
    "get_event_history",
    "get_runtime_state",
    "socket_path",
]
