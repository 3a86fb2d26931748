"""Where a starting server's socket and node come from.

* No keeper (``--no-keeper``): it binds the socket itself; with
  ``--take-over``, it first asks a server live on the socket for its place.
* Under a keeper: the keeper's hand-back decides (``gms.server.restart.mirror``):
  ``fresh`` (an empty node, on the keeper's listening socket if it holds one,
  else as without a keeper), ``resume`` (the socket, and the dead server's
  journal and memory) or ``retired`` (this keeper's server was taken over by
  another: serve nothing).

A journal that does not rebuild is saved for ``gms replay`` and the server
starts empty, saying so (a ``STATE_DISCARDED`` event after its
``SERVER_STARTED``).  Everything here happens before the server serves, so it
may block.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import time

import attrs

from ...cuda import DeviceInfo
from ...handover.words import Mode
from ...operator.policy import PolicyError
from ...store import EventLog, Snapshot
from ...system.launch import child_env, python_argv, without_options
from ...system.paths import device_id
from ...system.peer import own_uids, require_peer
from ..config import ServerConfig
from .freshness import Started, in_force
from .mirror import KeeperLink
from .resume import (
    Handed,
    TakeOverRefused,
    Unreplayable,
    Unresumable,
    check_compatible,
    rebuild,
    save_journal,
)
from .takeover import Offer, abort, request_take_over

MAX_FAILED_RESUMES = 2  # servers that died resuming a journal before it is given up
KEEPER_WAIT_S = 30.0  # for a keeper in another container to listen

# Restarts and take-overs are rare and each line matters: not under "gms.server",
# whose repeated lines are rate-limited (gms.server.edge.ratelimit).
log = logging.getLogger("gms.server.restart")


@attrs.frozen
class Discarded:
    reason: str
    saved_to: str
    old_pid: int


@attrs.frozen
class Start:
    listener: socket.socket | None  # None: bind it
    handed: Handed | None = None
    offer: Offer | None = None  # a take-over to commit once the node is ours
    discarded: Discarded | None = None
    link: KeeperLink | None = None
    retired: bool = False


def _listener(fd: int) -> socket.socket:
    return socket.socket(fileno=fd)


def from_offer(offer: Offer, config: ServerConfig) -> Handed:
    image = offer.image
    log_ = EventLog.resumed(_snapshot(image), retain=config.event_log_retain, max_bytes=config.event_log_bytes)
    return Handed("take-over", image, log_, image.next_conn, dict(offer.fds), offer.old_pid, "take-over",
                  dict(offer.conn_fds))


def _snapshot(image) -> Snapshot:
    return Snapshot(image.last_seq, image.state)


def take_over(config: ServerConfig, device: DeviceInfo, link: KeeperLink | None = None) -> Start:
    offer = request_take_over(config.socket_path, config.handover_timeout)
    if offer is None:
        log.info("no server is live on %s: starting as usual", config.socket_path)
        return Start(None, link=link)
    try:
        check_compatible(offer.image.server, device)
    except TakeOverRefused as refused:
        abort(offer.sock, str(refused))
        offer.close_fds()
        raise
    log.info("pid %d is handing its node over (state version %d)", offer.old_pid, offer.image.version)
    return Start(_listener(offer.listener), handed=from_offer(offer, config), offer=offer, link=link)


def open_link(config: ServerConfig) -> KeeperLink | None:
    """The channel to this server's keeper, if it runs under one."""
    if config.keeper_fd is not None:
        return KeeperLink(socket.socket(fileno=config.keeper_fd))
    if config.keeper_socket is not None:
        # The keeper may be starting too (another container): give it a while.
        deadline = time.monotonic() + KEEPER_WAIT_S
        while True:
            try:
                return KeeperLink(connect_keeper(config.keeper_socket))
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    return None


def connect_keeper(path: str) -> socket.socket:
    """A channel to the keeper listening on ``path``: it will be sent every fd and
    every event, so it must be run by root or this server's uid (UntrustedPeer)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        require_peer(sock, own_uids(), f"the keeper on {path}")
    except BaseException:
        sock.close()
        raise
    return sock


def spawn_keeper(argv: list[str]) -> socket.socket:
    """A new keeper for this running server (its own keeper died): ``gms keeper
    --adopt-fd``, which keeps this server's node and starts the next server with
    ``argv`` when this one ends.  It stays in this server's process group, as
    the keeper it replaces was: what stops the group stops it.  Returns our end."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        subprocess.Popen(
            python_argv("gms", "keeper", "--adopt-fd", str(theirs.fileno()), "--", *argv),
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=child_env(),
        )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return ours


