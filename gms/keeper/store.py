"""What a keeper holds for one device: fds by key, and the journal (a base and the events after it).

The keeper never reads what it keeps: the base's parts and log entries are
opaque bytes, fds are numbers under keys the server chose (``listener``,
``gpu:<id>``, ``host:<id>``).  :meth:`Store.apply` takes the server's frames
(``gms.server.restart.mirror`` says what each means) in the order they came; the
hand-back is what the next server gets.  An fd is kept until the server
releases it, a base leaves it out, or the node is dropped.  The base is kept
in parts (``gms.handover.journal``): ``part`` frames stage the parts that
changed, and ``base`` names every part of the new base, taking the others
from the one it replaces, and how many of the events sent meanwhile are
after it (an older server sends whole images instead).  The events a new
base leaves behind are kept as the *history* (bounded, oldest dropped
first): the next server shows them but does not fold them
(``gms.store.prior``), so its history spans the restart.  Of each batch the
keeper knows only the numbers the server named beside it.  Pure but for
closing fds, and tested without processes.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable

from ..handover.frames import Frame
from ..handover.words import Mode, Say

LISTENER = "listener"
# The history a keeper keeps for the next server: the log's default bounds
# (--event-log-bytes, --event-log-retain); a server shows at most its own.
HISTORY_BYTES = 64 << 20
HISTORY_ENTRIES = 1_000_000
FEATURES = ["parts"]  # what this keeper understands beyond the first version's frames


class Store:
    def __init__(self, on_fd: Callable[[str, int | None], None] | None = None) -> None:
        """``on_fd(key, fd)`` is told of every fd kept (``fd``) or let go (None):
        systemd's fd store mirrors the keeper's (``gms.keeper.systemd``)."""
        self.fds: dict[str, int] = {}
        self.base: bytes | dict[str, bytes] | None = None  # an image, or its parts by key
        self.tails: list[bytes] = []
        self._spans: list[tuple[int, int, int] | None] = []  # each tail's (first, last, count), as the server said
        self.history: deque[tuple[int, int, int, bytes]] = deque()  # batches before the base: (first, last, count, blob)
        self._history_bytes = self._history_entries = 0
        self._staged: dict[str, bytes] = {}  # parts of a base on its way
        self.provisional: int | None = None  # a take-over's node, not committed: the old server's pid
        self.failed_resumes = 0
        self.retired = False
        self.old_pid = 0
        self.reason = ""
        # The last server said it left (STOPPING after every frame before it): the
        # journal is whole, and the next server numbers on with no gap.
        self.whole = False
        self.on_fd: Callable[[str, int | None], None] = on_fd or (lambda key, fd: None)
        # Told of the journal as it changes: ("base", bytes) or ("events", bytes).
        self.on_journal: Callable[[str, bytes], None] = lambda kind, data: None

    # -- holding --------------------------------------------------------------------

    def hold(self, key: str, fd: int) -> None:
        old = self.fds.get(key)
        if old is not None and old != fd:
            os.close(old)
        self.fds[key] = fd
        self.on_fd(key, fd)

    def release(self, key: str) -> None:
        fd = self.fds.pop(key, None)
        if fd is not None:
            os.close(fd)
            self.on_fd(key, None)

    def keep_only(self, keys: set[str]) -> None:
        for key in [k for k in self.fds if k not in keys]:
            self.release(key)

    def holds_node(self) -> bool:
        """A journal, or memory: something a server could still serve."""
        return self.base is not None or any(key != LISTENER for key in self.fds)

    def drop_node(self, *, keep_listener: bool) -> None:
        """Forget the node: its memory's fds and journal (and the listener unless kept)."""
        self.keep_only({LISTENER} if keep_listener else set())
        self.base, self.tails, self.provisional, self.failed_resumes = None, [], None, 0
        self._spans, self.history, self._history_bytes, self._history_entries = [], deque(), 0, 0
        self._staged = {}
        self.on_journal("base", b"")

    # -- the server's frames ----------------------------------------------------------

    def apply(self, frame: Frame) -> Say | None:
        """Take one frame from the server; returns what the conversation acts on
        (``RELEASED``: acknowledge; ``READY``, ``TAKING``, ``STOPPING``), else None."""
        kind, body = frame.kind, frame.body
        if kind == Say.HOLD:
            keys = body.get("keys", [])
            if len(keys) != len(frame.fds):
                frame.close_fds()
                raise ValueError(f"hold with {len(keys)} keys and {len(frame.fds)} fds")
            for key, fd in zip(keys, frame.fds):
                self.hold(key, fd)
            if "provisional" in body:  # a take-over's first fds: not this keeper's node until CONFIRM
                self.provisional = body["provisional"]
            return None
        frame.close_fds()  # only holds carry fds
        if kind == Say.RELEASE:
            for key in body.get("keys", []):
                self.release(key)
            if body.get("ack"):
                return Say.RELEASED
        elif kind == Say.EVENTS:
            self.tails.append(body["entries"])
            span = body.get("span")
            self._spans.append(tuple(span) if isinstance(span, list | tuple) and len(span) == 3 else None)
            self.on_journal("events", body["entries"])
        elif kind == Say.PART:
            self._staged[body["key"]] = body["data"]
        elif kind == Say.BASE:
            self._new_base(body)
        elif kind == Say.CONFIRM:
            self.provisional = None
        elif kind == Say.READY:
            self.failed_resumes = 0
            return Say.READY
        elif kind == Say.TAKING:  # a spare has the hand-back: it is alive, and takes the node
            return Say.TAKING
        elif kind == Say.STOPPING:
            return Say.STOPPING
        return None

    def _new_base(self, body: dict) -> None:
        if "parts" in body:
            old = self.base if isinstance(self.base, dict) else {}
            staged, self._staged = self._staged, {}
            try:
                base = {key: staged[key] if key in staged else old[key] for key in body["parts"]}
            except KeyError as missing:
                raise ValueError(f"a base names part {missing} that was never sent") from None
            keep = body.get("tails", 0)
            self._archive(len(self.tails) - keep)
            self.base, self.tails = base, self.tails[len(self.tails) - keep:] if keep else []
        else:
            self._archive(len(self.tails))
            self.base, self.tails = body["image"], []
        self.on_journal("base", self.base)
        for tail in self.tails:
            self.on_journal("events", tail)
        if "keys" in body:
            self.keep_only(set(body["keys"]))
        self._keep_history(tuple(row) for row in body.get("history", ()))  # a first server's events before its base
        if "provisional" in body:
            self.provisional = body["provisional"]

    def _archive(self, count: int) -> None:
        """The first ``count`` tails, which a new base leaves behind, into the history."""
        spans = [None] * (len(self.tails) - len(self._spans)) + self._spans  # (tails from systemd's journal: none)
        self._keep_history((*span, blob) for span, blob in zip(spans[:count], self.tails[:count]) if span is not None)
        self._spans = spans[count:]

    def _keep_history(self, batches) -> None:
        """``(first, last, count, blob)`` batches after those kept, the oldest dropped past the bounds."""
        for batch in batches:
            self.history.append(batch)
            self._history_entries += batch[2]
            self._history_bytes += len(batch[3])
        while self.history and (self._history_bytes > HISTORY_BYTES or self._history_entries > HISTORY_ENTRIES):
            _, _, n, blob = self.history.popleft()
            self._history_entries -= n
            self._history_bytes -= len(blob)

    # -- the next server --------------------------------------------------------------

    def handback(self) -> tuple[dict, list[tuple[str, int]]]:
        """(the hand-back frame's body, the (key, fd) pairs to send with it):
        ``retired`` (taken over by another server: serve nothing), ``fresh`` (an
        empty node; the listener if the keeper holds one, else the server binds
        or takes over) or ``resume`` (the last server's journal and fds)."""
        if self.retired:
            return {"mode": Mode.RETIRED.value, "features": FEATURES}, []
        if self.base is None:
            body = {"mode": Mode.FRESH.value, "features": FEATURES}
            if self.provisional is not None:  # a take-over's listener, perhaps still the old server's
                body["provisional"] = self.provisional
            return body, self._listener()
        body = {
            "mode": Mode.RESUME.value, "features": FEATURES, "base": self.base, "tails": list(self.tails), "old_pid": self.old_pid,
            "reason": self.reason, "failed_resumes": self.failed_resumes, "whole": self.whole,
            "history": [list(batch) for batch in self.history],
        }
        if self.provisional is not None:
            body["provisional"] = self.provisional
        return body, sorted(self.fds.items())

    def _listener(self) -> list[tuple[str, int]]:
        fd = self.fds.get(LISTENER)
        return [] if fd is None else [(LISTENER, fd)]

    def close(self) -> None:
        for key in list(self.fds):
            os.close(self.fds.pop(key))
