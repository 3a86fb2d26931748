"""Errors a gms client sees.  Every one is a :class:`GMSError`."""

from __future__ import annotations


class GMSError(Exception):
    pass


class GMSConnectionError(GMSError):
    """No server at the socket, or the connection broke."""


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


class LockTimeoutError(GMSError, TimeoutError):
    """The lock was not granted in time: the one non-fatal connection failure."""


class StaleMemoryLayoutError(GMSError):
    """The committed layout changed since this client mapped it: re-import."""


class GMSUsageError(GMSError):
    """The manager was asked for something its state does not allow."""
