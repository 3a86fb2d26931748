"""A new server's first words with its keeper: hello, and the hand-back read in
full (blocking: before serving, or in a thread).  What the hand-back says is
:class:`Handback`; what the link keeps of the conversation (a spare that stood
by, the keys the keeper holds, the pids the kernel bears out) comes with it
(:class:`Received`).  ``gms.server.restart.mirror`` is the link that goes on
from here."""

from __future__ import annotations

import logging
import os
import socket

import attrs

from ...handover import frames
from ...handover.image import STATE_VERSION
from ...handover.words import Mode, Say
from ...system.peer import peer_of

log = logging.getLogger("gms.server.restart")  # (as the link's: each line of a restart matters)
LISTENER = "listener"

@attrs.frozen
class Handback:
    """What the keeper handed a new server.

    ``mode``: ``fresh`` (an empty node, on ``listener`` if the keeper holds one,
    else the server binds or takes over), ``resume`` (the last server died:
    ``base`` and ``tails`` are its journal, ``fds`` its memory), ``retired``
    (this keeper's server was taken over by another: serve nothing).
    ``base`` is an image (bytes) or, from a keeper that keeps parts, a dict of them."""

    mode: Mode
    listener: int | None = None
    base: bytes | dict | None = None
    tails: tuple[bytes, ...] = ()
    fds: dict = attrs.field(factory=dict)  # key -> fd
    old_pid: int = 0
    reason: str = ""
    provisional: int | None = None  # the journal is a take-over's, not committed: the old server's pid
    failed_resumes: int = 0  # servers that died resuming this journal before serving
    features: frozenset = frozenset()
    whole: bool = False  # the last server left the journal whole (a planned restart): no numbering gap
    history: tuple = ()  # (first, last, count, blob) batches before the base: shown, not folded (gms.store.prior)


def _mode(word) -> Mode:
    try:
        return Mode(word)
    except ValueError:
        raise KeeperGone(f"the keeper handed back in a mode this server does not know: {word!r}") from None


def _keeper_pids(sock: socket.socket, body: dict) -> tuple[int, int]:
    """(keeper, service) pids as the keeper named them, where the kernel bears
    them out: the socket's peer is that keeper (or this process, which made the
    channel for a keeper it started).  A keeper seen from another pid namespace
    (another container) names pids that mean nothing here: (0, 0)."""
    keeper, service = (v if type(v) is int and v > 0 else 0 for v in (body.get("keeper_pid"), body.get("service_pid")))
    try:
        seen = peer_of(sock).pid
    except OSError:
        seen = 0
    return (keeper, service) if seen in (keeper, os.getpid()) and keeper else (0, 0)


class KeeperGone(Exception):
    """The keeper channel broke."""


@attrs.frozen
class Received:
    handback: Handback
    stood_by: bool  # this server was a spare: the node came long after it started
    keys: set  # what the keeper holds by fd (the listener's key too)
    keeper_pid: int
    service_pid: int


def receive_handback(sock: socket.socket, device: str, timeout: float | None) -> Received:
    """Hello, and the keeper's hand-back read to its end; KeeperGone if the channel
    breaks or the keeper says something else."""
    stood_by = False
    sock.settimeout(timeout)
    try:
        frames.send_frame(sock, Say.HELLO, {"pid": os.getpid(), "device": device, "version": STATE_VERSION})
        reader = frames.FrameReader()
        head = frames.recv_frame(sock, reader)
        if head.kind == Say.STANDBY:  # a spare: the node comes when the server before it is gone
            log.info("pid %d standing by for the keeper's node (the server serving it is alive)", os.getpid())
            sock.settimeout(None)
            head = frames.recv_frame(sock, reader)
            sock.settimeout(timeout)
            stood_by = True
        if head.kind != Say.HANDBACK:
            head.close_fds()
            raise KeeperGone(f"the keeper answered {head.kind!r}, not a hand-back")
        fds: dict[str, int] = {}
        listener = None
        while True:
            frame = frames.recv_frame(sock, reader)
            if frame.kind == Say.END:
                break
            if frame.kind != Say.FDS or len(frame.body.get("keys", ())) != len(frame.fds):
                frame.close_fds()
                raise KeeperGone(f"the keeper sent {frame.kind!r} inside a hand-back")
            for key, fd in zip(frame.body["keys"], frame.fds):
                if key == LISTENER:
                    listener = fd
                else:
                    fds[key] = fd
        if stood_by:  # a spare says it is alive and has the node (else the keeper starts another)
            frames.send_frame(sock, Say.TAKING, {})
    except (OSError, frames.FrameError) as exc:
        raise KeeperGone(f"the keeper channel broke during the hand-back: {exc}") from exc
    finally:
        sock.settimeout(None)  # blocking: sends pass MSG_DONTWAIT, reads too
    body = head.body
    features = frozenset(body.get("features", ()))
    keeper_pid, service_pid = _keeper_pids(sock, body)
    handback = Handback(
        mode=_mode(body.get("mode")), listener=listener, base=body.get("base"), tails=tuple(body.get("tails", ())),
        fds=fds, old_pid=body.get("old_pid", 0), reason=body.get("reason", ""),
        provisional=body.get("provisional"), failed_resumes=body.get("failed_resumes", 0),
        features=features, whole=bool(body.get("whole")), history=tuple(body.get("history", ())),
    )
    return Received(handback, stood_by, set(fds) | ({LISTENER} if listener is not None else set()),
                    keeper_pid, service_pid)
