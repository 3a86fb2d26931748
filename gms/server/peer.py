"""Who is on the other end of a Unix socket, as the kernel says (SO_PEERCRED)."""

from __future__ import annotations

import socket
import struct

import attrs

_UCRED = struct.Struct("3i")  # pid, uid, gid


@attrs.frozen
class Peer:
    pid: int
    uid: int
    gid: int


def peer_of(sock) -> Peer:
    """Credentials taken by the kernel when the peer connected: never from the client."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return Peer(*_UCRED.unpack(raw))
