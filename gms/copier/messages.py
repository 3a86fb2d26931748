"""The link between a server and its copier: small frames over a socketpair.

The link is a ``SOCK_SEQPACKET`` socketpair (the kernel keeps each frame whole):
one frame per message, a msgpack map ``{"type": name, field: value, ...}``,
with the fds it carries attached as ``SCM_RIGHTS``.  Both ends are gms's own
processes, so decoding checks the message name and its fields' shape, not
every type: a malformed frame is a bug, and the server answers it by
restarting the copier.

Server to copier:

* :class:`MapChunks`: keep these chunks of host memory mapped until told
  otherwise (one fd each).  Their set-access, the dear part of mapping host
  memory, is paid here, once per chunk, not per transfer.
* :class:`UnmapChunks`: the server released them (a chunk in use by a copy
  is unmapped when that copy ends).
* :class:`Copy`: move bytes between device allocations (one fd each, mapped
  for the copy only) and mapped chunks, to the host (a publish) or to the
  device (a restore).
* :class:`FileCopy`: move bytes between device allocations and a snapshot
  file (the disk tier, ``gms.disk``), checksummed per extent.

Copier to server: :class:`Ready` once it can copy, :class:`Done` per copy.
"""

from __future__ import annotations

import array
import os
import socket
from collections.abc import Iterable

import attrs
import msgpack

# A frame's body is small (ids, sizes, moves): the server caps moves per copy.
MAX_FRAME_BYTES = 1 << 20
MAX_FDS = 253  # the kernel's SCM_MAX_FD
MAX_MOVES = 2048  # per Copy: keeps a frame well under the socket's buffer


class LinkError(Exception):
    """A frame that cannot be read: truncated, not msgpack, an unknown message."""


@attrs.frozen
class MapChunks:
    """Map each chunk (``sizes[i]`` bytes, fd ``i``) and keep it mapped."""

    ids: list[str]
    sizes: list[int]


@attrs.frozen
class UnmapChunks:
    ids: list[str]


@attrs.frozen
class Copy:
    """Copy ``job``: device allocation ``i`` is fd ``i``, ``device_sizes[i]`` bytes.
    Move ``k`` copies ``size[k]`` bytes between allocation ``allocation[k]`` at
    ``offset[k]`` and the start of chunk ``chunk[k]``: into the chunk when
    ``to_host`` (a publish), out of it otherwise (a restore)."""

    job: int
    to_host: bool
    device_sizes: list[int]
    allocation: list[int]
    offset: list[int]
    chunk: list[str]
    size: list[int]


@attrs.frozen
class FileCopy:
    """Copy ``job`` between device allocations (fd ``i``, ``device_sizes[i]``
    bytes) and a snapshot file (the last fd).  Extent ``k`` is ``size[k]`` bytes
    of allocation ``allocation[k]`` at ``offset[k]``, at ``file_offset[k]`` in
    the file: written there when ``to_file`` (a save: ``Done.crcs`` says each
    extent's crc32), read from there otherwise (a restore: each extent checked
    against ``crc[k]``; a mismatch or a short read fails the copy as corrupt)."""

    job: int
    to_file: bool
    device_sizes: list[int]
    allocation: list[int]
    offset: list[int]
    file_offset: list[int]
    size: list[int]
    crc: list[int]


@attrs.frozen
class Ready:
    pid: int
    engine: str  # what moves the bytes (memmove, or CUDA streams)
    checksum: str = ""  # what checks them: the crc32's maker (gms.checksum.IMPLEMENTATION), for the server's log


@attrs.frozen
class Progress:
    """A file copy's extents done so far (one after each): its deadline follows them."""

    job: int
    extents: int


@attrs.frozen
class Done:
    """The copy ended: every byte landed (``error`` empty), or it failed, saying why."""

    job: int
    error: str = ""
    crcs: list[int] = attrs.field(factory=list)  # a save's, per extent
    corrupt: bool = False  # a restore found the file's bytes are not what was saved


_TRUNCATED = int(socket.MSG_TRUNC | socket.MSG_CTRUNC)  # a plain int: ``int & IntFlag`` runs the enum's operator
_TYPES = {cls.__name__: cls for cls in (MapChunks, UnmapChunks, Copy, FileCopy, Ready, Progress, Done)}


def encode(message: object) -> bytes:
    return msgpack.packb({"type": type(message).__name__, **attrs.asdict(message)}, use_bin_type=True)


def decode(body: bytes) -> object:
    try:
        raw = msgpack.unpackb(body, raw=False)
        cls = _TYPES[raw.pop("type")]
        return cls(**raw)
    except (ValueError, TypeError, KeyError, AttributeError, msgpack.UnpackException) as exc:
        raise LinkError(f"undecodable link frame: {exc!r}") from None


def fd_space(count: int = MAX_FDS) -> int:
    return socket.CMSG_SPACE(count * array.array("i").itemsize)


def unpack_fds(ancillary, flags: int) -> list[int]:
    """The fds a ``recvmsg`` brought; LinkError (after closing them) if anything was cut."""
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    if flags & _TRUNCATED:
        close_fds(fds)
        raise LinkError("a link frame or its fds were truncated")
    return list(fds)


def rights(fds) -> list[tuple[int, int, bytes]]:
    """The ancillary data that carries ``fds`` (none: nothing)."""
    if not fds:
        return []
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]


def send(sock: socket.socket, message: object, fds=()) -> None:
    """Blocking send of one frame (the copier's side)."""
    sock.sendmsg([encode(message)], rights(fds))


def receive(sock: socket.socket) -> tuple[object, list[int]] | None:
    """Blocking receive of one frame; None at the end of the link."""
    body, ancillary, flags, _ = sock.recvmsg(MAX_FRAME_BYTES, fd_space())
    fds = unpack_fds(ancillary, flags)
    if not body and not fds:
        return None
    try:
        return decode(body), fds
    except LinkError:
        close_fds(fds)
        raise


def extent_error(device_sizes: list[int], allocation: int, offset: int, size: int, what: str) -> str:
    """Why ``what`` (a move, an extent) is not inside its device allocation ('' if it is)."""
    if not 0 <= allocation < len(device_sizes):
        return f"{what} names allocation {allocation} of {len(device_sizes)}"
    if offset < 0 or size <= 0 or offset + size > device_sizes[allocation]:
        return f"{what} of {size} bytes at {offset} is outside its allocation"
    return ""


def close_fds(fds: Iterable[int]) -> None:
    """Close each; one closed already (or never valid) is no error: fds in
    transit are closed on every path, some twice."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
