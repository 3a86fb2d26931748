"""Live take-over: a new server takes a running one's place, nothing lost, no client told.

The conversation, on one connection to the running server's own socket::

    new                                       old
    TakeOverRequest(readable_versions) ──►    (the server's uid or root; a version both know)
                                              stops accepting; pauses every session at a
                                              quiet point (gms.server.service.quiesce), within
                                              --handover-timeout, else refuses and serves on
                                 ◄──────────  TakeOverResponse(state_version)
                                 ◄──────────  frame "image": the state image (versioned)
                                 ◄──────────  frames "fds": memory, host copies, the
                                              listening socket, every client's socket,
                                              at most 253 fds a frame, each named by key
                                 ◄──────────  frame "end"
    decodes, adopts, takes the node;
    hands its keeper everything
    frame "commit" ──────────────────────►    tells its keeper it was taken over
                                 ◄──────────  frame "bye"; exits without releasing
                                              anything or removing the socket
    serves (accepts, and every
    handed connection goes on)

Anything the new server cannot take (a version it does not read, another
device, memory that does not adopt, a configuration that cannot hold the
node) it answers with frame "abort" and a reason; the old server, which has
let go of nothing, resumes every session where it stopped and serves on.  So
does an old server whose new one goes silent or away before "commit".
Before the commit the old server holds everything; after it, the new one:
neither ever lets go first.

A new server asks for a pre-copy (``precopy``; an old server that does not
know it answers as above): the old one then answers at once, serving on, and
sends frame "base" (the node as of an event); once the new one answers
"ready" it pauses, and frame "tail" (the events since the base, and the
sessions) takes the image's place, so the pause carries what changed, not
the node (docs/protocol.md, "Take-over").

Images and frames are encoded in ``gms.handover``; this module is the
shell's two sides of the conversation.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat

import attrs
import trio

from ...fsm import EMPTY_NODE, check_invariants, fold_all
from ...handover import frames
from ...handover.image import (
    READABLE_VERSIONS,
    STATE_VERSION,
    ConnImage,
    ImageError,
    ProtocolImage,
    ServerInfo,
    StateImage,
    UnsupportedVersion,
    decode_entries,
    decode_image,
    encode_entries,
    encode_image,
)
from ...handover.words import Leaving
from ...store import EventLog
from ...system.cyclegc import paused
from ...system.fds import fd_room, handover_need
from ...system.peer import UntrustedPeer, own_uids, require_peer
from ...wire import FrameDecoder, ProtocolError, decode, encode
from ...wire import messages as m
from ..edge.netio import Channel
from .mirror import LISTENER, memory_key, split_key
from .resume import TakeOverRefused

# Restarts and take-overs are rare and each line matters: not under "gms.server",
# whose repeated lines are rate-limited (gms.server.edge.ratelimit).
log = logging.getLogger("gms.server.restart")

CONN_PREFIX = "conn:"


# -- the old server's side ---------------------------------------------------------------


def session_image(session, now: float, paused: float | None = None) -> ConnImage:
    """A parked session as data (its socket travels beside it); ``paused``: when
    the pause began (a first-request deadline stops counting there)."""
    protocol = ProtocolImage(**session.protocol.freeze())
    pending = session.waits.image(now)
    first_left = None
    if not protocol.requests:  # no request yet: its first one's deadline goes on where the pause stopped it
        first_left = max(0, int((session.first_by - min(now, paused or now)) * 1000))
    return ConnImage(session.conn, protocol, pending, first_left)


def server_info(server) -> ServerInfo:
    device = server.core.device
    return ServerInfo(os.getpid(), device.backend, device.device, device.uuid, server.host_tier is not None)


def node_image(server, parked: dict, *, sessions: bool = True) -> StateImage:
    """The node as data: with the parked sessions and the lock queues for a
    take-over, without them for the keeper (a crash closes every connection)."""
    core = server.core
    now = trio.current_time()
    conns = tuple(session_image(parked[conn], now, server.quiesce.paused_at) for conn in sorted(parked))
    queues = tuple((layout, tuple(waiting)) for layout, waiting in core.queues.order()) if sessions else ()
    return StateImage(STATE_VERSION, server_info(server), core.log.last_seq, core.next_conn, core.state, conns, queues)


def handover_fds(server, parked: dict) -> list[tuple[str, int]]:
    """(key, fd) of everything a take-over hands on: memory, the listener, the clients."""
    keyed = [
        (memory_key(tier.value, i), fd)
        for tier, memory in server.core.ledger.tiers.items()
        for i, fd in memory.held_fds()
    ]
    keyed.append((LISTENER, server.listener.fileno()))
    keyed += [(f"{CONN_PREFIX}{conn}", parked[conn].channel.sock.fileno()) for conn in sorted(parked)]
    return keyed


def _verdict(sock: socket.socket) -> str:
    """The new server's next word: its frame's kind, with the reason it gives, if any."""
    reader = frames.FrameReader()
    try:
        frame = frames.recv_frame(sock, reader)
    finally:
        reader.close()
    frame.close_fds()
    reason = frame.body.get("reason", "")
    return f"{frame.kind}: {reason}" if reason else frame.kind


def _send_base_blocking(sock: socket.socket, first: bytes, base: StateImage, timeout: float) -> str:
    """Pre-copy, while this server serves on: the answer and the node as of an
    event; then the new server's word (``ready`` once it read and checked it)."""
    sock.settimeout(timeout)
    sock.sendall(first)
    frames.send_frame(sock, "base", {"image": encode_image(base)})
    return _verdict(sock)


