"""Wakes sessions waiting for memory when the server releases some."""

from __future__ import annotations

import trio


class MemorySignal:
    def __init__(self) -> None:
        self._event = trio.Event()
        self._watched = False  # someone holds the current event

    def next_release(self) -> trio.Event:
        """Set at the next release after this call."""
        self._watched = True
        return self._event

    def watched(self) -> bool:
        """Does a session wait for the next release?"""
        return self._watched

    def released(self) -> None:
        if self._watched:  # else nobody waits: most releases (every free) cost nothing here
            self._event.set()
            self._event = trio.Event()
            self._watched = False
