"""Wakes sessions waiting for memory when the server releases some."""

from __future__ import annotations

import trio


class MemorySignal:
    def __init__(self) -> None:
        self._event = trio.Event()

    def next_release(self) -> trio.Event:
        """Set at the next release after this call."""
        return self._event

    def released(self) -> None:
        self._event.set()
        self._event = trio.Event()