def _hand_over_blocking(sock: socket.socket, first: bytes, kind: str, body: dict, keyed, timeout: float) -> str:
    """Send the answer (unless pre-copied), the image or the tail, and the fds;
    return the new server's verdict (``commit`` or why not)."""
    sock.settimeout(timeout)
    if first:
        sock.sendall(first)
    frames.send_frame(sock, kind, body)
    frames.send_fds(sock, "fds", keyed)
    frames.send_frame(sock, "end")
    return _verdict(sock)


def tail_body(log: EventLog, base: StateImage, image: StateImage, fds: int) -> dict:
    """What changed since the pre-copied ``base``: the events after it, and the
    image without its node (sessions, queues, numbering); the whole image where
    the log no longer holds every event since (its retention, a numbering gap)."""
    entries = log.since(base.last_seq)
    if len(entries) != image.last_seq - base.last_seq:
        return {"image": encode_image(image), "fds": fds}
    bare = attrs.evolve(image, state=EMPTY_NODE)
    return {"image": encode_image(bare), "entries": encode_entries(entries), "fds": fds}


def listening_socket(fd: int) -> None:
    """Is ``fd`` a listening Unix stream socket (what a server hands over as its
    listener)?  ImageError if not: the take-over is refused, not served from it."""
    try:
        mode = os.fstat(fd).st_mode
        probe = socket.socket(fileno=os.dup(fd)) if stat.S_ISSOCK(mode) else None
    except OSError as exc:
        raise ImageError(f"the handed listener is unusable: {exc}") from None
    if probe is None:
        raise ImageError("the handed listener is not a socket")
    with probe:
        ok = (probe.family, probe.type) == (socket.AF_UNIX, socket.SOCK_STREAM) and probe.getsockopt(
            socket.SOL_SOCKET, socket.SO_ACCEPTCONN
        )
    if not ok:
        raise ImageError("the handed listener is not a listening Unix stream socket")


async def hand_over(server, channel: Channel, protocol, request: m.TakeOverRequest) -> None:
    """Answer a TakeOverRequest on ``channel`` (the connection is ours now)."""
    core = server.core
    peer = channel.peer

    async def refuse(message: str, code: str = "STATE_VIOLATION") -> None:
        log.warning("take-over by pid %d refused: %s", peer.pid, message)
        try:
            await channel.send(protocol.send(m.ErrorResponse(message, code)))
        except Exception:  # noqa: BLE001 - it is gone: nothing to tell it
            pass
        channel.close()

    if peer.uid not in (0, core.server_uid):
        return await refuse(f"uid {peer.uid} may not take this server over (its uid {core.server_uid} or root)",
                            "PERMISSION_DENIED")
    if STATE_VERSION not in request.readable_versions:
        return await refuse(
            f"this server hands over state version {STATE_VERSION}; the new one reads "
            f"{sorted(request.readable_versions)}: upgrade through a version both know"
        )
    if server.quiesce.requested or server.handing_over:
        return await refuse("a take-over is already under way")
    server.handing_over = True
    sock = socket.socket(fileno=os.dup(channel.sock.fileno()))
    try:
        await _hand_over(server, channel, protocol, request, sock, refuse)
    finally:
        server.handing_over = False
        sock.close()
        channel.close()


