"""Frames with fds: how a server, its keeper and a server taking over talk.

A frame is a header (the body's length, 4 bytes, and how many fds ride with
it, 2 bytes; big-endian) and a msgpack map with a string ``"t"`` (its kind).
Its fds (at most 253, the kernel's ``SCM_MAX_FD``) are attached to its first
byte with ``SCM_RIGHTS``; more fds take more frames.  On a Unix stream socket
the kernel hands a frame's fds over with the bytes they were sent with, so a
reader that keeps received fds in arrival order and gives each frame as many
as its header says gets each frame exactly its own.

:class:`FrameReader` is sans-IO (bytes and fds in, frames out).  The helpers
below it do blocking I/O on a plain socket; the Trio side of the server and
the keeper use :func:`encode_frame` and the reader the same way.  Nothing
here imports the core or CUDA: the keeper holds frames it never parses.
"""

from __future__ import annotations

import array
import os
import socket
import struct
from collections import deque

import attrs
import msgpack

HEADER = struct.Struct(">IH")
# One packer, made once: ``msgpack.packb`` makes one (and its buffer) per call.
_pack = msgpack.Packer(use_bin_type=True).pack
_MSG_CTRUNC = int(socket.MSG_CTRUNC)  # a plain int: ``int & IntFlag`` runs the enum's operator
MAX_FDS = 253  # SCM_MAX_FD
ANCILLARY_BYTES = socket.CMSG_SPACE(MAX_FDS * 4)
RECV_BYTES = 1 << 20
SCRATCH_BYTES = 256 << 10


class FrameError(Exception):
    """The other side broke the framing (or the kernel dropped fds): the channel is done."""


class ChannelClosed(FrameError):
    """The other side closed the channel (between frames)."""


@attrs.frozen
class Frame:
    kind: str
    body: dict
    fds: tuple[int, ...] = ()

    def close_fds(self) -> None:
        for fd in self.fds:
            os.close(fd)


def encode_frame(kind: str, body: dict | None = None, nfds: int = 0) -> bytes:
    if nfds > MAX_FDS:
        raise ValueError(f"at most {MAX_FDS} fds per frame, not {nfds}")
    payload = _pack({**(body or {}), "t": kind})
    return HEADER.pack(len(payload), nfds) + payload


BIG_BYTES = 64 << 10  # a frame past this is read straight into a buffer of its own


