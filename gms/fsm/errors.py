"""Typed outcomes of the core: client rejections and invariant violations.

A :class:`Rejection` is the client's fault: the request is refused, nothing is
appended, the session goes on.  An :class:`InvariantViolation` is ours: the
state cannot accept what the shell asked of it, so the server must stop.
"""

from __future__ import annotations


class InvariantViolation(Exception):
    """An impossible internal state, or an event the state cannot accept."""


class Rejection(Exception):
    """A decodable but invalid client request.  ``code`` travels on the wire."""

    code = "REJECTED"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotConnected(Rejection):
    """A layout request on a connection that holds no lock."""

    code = "NOT_CONNECTED"


class ModeViolation(Rejection):
    """The connection's lock mode does not allow the request (e.g. RO writes)."""

    code = "MODE_VIOLATION"


class StateViolation(Rejection):
    """The request does not fit the connection's state (e.g. a second handshake)."""

    code = "STATE_VIOLATION"


class UnknownAllocation(Rejection):
    code = "UNKNOWN_ALLOCATION"


class OffsetOutOfBounds(Rejection):
    code = "OFFSET_OUT_OF_BOUNDS"


class InvalidArgument(Rejection):
    code = "INVALID_ARGUMENT"


class LimitExceeded(Rejection):
    code = "LIMIT_EXCEEDED"


class OverLimit(LimitExceeded):
    """A named bound on what the daemon holds would be passed: the request is
    refused, nothing changes, the session goes on.

    ``limit`` names the bound as the operator sets it (``metadata_quota``,
    ``max_layouts``, ``max_metadata_bytes``, ``max_connections_per_uid``, ...);
    ``scope`` is whose it is (``tenant``, ``node``, ``uid``); ``used`` and
    ``bound`` are that scope's figures (bytes or a count), ``asked`` what the
    request would add.
    """

    def __init__(self, limit: str, scope: str, used: int, asked: int, bound: int, what: str) -> None:
        super().__init__(f"{what}: {used} used + {asked} asked > {bound} allowed ({limit})")
        self.limit = limit
        self.scope = scope
        self.used = used
        self.asked = asked
        self.bound = bound


class PermissionDenied(Rejection):
    """The peer's tenant (or lack of one, or of admin rights) does not allow the request."""

    code = "PERMISSION_DENIED"


class UnknownLayout(Rejection):
    code = "UNKNOWN_LAYOUT"


class StaleLayout(Rejection):
    """A reader asked for the committed layout of one hash (``expect_hash``) and
    the layout is not committed, or has another hash: answered at once, never
    waited for (a client riding through a restart, or waking, must not wait for
    a commit that may never come)."""

    code = "STALE_LAYOUT"


class QuotaExceeded(Rejection):
    """The allocation would take a tenant (or a session) past its byte limit.

    ``scope`` is ``tenant`` (the policy's quota) or ``session`` (the limit the
    session set itself at handshake); ``used`` and ``quota`` are that scope's.
    """

    code = "QUOTA_EXCEEDED"

    def __init__(self, scope: str, used: int, asked: int, quota: int) -> None:
        super().__init__(
            f"{scope} quota exceeded: {used} bytes used + {asked} asked > {quota} allowed"
        )
        self.scope = scope
        self.used = used
        self.asked = asked
        self.quota = quota


class BudgetExceeded(Rejection):
    """The request can never fit the GPU (or host) budget, whatever is evicted or freed."""

    code = "BUDGET_EXCEEDED"


class NotEvictable(Rejection):
    code = "NOT_EVICTABLE"


class HostCopyMissing(Rejection):
    """Residency ``system`` needs a host copy of every allocation first."""

    code = "HOST_COPY_MISSING"


class HostBudgetExceeded(LimitExceeded):
    """The host tier is full: the writer gets this instead of a host copy; nothing is lost."""

    code = "HOST_MEMORY_EXHAUSTED"


class SnapshotUnreadable(Rejection):
    """A layout on the disk tier could not be restored: its snapshot did not read
    back whole (then the layout is dropped: the next writer builds it again) or
    no copier could read it (then it stays on disk: ask again)."""

    code = "SNAPSHOT_UNREADABLE"
