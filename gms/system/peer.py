"""Who is on the other end of a Unix socket, as the kernel says (SO_PEERCRED).

Identity comes from the kernel, never from what a peer says.  Every endpoint
that hands over fds or state checks its peer with :func:`require_peer`: the
server its clients (``gms.server.edge.admission``), a client its server
(``gms.client.transport``), a server its keeper and a keeper its server, a
new server the old one it takes over and the old one the new.
"""

from __future__ import annotations

import os
import socket
import struct

import attrs

_UCRED = struct.Struct("3i")  # pid, uid, gid
SERVER_UIDS_ENV = "GMS_SERVER_UIDS"  # uids a client trusts as its server, beside root and its own


@attrs.frozen
class Peer:
    pid: int
    uid: int
    gid: int


class UntrustedPeer(ConnectionError):
    """The process on the other end is not one this side may trust."""


def peer_of(sock) -> Peer:
    """Credentials taken by the kernel when the peer connected: never from the client."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return Peer(*_UCRED.unpack(raw))


def own_uids() -> frozenset[int]:
    """Root and this process's uid: who may hold a gms node this process serves or uses."""
    return frozenset({0, os.getuid()})


def trusted_server_uids() -> frozenset[int]:
    """Whose server a client talks to: root, its own uid, and the uids in
    ``$GMS_SERVER_UIDS`` (comma-separated: a daemon run as a user of its own)."""
    extra = os.environ.get(SERVER_UIDS_ENV, "")
    try:
        named = {int(part) for part in extra.replace(",", " ").split()}
    except ValueError:
        raise UntrustedPeer(f"{SERVER_UIDS_ENV}={extra!r} is not a list of uids") from None
    return own_uids() | named


def require_peer(sock, allowed: frozenset[int], what: str) -> Peer:
    """The peer of ``sock``, if its uid is ``allowed``; else UntrustedPeer naming ``what``."""
    peer = peer_of(sock)
    if peer.uid not in allowed:
        raise UntrustedPeer(
            f"{what} is run by uid {peer.uid} (pid {peer.pid}), not by one this process trusts "
            f"({', '.join(map(str, sorted(allowed)))})"
        )
    return peer
