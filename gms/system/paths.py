"""Where a server listens by default: one socket per device.

``<dir>/gms_<device-id>.sock``.  ``<dir>`` is ``$GMS_SOCKET_DIR`` when set;
else ``/run/gms`` (:data:`SYSTEM_DIR`) for a server run by root, and for a
client where that socket exists; else the user's own folder (``gms`` in
``$XDG_RUNTIME_DIR``, or ``/tmp/gms-<uid>``).  Both are folders only their
owner can create a file in, so nobody else can put a socket of their own
where a client looks (the temp folder, the default before, let any local
user bind the path first and serve clients its own "weights"); and a client
talks only to a server run by root, its own uid or one it names
(``gms.system.peer.trusted_server_uids``).  ``<device-id>`` is the GPU's UUID for
the CUDA backend (stable when ``CUDA_VISIBLE_DEVICES`` renumbers devices) or
``host-<N>`` for the host backend.  A client that is not root finds the
server it started itself first (its own socket, in its own folder), then
root's.  Where that path would not fit in a Unix socket address (a deep
``$GMS_SOCKET_DIR``), a digest of the device id replaces it: servers and
clients derive the same name either way.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import stat

from .peer import own_uids

_log = logging.getLogger("gms.server")
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
    from ..cuda import resolve_backend

    if resolve_backend(backend, device) == "cuda":
        from ..cuda.vmm import device_uuid

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


# -- the socket's file and folder (the server's and the keeper's) --------------------------


class SocketPathError(Exception):
    """The socket path is taken by a live server or by something not a socket."""


def clear_stale_socket(path: str) -> None:
    """Remove a dead server's socket file; refuse a live one or a non-socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketPathError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        _log.info("replacing stale socket %s", path)
        os.unlink(path)
        return
    except OSError as exc:
        raise SocketPathError(f"cannot tell whether {path} is live: {exc}") from exc
    finally:
        probe.close()
    raise SocketPathError(f"a gms server is already listening on {path}")


def make_socket_dir(directory: str) -> None:
    """Create the socket's folder (and its parents) writable by us alone, whatever
    the umask: whoever can write the folder can replace the socket with their own."""
    old_umask = os.umask(0o022)
    os.umask(old_umask | 0o022)
    try:
        os.makedirs(directory, exist_ok=True)
    finally:
        os.umask(old_umask)
    st = os.stat(directory)
    if st.st_uid not in own_uids():
        # Its owner can replace our socket with one of their own: serve nowhere near it.
        raise SocketPathError(
            f"the socket folder {directory} belongs to uid {st.st_uid}, not to this server's uid "
            f"{os.getuid()} or root: choose another (--socket, GMS_SOCKET_DIR)"
        )
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        _log.warning(
            "socket folder %s is writable by others (mode %o) without the sticky bit: "
            "anyone who can write it can replace the socket", directory, stat.S_IMODE(st.st_mode),
        )
