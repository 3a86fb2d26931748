"""Errors a gms client sees.  Every one is a :class:`GMSError`."""

from __future__ import annotations


class GMSError(Exception):
    pass


class GMSConnectionError(GMSError):
    """No server at the socket, or the connection broke."""


class UntrustedServerError(GMSConnectionError):
    """The process answering on the socket is run by a uid the client does not
    trust as its server (root, its own, or one in ``$GMS_SERVER_UIDS``): a
    squatter on the path, or a daemon run as a user the client was not told
    of.  Nothing was sent to it."""


class ResponseTimeoutError(GMSConnectionError, TimeoutError):
    """The server did not answer within the call's deadline (a hung or overloaded
    server).  The connection is closed: a manager is left disconnected and can
    ``connect()`` again."""


class ServerGoneError(GMSConnectionError):
    """The connection broke with no notice from the server (EOF, reset, broken
    pipe): the server went away.  From a manager that held a reader's lock:
    no server took it back within ``reconnect_timeout_s`` (or riding through
    is off)."""


class SessionEndedError(GMSConnectionError):
    """The server ended the session on purpose and said so (``SessionEnded``);
    ``reason`` says why.  Never reconnected by the client."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):
        return (type(self), (self.reason, str(self)))


class LockRevokedError(SessionEndedError):
    """An admin revoked this session's lock (``gms revoke``): its connection is
    closed and stays closed; a writer's uncommitted build is gone."""


class BuildLostError(GMSConnectionError):
    """A writer's connection broke before it committed (its server went away):
    the build is gone with it.  The manager is disconnected and reusable; its
    mappings are kept (their memory stays alive while mapped), so
    ``unmap_all_vas``, ``connect(RW)``, ``reallocate_all_handles`` and
    ``remap_all_vas`` rebuild at the same addresses."""


class RequestTooLargeError(GMSError, ValueError):
    """The request would be a frame over the server's cap: refused before
    sending; nothing changed, the session goes on."""

    def __init__(self, message: str, *, size: int, limit: int) -> None:
        super().__init__(message)
        self.size = size
        self.limit = limit

    def __reduce__(self):
        return (_rebuild_too_large, (str(self), self.size, self.limit))


def _rebuild_too_large(message: str, size: int, limit: int) -> RequestTooLargeError:
    return RequestTooLargeError(message, size=size, limit=limit)


class GMSProtocolError(GMSError):
    """The server sent something this client cannot understand."""


class GMSServerError(GMSError):
    """The server answered ``ErrorResponse``; ``code`` says why (docs/protocol.md)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message

    def __reduce__(self):
        # Errors cross process boundaries (a Ray actor's reach its driver): rebuild from fields.
        return (type(self), (self.code, self.message))


class QuotaExceededError(GMSServerError):
    """An allocation would take the tenant (``scope == "tenant"``) or this session
    (``"session"``, the limit set at connect) past its byte limit.  Non-fatal:
    the session goes on, nothing was allocated."""

    def __init__(self, message: str, *, scope: str, used: int, asked: int, quota: int) -> None:
        super().__init__("QUOTA_EXCEEDED", message)
        self.scope = scope
        self.used = used
        self.asked = asked
        self.quota = quota

    def __reduce__(self):
        fields = {"scope": self.scope, "used": self.used, "asked": self.asked, "quota": self.quota}
        return (_rebuild_quota_error, (self.message, fields))


def _rebuild_quota_error(message: str, fields: dict) -> QuotaExceededError:
    return QuotaExceededError(message, **fields)


class LimitExceededError(GMSServerError):
    """A named bound on what the server holds would be passed (``code``
    LIMIT_EXCEEDED, or RESOURCE_EXHAUSTED for the server's file descriptors).
    ``limit`` names it (``metadata_quota``, ``max_layouts``,
    ``max_metadata_bytes``, ``max_connections_per_uid``, ``fds``), ``scope``
    says whose it is (``tenant``, ``node``, ``uid``), ``used`` and ``bound`` are
    its figures, ``asked`` what the request would have added.  Non-fatal:
    nothing changed; a session goes on (a refused connection is closed)."""

    def __init__(self, code: str, message: str, *, limit: str, scope: str, used: int, asked: int, bound: int) -> None:
        super().__init__(code, message)
        self.limit = limit
        self.scope = scope
        self.used = used
        self.asked = asked
        self.bound = bound

    def __reduce__(self):
        fields = {"limit": self.limit, "scope": self.scope, "used": self.used, "asked": self.asked, "bound": self.bound}
        return (_rebuild_limit_error, (self.code, self.message, fields))


def _rebuild_limit_error(code: str, message: str, fields: dict) -> LimitExceededError:
    return LimitExceededError(code, message, **fields)


class LockTimeoutError(GMSError, TimeoutError):
    """The lock was not granted in time: the one non-fatal connection failure."""


class SnapshotNotServedError(LockTimeoutError):
    """A read lock on a layout left empty because its last snapshot was not served
    (set aside, or refused: ``reason``), which no writer is building: answered at
    once, since nothing would grant it.  A writer (RW, RW_OR_RO) builds it."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class StaleMemoryLayoutError(GMSError):
    """The committed layout changed (or is gone) since this client mapped it:
    re-import.  Raised by ``remap_all_vas``, by ``connect(RO)`` of a manager
    holding mappings of a committed layout, and by a reader riding through a
    server restart; the server's code for it is ``STALE_LAYOUT``."""


class GMSUsageError(GMSError):
    """The manager was asked for something its state does not allow."""
