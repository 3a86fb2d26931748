"""The client side: the memory manager, its transport, and the probes."""

from .manager import GMSClientMemoryManager, HandleInfo, Mapping
from .probes import EventHistory, HistoryEvent, get_event_history, get_runtime_state, iter_event_history

__all__ = [
    "EventHistory",
    "GMSClientMemoryManager",
    "HandleInfo",
    "HistoryEvent",
    "Mapping",
    "get_event_history",
    "get_runtime_state",
    "iter_event_history",
]
