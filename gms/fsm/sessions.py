"""Session decisions: who may open a session on which layout, and what ending one releases.

Identity is the kernel's (the shell reads the peer's credentials); the tenant
and what it may do come from the operator's policy, resolved by the shell and
passed in as plain values.  Nothing here trusts a name the client sent.
"""

from __future__ import annotations

import re

from .errors import InvalidArgument, LimitExceeded, PermissionDenied, StaleLayout, StateViolation
from .events import (
    Event,
    RestoreAborted,
    RoDisconnect,
    RwAbort,
    SessionClosed,
    SessionOpened,
)
from .limits import Limits
from .locks import RequestedLockType
from .node import NodeState

MAX_LAYOUT_NAME_BYTES = 128
_LAYOUT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+/-]*")


def validate_layout_name(name: object) -> str:
    """Printable, short, no odd bytes: names show up in logs, metrics and file names."""
    if not isinstance(name, str) or not name:
        raise InvalidArgument("a layout name must be a non-empty string")
    if len(name.encode()) > MAX_LAYOUT_NAME_BYTES:
        raise InvalidArgument(f"layout name is longer than {MAX_LAYOUT_NAME_BYTES} bytes")
    if not _LAYOUT_NAME.fullmatch(name):
        raise InvalidArgument(
            f"layout name {name!r} must start with a letter or digit and hold only "
            "letters, digits and . _ : @ + / -"
        )
    return name


def decide_session(
    node: NodeState,
    conn: int,
    layout: str,
    requested: RequestedLockType,
    *,
    tenant: str,
    may_read: bool,
    may_write: bool,
    uid: int,
    gid: int,
    pid: int,
    limit_bytes: int | None,
    limits: Limits,
    expect_hash: str = "",
) -> list[Event]:
    """Open a session; the event's ``lock_type`` is what the connection will wait for.

    A tenant that may read a layout but not write it gets RO for RW_OR_RO: it
    can never be the one that (re)builds the layout.  ``expect_hash`` (readers
    only) asks for exactly that committed layout: anything else is StaleLayout.
    """
    if conn in node.sessions:
        raise StateViolation("this connection has already handshaken")
    validate_layout_name(layout)
    state = node.tenants.get(tenant)
    if state is None:
        raise PermissionDenied(f"tenant {tenant!r} is not configured on this server")
    if requested is RequestedLockType.RW_OR_RO and not may_write:
        requested = RequestedLockType.RO
    if requested is RequestedLockType.RW and not may_write:
        raise PermissionDenied(f"tenant {tenant!r} may not write layout {layout!r}")
    if requested is RequestedLockType.RO and not (may_read or may_write):
        raise PermissionDenied(f"tenant {tenant!r} may not read layout {layout!r}")
    if limit_bytes is not None:
        if limit_bytes < 0:
            raise InvalidArgument("limit_bytes must be >= 0")
        if state.quota_bytes is not None and limit_bytes > state.quota_bytes:
            raise InvalidArgument(
                f"limit_bytes {limit_bytes} exceeds tenant {tenant!r}'s quota of "
                f"{state.quota_bytes} bytes: a session may narrow its limit, never widen it"
            )
    if expect_hash:
        check_expected_hash(node, layout, requested, expect_hash)
    if (
        requested is not RequestedLockType.RO
        and layout not in node.layouts
        and len(node.layouts) >= limits.max_layouts
    ):
        raise LimitExceeded(f"the server already holds {limits.max_layouts} layouts")
    return [
        SessionOpened(
            conn, tenant, uid, gid, pid, requested.value, limit_bytes, layout=layout
        )
    ]


def check_expected_hash(node: NodeState, layout: str, requested: RequestedLockType, expect_hash: str) -> None:
    """A reader that mapped one committed layout asks for it back (a wake, or a
    client riding through a server restart).  Checked when the handshake
    arrives; a layout that changes while the handshake waits behind a writer
    is granted with its new hash, which the client compares."""
    if requested is RequestedLockType.RW:
        raise InvalidArgument("expect_hash is for readers (RO or RW_OR_RO), not RW")
    state = node.layouts.get(layout)
    if state is None or not state.committed:
        raise StaleLayout(f"layout {layout!r} holds no committed layout (expected {expect_hash[:12]})")
    if state.layout_hash != expect_hash:
        raise StaleLayout(
            f"layout {layout!r} is committed with hash {state.layout_hash[:12]}, not {expect_hash[:12]}"
        )


def decide_disconnect(node: NodeState, conn: int) -> list[Event]:
    """A closed, dropped or revoked connection releases its lock, then its session."""
    session = node.sessions.get(conn)
    if session is None:
        return []
    layout = node.layout(session.layout)
    events: list[Event] = []
    if layout.writer == conn:
        events.append(RwAbort(conn, layout=layout.name))
    elif conn in layout.readers:
        events.append(RoDisconnect(conn, layout=layout.name))
    elif layout.restorer == conn:
        events.append(RestoreAborted(conn, layout=layout.name))
    events.append(SessionClosed(conn, layout=layout.name))
    return events


def holders(node: NodeState, layout: str) -> list[int]:
    """Connections holding a lock on ``layout`` (writer, restorer, readers), in that order."""
    state = node.layout(layout)
    found = [c for c in (state.writer, state.restorer) if c is not None]
    return found + sorted(state.readers)
