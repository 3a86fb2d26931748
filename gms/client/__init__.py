"""The client side: the memory manager, its transport, the probes and the admin verbs."""

from . import admin
from .manager import GMSClientMemoryManager, HandleInfo, Mapping
from .probes import EventHistory, HistoryEvent, get_event_history, get_runtime_state, iter_event_history

__all__ = [
    "admin",
    "EventHistory",
    "GMSClientMemoryManager",
    "HandleInfo",
    "HistoryEvent",
    "Mapping",
    "get_event_history",
    "get_runtime_state",
    "iter_event_history",
]
