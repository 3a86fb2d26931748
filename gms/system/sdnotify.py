"""systemd's notification protocol and file-descriptor store, with plain sockets (no libsystemd).

What is implemented, per systemd's documentation (sd_notify(3),
sd_listen_fds(3), systemd.service(5), https://systemd.io/FILE_DESCRIPTOR_STORE/):

* :func:`notify`: one datagram to ``$NOTIFY_SOCKET`` (a path, or an abstract
  name written with a leading ``@``) holding newline-separated assignments
  (``READY=1``, ``STATUS=...``, ``STOPPING=1``, ``FDSTORE=1``...), fds attached
  with ``SCM_RIGHTS`` (at most 253 a message).
* :func:`store_fds`: ``FDSTORE=1`` with ``FDNAME=`` (printable ASCII, no ``:``,
  at most 255 characters) and ``FDPOLL=0`` (the manager would otherwise drop an
  fd that reports ``POLLHUP``/``POLLERR``, and must not poll GPU memory fds).
  The manager keeps a duplicate of each fd for the service and hands them
  back at its next start.  It accepts them only where the unit sets
  ``FileDescriptorStoreMax=`` (``$FDSTORE`` says how many, on systemd 254+).
* :func:`remove_fds`: ``FDSTOREREMOVE=1`` with ``FDNAME=``: every fd stored
  under that name is closed.
* :func:`listen_fds`: the hand-back at the next start, ``$LISTEN_FDS`` fds
  from fd 3 on, named by ``$LISTEN_FDNAMES`` (colon-separated), for this
  process only (``$LISTEN_PID``); the variables are then unset, and the fds
  made close-on-exec.

Tested against a fake manager (``tests/fake_systemd.py``) built to those
documents, not against systemd itself.
"""

from __future__ import annotations

import array
import os
import re
import socket

SD_LISTEN_FDS_START = 3
MAX_FDS_PER_MESSAGE = 253
_FDNAME = re.compile(r"[\x21-\x39\x3b-\x7e]{1,255}")  # printable ASCII but ':' and space


class NotifyError(OSError):
    pass


def enabled() -> bool:
    return bool(os.environ.get("NOTIFY_SOCKET"))


def _address(path: str) -> str | bytes:
    if path.startswith("@"):
        return b"\0" + path[1:].encode()
    return path


def valid_fdname(name: str) -> bool:
    return bool(_FDNAME.fullmatch(name))


def notify(state: str, fds: list[int] | tuple[int, ...] = ()) -> bool:
    """Send ``state`` (and ``fds``) to the service manager; False where there is none."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if len(fds) > MAX_FDS_PER_MESSAGE:
        raise ValueError(f"at most {MAX_FDS_PER_MESSAGE} fds per notification")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    try:
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        sock.sendmsg([state.encode()], ancillary, 0, _address(path))
    except OSError as exc:
        raise NotifyError(exc.errno, f"sd_notify to {path}: {exc.strerror}") from exc
    finally:
        sock.close()
    return True


def store_fds(name: str, fds: list[int] | tuple[int, ...], poll: bool = False) -> bool:
    if not valid_fdname(name):
        raise ValueError(f"{name!r} is not a valid FDNAME (printable ASCII, no ':', at most 255)")
    state = f"FDSTORE=1\nFDNAME={name}" + ("" if poll else "\nFDPOLL=0")
    return notify(state, fds)


def remove_fds(name: str) -> bool:
    return notify(f"FDSTOREREMOVE=1\nFDNAME={name}")


def store_max() -> int | None:
    """How many fds the manager stores for this service (``$FDSTORE``; None: not said)."""
    value = os.environ.get("FDSTORE")
    return int(value) if value and value.isdigit() else None


def listen_fds(unset: bool = True) -> list[tuple[int, str]]:
    """(fd, name) for each fd the manager passed this process; empty if none (or
    they were meant for another process)."""
    try:
        count = int(os.environ.get("LISTEN_FDS", "0"))
        pid = int(os.environ.get("LISTEN_PID", "0"))
    except ValueError:
        count, pid = 0, 0
    names = os.environ.get("LISTEN_FDNAMES", "")
    if unset:
        for key in ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"):
            os.environ.pop(key, None)
    if count <= 0 or pid != os.getpid():
        return []
    labels = names.split(":") if names else []
    labels += ["unknown"] * (count - len(labels))
    out = []
    for n in range(count):
        fd = SD_LISTEN_FDS_START + n
        os.set_inheritable(fd, False)
        out.append((fd, labels[n]))
    return out
