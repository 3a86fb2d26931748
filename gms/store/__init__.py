"""The event log the server appends to and the history probe reads."""

from .log import EventLog, LogEntry, Snapshot, replay

__all__ = ["EventLog", "LogEntry", "Snapshot", "replay"]
