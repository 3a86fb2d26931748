"""``gms stop`` and ``gms restart``: the service's life, by the signals its processes answer.

The server names who to signal (``gms status``): ``gms stop`` sends SIGTERM
to the process that runs the service (the keeper, or the ``gms serve
--devices`` supervisor above it, or a server without a keeper), which stops
its server cleanly, releasing every layout, and waits until the socket is
gone (``--purge``: then removes its disk folder and snapshots too).  ``gms
restart`` sends SIGTERM to the server alone: it leaves its node to its
keeper, which starts the next server with every layout (clients ride
through), reading the options, the policy and the code again.  The kernel
decides who may signal whom: root, or the service's own user.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import stat
import sys
import time

from ..errors import GMSError
from ..system import procs
from .common import client_error, positive_seconds, socket_of, target_args

DEFAULT_WAIT_S = 60.0


class ControlError(Exception):
    """What the command cannot do, said as one line."""


def register(sub) -> None:
    stop = sub.add_parser(
        "stop", help="stop the service (keeper, server, spare, copier): every layout is released",
    )
    restart = sub.add_parser(
        "restart",
        help="start the next server under the same keeper: every layout kept, clients ride through, "
        "the policy and the code read again",
    )
    for parser, handler in ((stop, cmd_stop), (restart, cmd_restart)):
        target_args(parser)
        parser.add_argument(
            "--wait", type=positive_seconds, default=DEFAULT_WAIT_S, metavar="SECONDS",
            help=f"how long to wait for it to be done (default {DEFAULT_WAIT_S:g})",
        )
        parser.set_defaults(handler=handler)
    stop.add_argument(
        "--purge", action="store_true",
        help="then remove what the service leaves: its disk tier's folder with every snapshot (the persisted "
        "layouts, for good) and its socket's folder if empty",
    )


def is_gms(pid: int) -> bool:
    """Is ``pid`` a gms process (its command line names gms)?  A pid read from a
    server a moment ago may be another process's by now: never signal that."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().split(b"\0")
    except FileNotFoundError:
        return False
    except OSError:
        return True  # no /proc to look in: the server's word will do
    return any(os.path.basename(w) == b"gms" or w.startswith(b"gms") for w in words[:4])


def signal_process(pid: int, signum: int, what: str) -> None:
    if not is_gms(pid):
        raise ControlError(f"pid {pid} ({what}) is not a gms process (any more): nothing sent")
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        raise ControlError(f"pid {pid} ({what}) is gone already") from None
    except PermissionError:
        raise ControlError(
            f"not allowed to signal pid {pid} ({what}): run this as root or as the user that started the service"
        ) from None


def _state(path: str, timeout: float):
    from ..client.probes import get_runtime_state

    return get_runtime_state(path, timeout=timeout)


def _until(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise ControlError(f"{what} within {seconds:g} s (--wait waits longer)")
        time.sleep(0.05)


def service_role(state) -> str:
    """What the process that stops the service is (``state.service_pid``)."""
    if state.service_pid == state.pid:
        return "the server"
    if state.service_pid == state.keeper_pid:
        return "the keeper"
    return "the supervisor of every device's server"


def ours(state, path: str, verb: str) -> None:
    """A service found on a default socket is acted on only from the installation
    that runs it (issue 63: a second clone's CI stopped the user's service, and
    every layout with it); another must name the socket."""
    if state.python_prefix and os.path.realpath(state.python_prefix) != os.path.realpath(sys.prefix):
        raise ControlError(
            f"the service on {path} (pid {state.service_pid or state.pid}) runs from {state.python_prefix}, "
            f"not from this gms ({sys.prefix}): `gms {verb} --socket {path}` to {verb} it all the same"
        )


def stop(path: str, *, timeout: float, wait: float, explicit: bool = True, purge: bool = False) -> str:
    state = _state(path, timeout)
    if not explicit:
        ours(state, path, "stop")
    pid = state.service_pid
    if not pid:
        raise ControlError(
            f"the server on {path} names no process to stop: its keeper runs in another container "
            "(gms keeper) or is of an older gms; stop that keeper, or the server with SIGTERM"
        )
    what = service_role(state)
    signal_process(pid, signal.SIGTERM, what)
    _until(lambda: procs.gone(pid), wait, f"pid {pid} ({what}) did not stop")
    done = f"stopped: pid {pid} ({what}) released every layout and ended"
    return done + purged(path, state.disk_dir) if purge else done


def purged(path: str, disk_dir: str) -> str:
    """What ``--purge`` removed once the service ended: its disk folder and snapshots, and
    the socket's folder if nothing else is in it (another device's server, a user's file)."""
    from ..disk.store import purge

    lines = []
    if disk_dir:
        removed, left = purge(disk_dir)
        lines.append(f"removed {disk_dir} and its {removed} snapshot files" if not left
                     else f"removed {removed} snapshot files from {disk_dir}; kept it for what else is there: "
                     + ", ".join(left[:5]))
    folder = os.path.dirname(os.path.abspath(path))
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):  # left by a server that died: a socket, nothing else
            os.unlink(path)
    try:
        os.rmdir(folder)
        lines.append(f"removed {folder}")
    except OSError:
        lines.append(f"kept {folder} (not empty)")
    return "".join(f"\n{line}" for line in lines)


def restart(path: str, *, timeout: float, wait: float, explicit: bool = True) -> str:
    state = _state(path, timeout)
    if not explicit:
        ours(state, path, "restart")
    if state.keeper == "none":
        raise ControlError(
            f"the server on {path} runs without a keeper (--no-keeper): a restart would lose every layout. "
            "Replace it live with `gms serve --take-over` (same socket), or stop and start it"
        )
    old = state.pid
    signal_process(old, signal.SIGTERM, "the server")

    def new_server() -> bool:
        try:
            return _state(path, timeout).pid not in (0, old)
        except GMSError:
            return False

    _until(new_server, wait, f"no new server answered on {path} after pid {old}")
    now = _state(path, timeout)
    return f"restarted: server pid {old} -> {now.pid}, {len(now.layouts)} layouts kept"


def _run(verb: str, action, args: argparse.Namespace) -> int:
    try:
        print(action(socket_of(args), timeout=args.timeout, wait=args.wait, explicit=bool(args.socket)))
    except GMSError as exc:
        print(client_error(verb, exc), file=sys.stderr)
        return 1
    except ControlError as exc:
        print(f"gms {verb}: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    return _run("stop", functools.partial(stop, purge=args.purge), args)


def cmd_restart(args: argparse.Namespace) -> int:
    return _run("restart", restart, args)
