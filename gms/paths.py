"""Where a server listens by default: one socket per device.

``<dir>/gms_<device-id>.sock``.  ``<dir>`` is ``$GMS_SOCKET_DIR`` when set;
else ``/run/gms`` (:data:`SYSTEM_DIR`) for a server run by root, and for a
client where that socket exists; else the user's own folder (``gms`` in
``$XDG_RUNTIME_DIR``, or ``/tmp/gms-<uid>``).  Both are folders only their
owner can create a file in, so nobody else can put a socket of their own
where a client looks (the temp folder, the default before, let any local
user bind the path first and serve clients its own "weights"); and a client
talks only to a server run by root, its own uid or one it names
(``gms.peer.trusted_server_uids``).  ``<device-id>`` is the GPU's UUID for
the CUDA backend (stable when ``CUDA_VISIBLE_DEVICES`` renumbers devices) or
``host-<N>`` for the host backend.  A client that is not root finds the
server it started itself first (its own socket, in its own folder), then
root's.  Where that path would not fit in a Unix socket address (a deep
``$GMS_SOCKET_DIR``), a digest of the device id replaces it: servers and
clients derive the same name either way.
"""

from __future__ import annotations

import hashlib
import os
import stat

MAX_SOCKET_PATH_BYTES = 107  # sun_path is 108 bytes, with the terminating NUL
SYSTEM_DIR = "/run/gms"


def user_dir() -> str:
    """A non-root user's own folder for its server's socket."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "gms")
    return f"/tmp/gms-{os.getuid()}"


def socket_dir(*, serving: bool = False) -> str:
    """The folder of the default sockets: where this process serves (``serving``)
    or, for a client, where a server of root's listens (if one does) or else its
    own user's."""
    configured = os.environ.get("GMS_SOCKET_DIR")
    if configured:
        return configured
    if os.geteuid() == 0 or (not serving and os.path.isdir(SYSTEM_DIR)):
        return SYSTEM_DIR
    return user_dir()


def device_id(device: int, backend: str = "auto") -> str:
    """The GPU UUID when the CUDA backend serves ``device``, else ``host-<device>``."""
    from .cuda import resolve_backend

    if resolve_backend(backend, device) == "cuda":
        from .cuda.vmm import device_uuid

        return device_uuid(device)
    return f"host-{device}"


def socket_path(device: int = 0, backend: str = "auto", *, serving: bool = False) -> str:
    """The socket of the server for ``device``; every layout on it is reached here.
    ``serving``: where this process would serve it."""
    dev = device_id(device, backend)
    if not serving and not os.environ.get("GMS_SOCKET_DIR") and os.geteuid() != 0:
        own = socket_path_in(user_dir(), dev)
        if _own_socket(own):  # a server this user started (`gms serve` as this user) comes first
            return own
        system = socket_path_in(SYSTEM_DIR, dev)
        return system if os.path.exists(system) else own
    return socket_path_in(socket_dir(serving=serving), dev)


def _own_socket(path: str) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISSOCK(st.st_mode) and st.st_uid == os.geteuid()


STATE_DIR = "/var/lib/gms"  # root's disk tier (kept across reboots, unlike /run)


def disk_dir(socket: str, state_dir: str | None = None) -> str:
    """Where the server of ``socket`` keeps its disk tier by default: ``<state
    dir>/<socket name>.disk``.  Without a state dir, a server on a default socket
    keeps it where a reboot leaves it (``/var/lib/gms`` for root, the user's
    ``$XDG_STATE_HOME/gms`` or ``~/.local/state/gms``: ``/run`` and the runtime
    folder are emptied at boot); one on a socket of its own, beside the socket."""
    folder, name = os.path.split(os.path.abspath(socket))
    if state_dir:
        folder = state_dir
    elif folder in (SYSTEM_DIR, os.path.abspath(user_dir())) and not os.environ.get("GMS_SOCKET_DIR"):
        if os.geteuid() == 0:
            folder = STATE_DIR
        else:
            base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
            folder = os.path.join(base, "gms")
    return os.path.join(folder, os.path.splitext(name)[0] + ".disk")


def socket_path_in(directory: str, device_id: str) -> str:
    """The socket for a device in ``directory``; raises ``ValueError``
    when even the short form is too long for a Unix socket."""
    path = os.path.join(directory, f"gms_{device_id}.sock")
    if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
        digest = hashlib.sha256(device_id.encode()).hexdigest()[:12]
        path = os.path.join(directory, f"gms_{digest}.sock")
    if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
        raise ValueError(
            f"socket path {path!r} is longer than the {MAX_SOCKET_PATH_BYTES} bytes a Unix socket "
            "address holds: set GMS_SOCKET_DIR to a shorter folder"
        )
    return path