async def _hand_over(server, channel: Channel, protocol, request: m.TakeOverRequest, sock, refuse) -> None:
    core, config, peer = server.core, server.config, channel.peer
    timeout = config.handover_timeout
    base = None
    if request.precopy:
        # Pre-copy (issue 59): the node as of now, while every session goes on (the
        # state is immutable); the pause then carries only what changed since.
        base = node_image(server, {}, sessions=False)
        first = protocol.send(
            m.TakeOverResponse(STATE_VERSION, os.getpid(), len(handover_fds(server, {})), precopy=True)
        )
        log.info("take-over by pid %d: sending the node as of event %d, serving on", peer.pid, base.last_seq)
        try:
            word = await trio.to_thread.run_sync(_send_base_blocking, sock, first, base, timeout)
        except (OSError, frames.FrameError) as exc:
            word = f"the new server went away: {exc}"
        if word != "ready":
            log.warning("take-over by pid %d did not happen (%s): serving on, never paused", peer.pid, word)
            return
    log.info("take-over by pid %d: pausing at a quiet point", peer.pid)
    started = trio.current_time()
    server.stop_accepting()
    server.quiesce.pause()
    with trio.move_on_after(timeout) as waited:
        await server.quiesce.until_quiet_dropping_stuck()
    if waited.cancelled_caught:
        server.resume_serving()
        message = f"no quiet point within {timeout} s (a client not reading its answers?)"
        if base is None:
            return await refuse(message)
        log.warning("take-over by pid %d refused: %s", peer.pid, message)
        with contextlib.suppress(OSError):
            frames.send_frame(sock, "abort", {"reason": message})
        return
    image = node_image(server, server.quiesce.parked)
    keyed = handover_fds(server, server.quiesce.parked)
    if base is None:
        first = protocol.send(m.TakeOverResponse(STATE_VERSION, os.getpid(), len(keyed)))
        kind, body = "image", {"image": encode_image(image)}
    else:  # answered already
        first, kind, body = b"", "tail", tail_body(core.log, base, image, len(keyed))
    try:
        verdict = await trio.to_thread.run_sync(_hand_over_blocking, sock, first, kind, body, keyed, timeout)
        if verdict == "commit":
            # The keeper first: were this process to die now, its keeper must not
            # start a server of its own on a node another one serves.
            verdict = await _tell_keeper(server, timeout)
            try:
                frames.send_frame(sock, "bye" if verdict == "commit" else "refused", {"reason": verdict})
            except OSError:
                pass  # it sees our silence, and that this process is gone
    except (OSError, frames.FrameError) as exc:
        verdict = f"the new server went away: {exc}"
    paused_ms = (trio.current_time() - started) * 1000
    if verdict == "commit":
        log.info("taken over by pid %d after a pause of %.1f ms: exiting", peer.pid, paused_ms)
        server.handed_over()
        return
    log.warning("take-over by pid %d did not happen (%s): serving on after a pause of %.1f ms",
                peer.pid, verdict, paused_ms)
    server.resume_serving()


async def _tell_keeper(server, timeout: float) -> str:
    """Tell this server's keeper it was taken over; ``commit``, or why not (its
    keeper did not take the word in time: the take-over does not happen)."""
    link = server.link
    if link is None or not link.alive:
        return "commit"
    link.stopping(Leaving.TAKEN_OVER)
    with trio.move_on_after(timeout):
        await link.durable()
    if link.alive and link.behind():
        link.ready()  # serving on: the keeper's last word is this one
        return f"this server's keeper read nothing for {timeout} s"
    server.link = None
    return "commit"


# -- the new server's side ----------------------------------------------------------------


@attrs.frozen
class Offer:
    """What a running server handed over, before this server commits to it."""

    sock: socket.socket
    image: StateImage
    listener: int
    fds: dict  # memory key -> fd
    conn_fds: dict  # conn -> socket fd
    old_pid: int

    def close_fds(self) -> None:
        for fd in [self.listener, *self.fds.values(), *self.conn_fds.values()]:
            os.close(fd)


