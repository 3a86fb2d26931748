"""Session decisions: who may open a session on which layout, and what ending one releases.

Identity is the kernel's (the shell reads the peer's credentials); the tenant
and what it may do come from the operator's policy, resolved by the shell and
passed in as plain values.  Nothing here trusts a name the client sent.  What
the state itself allows (a known tenant, a valid name, a limit within the
quota, room under the layout cap) is the rules' business (``gms.fsm.rules``).
"""

from __future__ import annotations

import attrs

from .errors import PermissionDenied, UnknownLayout
from .events import (
    Event,
    LayoutRevoked,
    ReaderJoined,
    ReaderLeft,
    RestoreAborted,
    RoConnect,
    RwAbort,
    SessionClosed,
    SessionOpened,
)
from .locks import Grant, RequestedLockType
from .rules import check_layout_name
from .state import NodeState

validate_layout_name = check_layout_name  # the name the shell and clients know it by


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
    expect_hash: str = "",
) -> list[Event]:
    """Open a session; the event's ``lock_type`` is what the connection will wait for.

    A tenant that may read a layout but not write it gets RO for RW_OR_RO: it
    can never be the one that (re)builds the layout.  ``expect_hash`` (readers
    only) asks for exactly that committed layout: anything else is StaleLayout.
    """
    if requested is RequestedLockType.RW_OR_RO and not may_write:
        requested = RequestedLockType.RO
    if requested is RequestedLockType.RW and not may_write:
        raise PermissionDenied(f"tenant {tenant!r} may not write layout {layout!r}")
    if requested is RequestedLockType.RO and not (may_read or may_write):
        raise PermissionDenied(f"tenant {tenant!r} may not read layout {layout!r}")
    return [
        SessionOpened(conn, tenant, uid, gid, pid, requested.value, limit_bytes, expect_hash, layout=layout)
    ]


# SessionOpened's fields but the keyword-only layout, in order: a READER_JOINED
# carries every one of them, whatever the session grows (attrs.asdict costs a
# handshake 3 % more, counted in opcodes).
_SESSION_FIELDS = tuple(f.name for f in attrs.fields(SessionOpened) if not f.kw_only)


def opening(opened: SessionOpened, grant: Grant | None) -> tuple[list[Event], Grant | None]:
    """What a handshake records: its session and, if its lock is granted at once,
    the grant, which the session's answer tells of.  A read lock comes with its
    session in one event (READER_JOINED), the grant telling of that event."""
    if grant is None:
        return [opened], None
    if type(grant.event) is not RoConnect:
        return [opened, grant.event], grant
    joined = ReaderJoined(*[getattr(opened, name) for name in _SESSION_FIELDS], layout=opened.layout)
    return [joined], Grant(grant.conn, grant.granted, joined)


def decide_disconnect(node: NodeState, conn: int) -> list[Event]:
    """A closed, dropped or revoked connection releases its lock, then its session
    (a reader both in one event)."""
    session = node.sessions.get(conn)
    if session is None:
        return []
    layout = node.layout(session.layout)
    if conn in layout.readers:
        return [ReaderLeft(conn, layout=layout.name)]
    events: list[Event] = []
    if layout.writer == conn:
        events.append(RwAbort(conn, layout=layout.name))
    elif layout.restorer == conn:
        events.append(RestoreAborted(conn, layout=layout.name))
    events.append(SessionClosed(conn, layout=layout.name))
    return events


def holders(node: NodeState, layout: str) -> list[int]:
    """Connections holding a lock on ``layout`` (writer, restorer, readers), in that order."""
    state = node.layout(layout)
    found = [c for c in (state.writer, state.restorer) if c is not None]
    return found + sorted(state.readers)


def decide_revoke(node: NodeState, conn: int, uid: int, layout: str) -> tuple[list[Event], list[int]]:
    """An admin's revoke: its event and the connections that lose their lock.  A
    layout the node knows and nobody holds (its holder died already) revokes none;
    a name the node never had is refused as ``evict`` and ``pin`` refuse it."""
    if layout not in node.layouts:
        raise UnknownLayout(f"no layout {layout!r} on this server")
    victims = holders(node, layout)
    return [LayoutRevoked(conn, uid, len(victims), layout=layout)], victims
