"""Admin verbs: one request, answered, then the connection closes; no lock is taken.

The server allows them to its own uid, root, and tenants its policy makes
admins, judged by the peer credentials the kernel gives it.  ``timeout``
(seconds) bounds each verb, its answer included: ResponseTimeoutError after it.
"""

from __future__ import annotations

from ..errors import GMSServerError
from ..wire import messages as m
from .probes import DEFAULT_TIMEOUT_S, one_shot


def revoke(
    socket_path: str, layout: str, *, timeout: float | None = DEFAULT_TIMEOUT_S, missing_ok: bool = False
) -> int:
    """Take every lock on ``layout`` away (the seed's "dump KV cache"): a writer's
    uncommitted allocations are released, readers are dropped, the next waiter
    is granted.  Returns how many sessions lost their lock.  A name the server
    does not know raises ``UNKNOWN_LAYOUT``; with ``missing_ok`` it revokes 0 (a
    failover's revoke, where the failed engine may have dropped the layout)."""
    try:
        return one_shot(socket_path, m.RevokeRequest(layout), m.RevokeResponse, timeout).sessions
    except GMSServerError as exc:
        if missing_ok and exc.code == "UNKNOWN_LAYOUT":
            return 0
        raise


def evict(
    socket_path: str, layout: str, *, timeout: float | None = DEFAULT_TIMEOUT_S
) -> m.EvictResponse:
    """Release an idle committed layout's GPU memory now (a ``system`` layout keeps
    its host copy; an ``unpinned`` one is dropped)."""
    return one_shot(socket_path, m.EvictRequest(layout), m.EvictResponse, timeout)


def delete(
    socket_path: str, layout: str, *, timeout: float | None = DEFAULT_TIMEOUT_S
) -> m.DeleteResponse:
    """Delete an idle committed layout from every tier, its snapshot on disk
    included (``NOT_EVICTABLE`` while anyone holds it: revoke first)."""
    return one_shot(socket_path, m.DeleteRequest(layout), m.DeleteResponse, timeout)


def pin(
    socket_path: str, layout: str, residency: str = "device", *, timeout: float | None = DEFAULT_TIMEOUT_S
) -> str:
    """Set a committed layout's residency (``device``: never evicted)."""
    return one_shot(socket_path, m.PinRequest(layout, residency), m.PinResponse, timeout).residency
