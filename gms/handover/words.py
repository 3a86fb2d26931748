"""The words a server and its keeper say to each other, typed, in one place.

The channel carries frames (``gms.handover.frames``) whose kinds are
:class:`Say`; a keeper's hand-back names a :class:`Mode`; a server that ends
on purpose says why (:class:`Leaving`) and the keeper acts on it
(``gms.keeper.run``); a take-over's image says what each session waits on
(:class:`Waiting`).  String enums: what travels is their value, so either
side reads a peer of an older version that spoke plain strings.

The conversation, in order, is :data:`CONVERSATION` (docs/architecture.md
draws it from there: ``sequence_diagram``).
"""

from __future__ import annotations

import enum


class Say(str, enum.Enum):
    """A frame's kind on the server-keeper channel."""

    HELLO = "hello"
    STANDBY = "standby"
    HANDBACK = "handback"
    FDS = "fds"
    END = "end"
    TAKING = "taking"
    HOLD = "hold"
    EVENTS = "events"
    RELEASE = "release"
    PART = "part"
    BASE = "base"
    CONFIRM = "confirm"
    READY = "ready"
    STOPPING = "stopping"
    RELEASED = "released"
    STOP = "stop"


class Mode(str, enum.Enum):
    """What a keeper's hand-back gives a starting server."""

    FRESH = "fresh"  # an empty node (and the listener, if the keeper holds one)
    RESUME = "resume"  # the last server's journal and memory
    RETIRED = "retired"  # this keeper's server was taken over by another: serve nothing


class Leaving(str, enum.Enum):
    """Why a server ends, as it tells its keeper before it goes (``STOPPING``),
    and what the keeper does then (``gms.keeper.run``)."""

    SHUTDOWN = "shutdown"  # a clean stop, every fd released: the keeper ends too
    TAKEN_OVER = "taken-over"  # another server holds the node: the keeper retires
    LEFT = "left"  # a signal, the node the keeper's: the next server at once
    REFUSED = "refused"  # the take-over it was asked for did not happen: the keeper ends (75)
    UNRESUMABLE = "unresumable"  # it cannot serve the kept node: the next one after a back-off
    STALE = "stale"  # a spare whose code is not gms's on disk now: a server from cold at once
    CRASHED = "crashed"  # the server's own word for a failure (it tells nothing): the node is kept

    @classmethod
    def read(cls, word: str) -> Leaving | None:
        """A peer's word (None: one this version does not know: the node is kept)."""
        try:
            return cls(word)
        except ValueError:
            return None


SERVER, KEEPER = "server", "keeper"

# (who says it, what, when): the conversation of one server with its keeper, in order.
CONVERSATION: tuple[tuple[str, str, str], ...] = (
    (SERVER, Say.HELLO, "{pid, device, version}"),
    (KEEPER, Say.STANDBY, "a spare: the rest when the server before it is gone"),
    (KEEPER, Say.HANDBACK, "{mode: " + " | ".join(m.value for m in Mode) + ", base, tails}"),
    (KEEPER, Say.FDS, "every fd it holds, 253 a frame"),
    (KEEPER, Say.END, ""),
    (SERVER, Say.TAKING, "a spare: alive, and it has the node"),
    (SERVER, Say.HOLD, "memory made (its fds), before its event"),
    (SERVER, Say.EVENTS, "log entries as stored"),
    (SERVER, Say.RELEASE, "memory let go, after its event"),
    (KEEPER, Say.RELEASED, "its fds closed: a waiter for memory may try again"),
    (SERVER, Say.PART, "a new base, the parts that changed"),
    (SERVER, Say.BASE, "the base whole (its parts named)"),
    (SERVER, Say.CONFIRM, "a take-over committed"),
    (SERVER, Say.READY, "serving"),
    (KEEPER, Say.STOP, "stop cleanly"),
    (SERVER, Say.STOPPING, "{why: " + " | ".join(w.value for w in Leaving if w is not Leaving.CRASHED) + "}"),
)


def sequence_diagram() -> str:
    """:data:`CONVERSATION` as a mermaid sequence diagram (docs/architecture.md)."""
    lines = ["```mermaid", "sequenceDiagram", "    participant S as server", "    participant K as keeper"]
    for who, say, note in CONVERSATION:
        arrow = "S->>K" if who == SERVER else "K-->>S"
        lines.append(f"    {arrow}: {say.value.upper()}" + (f" {note}" if note else ""))
    return "\n".join(lines + ["```"])


class Waiting(enum.StrEnum):
    """What a session waits on while serving a request: the three states a
    take-over can find it in (encoded in images by value).  Here, not in the
    image's module, so the rooms that wait need not import the image codec."""

    LOCK = "lock"  # a handshake, for its lock
    RESTORE = "restore"  # a granted restore, for GPU memory
    ALLOCATE = "allocate"  # an allocation, for memory