def _connect(path: str, timeout: float) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        sock.close()
        return None
    return sock


def _answer(sock: socket.socket, reader: frames.FrameReader):
    """The server's (wire-framed) answer; bytes and fds after it go to ``reader``."""
    decoder = FrameDecoder()
    fds: list[int] = []
    while True:
        body = decoder.next_frame()
        if body is not None:
            rest = decoder.unread()
            if rest or fds:  # the hand-over's first frames, read with the answer
                reader.feed(rest, fds)
            return decode(body)
        data, ancillary, flags, _ = sock.recvmsg(frames.RECV_BYTES, frames.ANCILLARY_BYTES)
        got = frames.received_fds(ancillary)
        frames.check_flags(flags, got)
        fds += got
        if not data:
            raise TakeOverRefused("the running server closed the connection without answering")
        decoder.feed(data)


def request_take_over(path: str, timeout: float) -> Offer | None:
    """Ask the server on ``path`` for its place; None when nothing listens there.
    Raises TakeOverRefused (the old server serves on)."""
    sock = _connect(path, timeout)
    if sock is None:
        return None
    try:  # it hands over memory other tenants' readers will trust: only a server of ours
        old = require_peer(sock, own_uids(), f"the server on {path}")
    except UntrustedPeer as exc:
        sock.close()
        raise TakeOverRefused(str(exc)) from None
    reader = frames.FrameReader()
    try:
        sock.sendall(encode(m.TakeOverRequest(list(READABLE_VERSIONS), os.getpid(), precopy=True)))
        try:
            answer = _answer(sock, reader)
        except (ProtocolError, OSError) as exc:
            raise TakeOverRefused(f"the running server did not answer: {exc}") from None
        if isinstance(answer, m.ErrorResponse):
            if answer.code == "UNKNOWN_MESSAGE":
                raise TakeOverRefused("the running server is too old to be taken over (it has no take-over)")
            raise TakeOverRefused(f"the running server refused: {answer.error}")
        if not isinstance(answer, m.TakeOverResponse):
            raise TakeOverRefused(f"the running server answered {type(answer).__name__}")
        short = fd_shortfall(answer.fds)
        if short:  # before anything is taken: the old server, told, serves on alone
            abort(sock, short)
            raise TakeOverRefused(short)
        # A server that pre-copies sends the node first, serving on: read and checked
        # here before it pauses, so that the pause carries only what changed since.
        base = _precopied(sock, reader) if answer.precopy else None
        keyed: dict[str, int] = {}
        try:
            image_frame = frames.recv_frame(sock, reader)
            due = "image" if base is None else "tail"
            if image_frame.kind == "abort" and base is not None:
                raise TakeOverRefused(f"the running server refused: {image_frame.body.get('reason', '')}")
            if image_frame.kind != due or not isinstance(image_frame.body.get("image"), bytes):
                image_frame.close_fds()
                raise frames.FrameError(f"a {image_frame.kind!r} frame where the {due} was due")
            short = fd_shortfall(image_frame.body.get("fds", 0)) if base is not None else ""
            if short:  # the node grew during the pre-copy: still before any fd came
                abort(sock, short)
                raise TakeOverRefused(short)
            while True:
                frame = frames.recv_frame(sock, reader)
                if frame.kind == "end":
                    break
                keys = frame.body.get("keys")
                if (
                    frame.kind != "fds" or not isinstance(keys, list) or len(keys) != len(frame.fds)
                    or not all(isinstance(key, str) and key not in keyed for key in keys)
                ):
                    frame.close_fds()
                    raise frames.FrameError(f"a malformed {frame.kind!r} frame among the fds")
                keyed.update(zip(keys, frame.fds))
        except (OSError, frames.FrameError) as exc:
            _close_fds(keyed.values())
            abort(sock, f"the hand-over broke off: {exc}")
            raise TakeOverRefused(f"the hand-over broke off: {exc}") from None
        listener = keyed.pop(LISTENER, None)
        conn_fds = {
            int(k[len(CONN_PREFIX):]): keyed.pop(k)
            for k in list(keyed) if k.startswith(CONN_PREFIX) and k[len(CONN_PREFIX):].isdigit()
        }
        offer_fds = {k: fd for k, fd in keyed.items() if split_key(k)[0] in ("gpu", "host")}
        _close_fds(keyed[k] for k in set(keyed) - set(offer_fds))
        try:
            if listener is None:
                raise ImageError("the running server handed over no listening socket")
            listening_socket(listener)
            with paused():
                image = handed_image(base, image_frame.body)
        except Exception as exc:  # noqa: BLE001 - whatever does not check out is refused, not served
            _close_fds([fd for fd in [listener, *offer_fds.values(), *conn_fds.values()] if fd is not None])
            abort(sock, str(exc))
            raise TakeOverRefused(f"the handed state is not one to serve: {exc}") from None
        return Offer(sock, image, listener, offer_fds, conn_fds, old.pid)
    except BaseException:
        reader.close()
        sock.close()
        raise