class FrameReader:
    """Feed what the socket gave (bytes, fds); take whole frames with their fds.

    A big frame (a state's part, a batch of events carrying a tenant's values)
    is read into a buffer of its size, through :meth:`space` and :meth:`wrote`
    (the kernel writes straight into it) or :meth:`feed`, and decoded in place:
    each byte is copied once on the way in, not at every read as a growing
    buffer copied it (the keeper took 1.35 ms per MiB; bench numbers in
    docs/performance.md)."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._start = 0  # bytes of _buffer already taken as frames
        self._big: bytearray | None = None  # the body of a big frame being read
        self._big_filled = 0
        self._big_head = (0, 0)  # its (length, nfds)
        self._fds: deque[int] = deque()
        self.eof = False
        self._scratch: bytearray | None = None

    @property
    def scratch(self) -> bytearray:
        """A receive buffer for this channel's reads (made once)."""
        if self._scratch is None:
            self._scratch = bytearray(SCRATCH_BYTES)
        return self._scratch

    @property
    def in_big_frame(self) -> bool:
        """Is a big frame being read (its rest goes to :meth:`space`)?"""
        return self._big is not None

    def space(self) -> memoryview:
        """Where the next bytes should go: the rest of a big frame, or the scratch
        buffer (then :meth:`wrote` says how many came)."""
        if self._big is not None:
            return memoryview(self._big)[self._big_filled:]
        return memoryview(self.scratch)

    def wrote(self, n: int, fds: list[int] | tuple[int, ...] = ()) -> None:
        """``n`` bytes were received into :meth:`space` (0 and no fds: the end)."""
        if self._big is not None:
            if not n and not fds:
                self.eof = True
            self._fds.extend(fds)
            self._big_filled += n
        else:
            self.feed(memoryview(self.scratch)[:n], fds)

    def feed(self, data, fds: list[int] | tuple[int, ...] = ()) -> None:
        if not data and not fds:
            self.eof = True
        self._fds.extend(fds)
        if self._big is not None and data:
            take = min(len(data), len(self._big) - self._big_filled)
            self._big[self._big_filled : self._big_filled + take] = data[:take]
            self._big_filled += take
            data = data[take:]
        if data:
            self._buffer += data

    def next_frame(self) -> Frame | None:
        """The next whole frame, or None; raises ChannelClosed at a clean end and
        FrameError inside a frame or for a frame without its fds."""
        if self._big is not None:
            if self._big_filled < len(self._big):
                if self.eof:
                    raise FrameError(f"the channel closed inside a frame ({self._big_filled} bytes)")
                return None
            body, (_, nfds) = memoryview(self._big), self._big_head
            self._big = None
            return self._frame(body, nfds)
        buffer, start = self._buffer, self._start
        if len(buffer) - start >= HEADER.size:
            length, nfds = HEADER.unpack_from(buffer, start)
            body_at = start + HEADER.size
            end = body_at + length
            if len(buffer) >= end:
                frame = self._frame(memoryview(buffer)[body_at:end], nfds)  # (decoded before the bytes go)
                self._take(end)
                return frame
            if length > BIG_BYTES:  # the rest goes straight into a buffer of its own
                big = bytearray(length)
                have = len(buffer) - body_at
                big[:have] = memoryview(buffer)[body_at:]
                self._big, self._big_filled, self._big_head = big, have, (length, nfds)
                self._take(len(buffer))
                return self.next_frame()
        if self.eof:
            if len(buffer) > start:
                raise FrameError(f"the channel closed inside a frame ({len(buffer) - start} bytes)")
            raise ChannelClosed("the other side closed the channel")
        return None

    def _take(self, end: int) -> None:
        """Bytes up to ``end`` were taken: forget them (all at once, now and then)."""
        if end >= len(self._buffer):
            self._buffer, self._start = bytearray(), 0
        elif end > SCRATCH_BYTES:
            del self._buffer[:end]
            self._start = 0
        else:
            self._start = end

    def _frame(self, body: memoryview, nfds: int) -> Frame:
        if len(self._fds) < nfds:
            raise FrameError(f"a frame announced {nfds} fds and {len(self._fds)} came")
        try:
            decoded = msgpack.unpackb(body, raw=False, strict_map_key=False)
            kind = decoded.pop("t")
        except Exception as exc:  # the peer is ours, but a broken frame ends the channel
            raise FrameError(f"an undecodable frame: {exc!r}") from None
        finally:
            body.release()
        fds = tuple(self._fds.popleft() for _ in range(nfds))
        return Frame(kind, decoded, fds)

    def close(self) -> None:
        """Close fds received for frames never read."""
        while self._fds:
            os.close(self._fds.popleft())


def received_fds(ancillary) -> list[int]:
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(array.array("i", payload[: len(payload) - len(payload) % 4]))
    return fds


def check_flags(flags: int, fds: list[int]) -> None:
    if flags & _MSG_CTRUNC:
        for fd in fds:
            os.close(fd)
        raise FrameError("the kernel dropped fds (ancillary data truncated)")


def ancillary_for(fds) -> list:
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []


# -- blocking I/O --------------------------------------------------------------------


def send_frame(sock: socket.socket, kind: str, body: dict | None = None, fds=()) -> None:
    """Send one frame, its fds (at most 253) with its first byte."""
    data = memoryview(encode_frame(kind, body, len(fds)))
    sent = sock.sendmsg([data], ancillary_for(fds))
    if sent < len(data):
        sock.sendall(data[sent:])


def send_fds(sock: socket.socket, kind: str, keyed: list[tuple[str, int]], body: dict | None = None) -> None:
    """Send (key, fd) pairs in frames of at most 253 fds, each frame naming its keys."""
    for start in range(0, len(keyed), MAX_FDS):
        batch = keyed[start : start + MAX_FDS]
        send_frame(sock, kind, {**(body or {}), "keys": [k for k, _ in batch]}, [fd for _, fd in batch])


def recv_into(sock: socket.socket, reader: FrameReader) -> None:
    """One receive; blocks (or times out, as the socket is set)."""
    n, ancillary, flags, _ = sock.recvmsg_into([reader.space()], ANCILLARY_BYTES)
    fds = received_fds(ancillary)
    check_flags(flags, fds)
    reader.wrote(n, fds)


def recv_frame(sock: socket.socket, reader: FrameReader) -> Frame:
    """The next frame, receiving as needed; ChannelClosed at a clean end."""
    while True:
        frame = reader.next_frame()
        if frame is not None:
            return frame
        recv_into(sock, reader)
