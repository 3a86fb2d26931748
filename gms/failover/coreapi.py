"""The core calls that failover makes, in one place.

The core is moving to one server per GPU holding many named layouts
(``GMSClientMemoryManager(socket, layout=...)``) with an admin ``revoke``
verb (``gms.client.admin.revoke``).  Until that lands, a "per-GPU socket"
``<dir>/gms_<id>.sock`` stands for today's per-tag sockets
``<dir>/gms_<id>_<layout>.sock`` (one ``gms serve --tag`` server each): the
names agree with ``gms.socket_path`` both before and after.  Everything that
differs between the two cores is in this module; nothing else in
``gms.failover`` or the example engine knows which core it runs on.
"""

from __future__ import annotations

import inspect
import os
import sys

from .. import paths
from ..client.manager import GMSClientMemoryManager

LAYOUTS = ("weights", "kv_cache")


class RevokeUnavailable(RuntimeError):
    """This core has no admin ``revoke`` verb."""


def has_layouts() -> bool:
    """True once one server holds several named layouts (the upcoming core)."""
    return "layout" in inspect.signature(GMSClientMemoryManager.__init__).parameters


def has_revoke() -> bool:
    try:
        from ..client import admin  # noqa: F401  (the upcoming core)
    except ImportError:
        return False
    return hasattr(admin, "revoke")


def default_socket(device: int = 0, backend: str = "auto") -> str:
    """The per-GPU server socket (``gms.socket_path(device)`` in the upcoming core)."""
    if has_layouts():
        return paths.socket_path(device, backend=backend)
    return os.path.join(paths.socket_dir(), f"gms_{paths.device_id(device, backend)}.sock")


def layout_socket(socket: str, layout: str) -> str:
    """Today's socket of ``layout`` for the per-GPU socket ``socket``."""
    if has_layouts():
        return socket
    root, ext = os.path.splitext(socket)
    return f"{root}_{layout}{ext or '.sock'}"


def layout_manager(socket: str, layout: str, device: int = 0) -> GMSClientMemoryManager:
    """A manager for ``layout`` on the GPU server at ``socket``."""
    if has_layouts():
        return GMSClientMemoryManager(socket, device=device, layout=layout)
    return GMSClientMemoryManager(layout_socket(socket, layout), device=device)


def revoke(socket: str, layout: str) -> int:
    """Drop every session holding ``layout``'s lock on that server; returns how
    many.  Raises :class:`RevokeUnavailable` on a core without the verb."""
    try:
        from ..client import admin
    except ImportError:
        raise RevokeUnavailable("this gms core has no admin revoke verb") from None
    return admin.revoke(layout_socket(socket, layout), layout)


def serve_commands(
    socket: str, *, backend: str = "auto", device: int = 0, extra: tuple[str, ...] = ()
) -> list[list[str]]:
    """The ``gms serve`` command lines that serve every layout behind ``socket``."""
    base = [sys.executable, "-m", "gms", "serve", "--backend", backend, "--device", str(device), *extra]
    if has_layouts():
        return [[*base, "--socket", socket]]
    return [[*base, "--socket", layout_socket(socket, layout), "--tag", layout] for layout in LAYOUTS]