def _precopied(sock: socket.socket, reader: frames.FrameReader) -> StateImage:
    """The node a pre-copying server sent as of an event, read and checked (it
    then pauses); TakeOverRefused, the old server told, if it does not check out."""
    try:
        frame = frames.recv_frame(sock, reader)
        frame.close_fds()
        if frame.kind != "base" or not isinstance(frame.body.get("image"), bytes):
            raise frames.FrameError(f"a {frame.kind!r} frame where the base was due")
        with paused():
            base = decode_image(frame.body["image"])
            check_invariants(base.state)
    except Exception as exc:  # noqa: BLE001 - whatever does not check out is refused, not served
        abort(sock, f"the pre-copied node is not one to serve: {exc}")
        raise TakeOverRefused(f"the pre-copied node is not one to serve: {exc}") from None
    frames.send_frame(sock, "ready")
    return base


def handed_image(base: StateImage | None, body: dict) -> StateImage:
    """The node handed over: the whole image; or, after a pre-copy, the base with
    the events since folded in (each checked by the rules, as the old server's
    were), and the sessions, queues and numbering of the tail's bare image."""
    image = decode_image(body["image"])
    if base is None or "entries" not in body:
        # Checked as a restart's journal is: a forged or broken image is refused, not served.
        check_invariants(image.state)
        return image
    if image.version != base.version:
        raise ImageError(f"a tail of version {image.version} after a base of version {base.version}")
    state = fold_all([entry.event for entry in decode_entries(body["entries"])], base.state)
    return attrs.evolve(image, state=state)


def fd_shortfall(handed: int) -> str:
    """Why this process cannot take ``handed`` fds over ("" if it can): the whole
    node or nothing, never half of it on one listener beside the old server."""
    room = fd_room()
    need = handover_need(handed)
    if not handed or room is None or need <= room:
        return ""
    return (f"the hand-over carries {handed} fds and this server needs {need} open at once, but may open "
            f"{room} more (ulimit -n): raise the open-files limit of the new gms serve "
            "(docs/operations.md, 'File descriptors')")


def _close_fds(fds) -> None:
    for fd in fds:
        os.close(fd)


def abort(sock: socket.socket, reason: str) -> None:
    """Tell the old server to serve on (best effort: silence tells it too)."""
    try:
        frames.send_frame(sock, "abort", {"reason": reason})
    except OSError:
        pass
    sock.close()


def commit(offer: Offer, timeout: float) -> None:
    """Take the place: the old server stops; raises TakeOverRefused if it serves on."""
    sock = offer.sock
    sock.settimeout(timeout)
    reader = frames.FrameReader()
    try:
        frames.send_frame(sock, "commit")
        frame = frames.recv_frame(sock, reader)
    except (OSError, frames.FrameError) as exc:
        # Silence: it either took our commit and died, or never got it.  Only a
        # live old server can be serving: check that it is gone.
        if _alive(offer.old_pid):
            raise TakeOverRefused(f"the old server (pid {offer.old_pid}) did not confirm: {exc}") from None
        return
    finally:
        reader.close()
        sock.close()
    if frame.kind != "bye":
        raise TakeOverRefused(f"the old server answered the commit with {frame.kind!r}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


__all__ = [
    "Offer",
    "TakeOverRefused",
    "UnsupportedVersion",
    "abort",
    "commit",
    "hand_over",
    "node_image",
    "request_take_over",
    "session_image",
]
