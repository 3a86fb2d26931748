"""Events: the only inputs of the fold.

Every event names the connection it came from (``conn``, an integer the
server hands out per accepted socket).  Lock events carry the seed's names;
layout events describe one change of the layout; observations change nothing
in the state but are kept in the log for post-mortems.
"""

from __future__ import annotations

from typing import ClassVar

import attrs


@attrs.frozen
class Event:
    KIND: ClassVar[str] = ""
    conn: int


# -- lock events --------------------------------------------------------------


@attrs.frozen
class RwConnect(Event):
    """A writer got the lock: the previous layout (committed or not) is cleared."""

    KIND: ClassVar[str] = "RW_CONNECT"


@attrs.frozen
class RwCommit(Event):
    """The writer published its layout; ``layout_hash`` is what readers will see."""

    KIND: ClassVar[str] = "RW_COMMIT"
    layout_hash: str


@attrs.frozen
class RwAbort(Event):
    """The writer left without committing: its layout is dropped."""

    KIND: ClassVar[str] = "RW_ABORT"


@attrs.frozen
class RoConnect(Event):
    KIND: ClassVar[str] = "RO_CONNECT"


@attrs.frozen
class RoDisconnect(Event):
    KIND: ClassVar[str] = "RO_DISCONNECT"


# -- layout events ------------------------------------------------------------


@attrs.frozen
class AllocationCreated(Event):
    KIND: ClassVar[str] = "ALLOCATION_CREATED"
    allocation_id: str
    size: int
    aligned_size: int
    tag: str
    layout_slot: int


@attrs.frozen
class AllocationFreed(Event):
    """Metadata pointing into the allocation is deleted by earlier events."""

    KIND: ClassVar[str] = "ALLOCATION_FREED"
    allocation_id: str


@attrs.frozen
class MetadataPut(Event):
    KIND: ClassVar[str] = "METADATA_PUT"
    key: str
    allocation_id: str
    offset_bytes: int
    value: bytes


@attrs.frozen
class MetadataDeleted(Event):
    KIND: ClassVar[str] = "METADATA_DELETED"
    key: str


# -- observations (no state change) -------------------------------------------


@attrs.frozen
class AllocationOomWait(Event):
    """The writer's allocation hit out-of-memory and is now retrying."""

    KIND: ClassVar[str] = "ALLOCATION_OOM_WAIT"
    size: int
    tag: str


@attrs.frozen
class AllocationOomGaveUp(Event):
    """An out-of-memory wait ended without memory: ``reason`` is timeout or disconnect."""

    KIND: ClassVar[str] = "ALLOCATION_OOM_GAVE_UP"
    size: int
    tag: str
    reason: str
    waited_ms: int


@attrs.frozen
class LockTimeout(Event):
    """A handshake waited ``timeout_ms`` for ``lock_type`` and was refused."""

    KIND: ClassVar[str] = "LOCK_TIMEOUT"
    lock_type: str
    timeout_ms: int


@attrs.frozen
class ConnectionDropped(Event):
    """The server stopped trusting a connection (undecodable frame, failed send)."""

    KIND: ClassVar[str] = "CONNECTION_DROPPED"
    reason: str


LOCK_EVENTS: tuple[type[Event], ...] = (RwConnect, RwCommit, RwAbort, RoConnect, RoDisconnect)
LAYOUT_EVENTS: tuple[type[Event], ...] = (
    AllocationCreated,
    AllocationFreed,
    MetadataPut,
    MetadataDeleted,
)
OBSERVATIONS: tuple[type[Event], ...] = (
    AllocationOomWait,
    AllocationOomGaveUp,
    LockTimeout,
    ConnectionDropped,
)
EVENT_TYPES: dict[str, type[Event]] = {
    cls.KIND: cls for cls in LOCK_EVENTS + LAYOUT_EVENTS + OBSERVATIONS
}
