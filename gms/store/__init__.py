"""The event log the server appends to and the history probe reads."""

from .log import EventLog, Folded, LogEntry, Snapshot, StaleFold, replay

__all__ = ["EventLog", "Folded", "LogEntry", "Snapshot", "StaleFold", "replay"]
