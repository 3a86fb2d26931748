"""Frames on their way to the keeper, as positions in one byte stream (sans I/O).

Frames are *queued* as they are made, then *handed on* to the out queue in
order, as few segments as their fds allow (at most ``frames.MAX_FDS`` ride
one system call), and *taken* by the kernel a piece at a time.  Each layout's
last lasting change is a mark: the position where the frame that told of it
ends, so an answer about that layout waits until the kernel took that far
(:meth:`FrameQueue.target`).  The keeper stream (``keeper_stream``) says what
the frames are; this says where they are.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from ...handover import frames

SOON_FRAMES = 64  # past this many queued frames, a flush hands them on at once


class Segment:
    """Bytes handed on, with the fds (ours: dups) that ride their first byte."""

    __slots__ = ("data", "fds")

    def __init__(self, data: memoryview, fds: list[int]) -> None:
        self.data = data
        self.fds = fds


class FrameQueue:
    def __init__(self, close_fds: Callable[[Iterable[int]], None]) -> None:
        self._close = close_fds
        self.soon = False  # frames wait for the shell's hand-on within SOON_S
        # Frames not handed on yet: (bytes, their fds, the layouts they change lastingly).
        self._queued: list[tuple[bytes, list[int], frozenset[str]]] = []
        # Layout ("": the node) -> where in the stream its last lasting change ends.
        self._marks: dict[str, int] = {}
        self.out: deque[Segment] = deque()  # frames handed on, not yet taken by the kernel
        self.enqueued = 0  # bytes handed on since the start
        self.sent = 0  # of which the kernel took

    def queue(self, frame: bytes, fds: list[int], lasting: frozenset[str]) -> None:
        self._queued.append((frame, fds, lasting))

    @property
    def waiting(self) -> bool:
        """Frames queued or handed on that the kernel has not taken."""
        return bool(self.out) or bool(self._queued)

    def flush(self, soon: bool = False) -> bool | None:
        """Hand every queued frame on, in order.  ``soon``: unless a queued frame
        tells of a lasting change (or many wait), leave them for the shell's
        hand-on instead.  True: left so (``soon`` is set); False: handed on;
        None: nothing was queued."""
        if not self._queued:
            return None
        if soon and len(self._queued) < SOON_FRAMES and not any(lasting for _, _, lasting in self._queued):
            if self.soon:
                return None  # (the shell knows already)
            self.soon = True
            return True
        self.soon = False
        queued, self._queued = self._queued, []
        batch: list[bytes] = []
        fds: list[int] = []
        lasting: set[str] = set()
        for frame, frame_fds, layouts in queued:
            if batch and len(fds) + len(frame_fds) > frames.MAX_FDS:
                self._hand_on(b"".join(batch), fds, lasting)
                batch, fds, lasting = [], [], set()
            batch.append(frame)
            fds += frame_fds
            lasting |= layouts
        if batch:
            self._hand_on(b"".join(batch), fds, lasting)
        return False

    def _hand_on(self, data: bytes, fds: list[int], lasting: set[str]) -> None:
        self.out.append(Segment(memoryview(data), fds))
        self.enqueued += len(data)
        for layout in lasting:
            self._marks[layout] = self.enqueued

    def next_segment(self) -> Segment | None:
        return self.out[0] if self.out else None

    def took(self, n: int) -> None:
        """The kernel took ``n`` bytes of the next segment (its fds with the first)."""
        segment = self.out[0]
        self._close(segment.fds)
        segment.fds = []
        if n < len(segment.data):
            segment.data = segment.data[n:]
        else:
            self.out.popleft()
        self.sent += n

    def position(self) -> int:
        """Bytes handed to the stream so far, queued ones included."""
        return self.enqueued + sum(len(frame) for frame, _, _ in self._queued)

    def target(self, layouts: Iterable[str] | None = None) -> int:
        """Where in the stream the last lasting change of ``layouts`` (and of the
        node) ends; everything handed on, for None."""
        if layouts is None:
            return self.enqueued
        marks, sent = self._marks, self.sent
        target = 0
        for layout in (*layouts, ""):
            mark = marks.get(layout, 0)
            if mark > sent:
                target = max(target, mark)
            elif mark:
                del marks[layout]  # taken: forgotten
        return target

    def backlog_bytes(self) -> int:
        return self.position() - self.sent

    def drop(self) -> None:
        """The channel is done: every frame's fds closed, nothing waited for."""
        while self.out:
            self._close(self.out.popleft().fds)
        for _, fds, _ in self._queued:
            self._close(fds)
        self._queued, self._marks = [], {}
        self.soon = False
        self.sent = self.enqueued
