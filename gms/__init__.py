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
    BuildLostError,
    GMSConnectionError,
    GMSError,
    GMSProtocolError,
    GMSServerError,
    GMSUsageError,
    LimitExceededError,
    LockRevokedError,
    LockTimeoutError,
    QuotaExceededError,
    RequestTooLargeError,
    ResponseTimeoutError,
    ServerGoneError,
    SessionEndedError,
    SnapshotNotServedError,
    StaleMemoryLayoutError,
    UntrustedServerError,
)
from .fsm import GrantedLockType, RequestedLockType, Residency
from .system.paths import socket_path

__version__ = "0.1.0"

__all__ = [
    "BuildLostError",
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
    "LimitExceededError",
    "LockRevokedError",
    "LockTimeoutError",
    "QuotaExceededError",
    "RequestTooLargeError",
    "RequestedLockType",
    "Residency",
    "ResponseTimeoutError",
    "ServerGoneError",
    "SessionEndedError",
    "SnapshotNotServedError",
    "StaleMemoryLayoutError",
    "UntrustedServerError",
    "get_event_history",
    "get_runtime_state",
    "socket_path",
]
