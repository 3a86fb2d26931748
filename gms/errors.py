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


class LockTimeoutError(GMSError, TimeoutError):
    """The lock was not granted in time: the one non-fatal connection failure."""


class StaleMemoryLayoutError(GMSError):
    """The committed layout changed since this client mapped it: re-import."""


class GMSUsageError(GMSError):
    """The manager was asked for something its state does not allow."""