def server_argv(argv: list[str]) -> list[str]:
    """How the keeper started this server (``argv``: its ``sys.argv[1:]``), without
    the channel to that keeper: what a new keeper starts the next one with."""
    return python_argv("gms", *without_options(argv, ("--keeper-fd",)))


def prepare(config: ServerConfig, link: KeeperLink | None, device: DeviceInfo) -> Start:
    """Decide (and fetch) what the server starts from.  Raises TakeOverRefused."""
    if link is None:
        return take_over(config, device) if config.take_over else Start(None)
    handback = link.hello(device.uuid)
    if handback.mode is Mode.RETIRED:
        return Start(None, link=link, retired=True)
    listener = _listener(handback.listener) if handback.listener is not None else None
    if handback.provisional and old_server_serves(config.socket_path, handback.provisional):
        # A take-over that never committed (its server died with the listener handed
        # to the keeper, the journal or not): the old server serves this node, on
        # that very listener.  Serving it too would be two servers on one socket.
        log.warning("the keeper's state is of a take-over that did not happen: taking over again")
        _close_handback(handback, listener)
        return take_over(config, device, link)
    if handback.mode is not Mode.RESUME or handback.base is None:
        for fd in handback.fds.values():
            os.close(fd)
        if listener is None and config.take_over:
            return take_over(config, device, link)
        return Start(listener, link=link)
    why_not = None
    if handback.failed_resumes >= MAX_FAILED_RESUMES:
        why_not = f"the last {handback.failed_resumes} servers failed resuming it (a crash, not a kill)"
    try:
        if why_not is not None:
            raise Unreplayable(why_not)
        image, log_, next_conn, kept = rebuild(
            handback.base, handback.tails, retain=config.event_log_retain, max_bytes=config.event_log_bytes,
            history=handback.history,
        )
    except Unreplayable as exc:
        folder = config.state_dir or os.path.dirname(os.path.abspath(config.socket_path))
        try:
            saved = save_journal(folder, _label(config), handback.base, handback.tails, str(exc))
        except OSError as failed:  # a full disk, say: without a copy, nothing is let go
            _close_handback(handback, listener)
            raise Unresumable(
                f"the state cannot be resumed ({exc}) and could not be saved to {folder} ({failed}): "
                "the keeper keeps it"
            ) from None
        log.error(
            "the state handed back by the keeper cannot be resumed (%s): saved to %s for `gms replay`; "
            "its memory is released and this server starts EMPTY", exc, saved,
        )
        for fd in handback.fds.values():
            os.close(fd)
        return Start(listener, discarded=Discarded(str(exc), saved, handback.old_pid), link=link)
    try:
        check_compatible(image.server, device)
    except TakeOverRefused as exc:  # another device: the node is not this server's to serve
        _close_handback(handback, listener)
        raise Unresumable(str(exc)) from None
    old_pid = handback.old_pid or image.server.pid
    handed = Handed("restart", image, log_, next_conn, dict(handback.fds), old_pid, handback.reason or "unknown",
                    whole=handback.whole, kept_seq=log_.last_seq, kept=kept)
    return Start(listener, handed=handed, link=link)


def fresh_config(config: ServerConfig, started: Started) -> ServerConfig:
    """A spare handed a node: the configuration in force now (gms.server.restart.freshness).
    Raises StaleCode, or Unresumable where the policy no longer loads (as a server
    started cold would stop: exit 78, the keeper keeping the node)."""
    try:
        return in_force(config, started)
    except PolicyError as exc:
        raise Unresumable(f"the policy cannot be used: {exc}") from None


def _close_handback(handback, listener) -> None:
    """This server's copies of what the keeper handed back (the keeper keeps its own)."""
    for fd in handback.fds.values():
        os.close(fd)
    if listener is not None:
        listener.close()


def old_server_serves(path: str, pid: int) -> bool:
    """Does the server a take-over was taking the place of still serve?  Gone
    (a pid this process can see, dead) or silent: no."""
    if pid > 0:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
    from ...client.probes import get_runtime_state
    from ...errors import GMSError

    try:
        get_runtime_state(path, timeout=2.0)
    except (GMSError, OSError):
        return False
    return True


def _label(config: ServerConfig) -> str:
    try:
        return device_id(config.device, config.backend)
    except Exception:  # noqa: BLE001 - a name for a file: the device number will do
        return f"device-{config.device}"


__all__ = ["Discarded", "Start", "TakeOverRefused", "fresh_config", "open_link", "prepare", "take_over"]
