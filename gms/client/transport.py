"""The blocking RPC transport (internal): one socket, one request at a time.

Each call sends a frame and reads exactly one response frame, collecting any
fds that ride with it.  A lock makes a request/response pair atomic, so the
transport may be shared by threads.
"""

from __future__ import annotations

import array
import os
import socket
import threading
import time
from typing import TypeVar

from ..errors import GMSConnectionError, GMSProtocolError, GMSServerError, QuotaExceededError
from ..wire import FrameDecoder, ProtocolError, UnknownMessageType, decode, encode
from ..wire import messages as m
from ..wire.messages import MAX_FDS_PER_MESSAGE

T = TypeVar("T")

_RECV_BYTES = 256 * 1024
_ANCILLARY_BYTES = socket.CMSG_SPACE(MAX_FDS_PER_MESSAGE * array.array("i").itemsize)
# The client trusts its server, but not without bound.
CLIENT_MAX_FRAME_BYTES = 1 << 30
# Waking a process blocked in recv costs tens of microseconds on many hosts,
# more than the server needs to answer.  So the client first polls for the
# answer, for up to GMS_CLIENT_SPIN_US (0 turns polling off), and falls back
# to blocking.  Polling only pays when answers are quick: the process keeps a
# moving average of response times per request type and polls only while it
# is under half the window, so on a loaded machine nobody spins: with 64
# clients on 2 cores (answers in ~200 µs) polling clients took CPU the server
# needed (docs/performance.md, section 3).  Handshakes always poll: their
# time includes lock waits, which say nothing about the server's speed.
DEFAULT_SPIN_US = 200.0
_response_times: dict[type, float] = {}


def _connect(socket_path: str, timeout: float | None) -> socket.socket:
    """Connect, waiting out a full listen backlog (a storm of clients starting at
    once): a non-blocking AF_UNIX connect fails with EAGAIN instead of waiting."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = 0.001
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(timeout)
        try:
            sock.connect(socket_path)
        except BlockingIOError as exc:
            sock.close()
            if deadline is not None and time.monotonic() + pause > deadline:
                raise GMSConnectionError(f"gms server at {socket_path} is not accepting: {exc}") from exc
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
            continue
        except OSError as exc:
            sock.close()
            raise GMSConnectionError(f"no gms server at {socket_path}: {exc}") from exc
        sock.settimeout(None)
        return sock


def _observe(kind: type, sent_at: float) -> None:
    if kind is not m.HandshakeRequest:
        average = _response_times.get(kind, 0.0)
        _response_times[kind] = average + 0.2 * (time.perf_counter() - sent_at - average)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def server_error(response: m.ErrorResponse) -> GMSServerError:
    if response.code == "QUOTA_EXCEEDED" and None not in (response.used, response.asked, response.quota):
        return QuotaExceededError(
            response.error, scope=response.scope, used=response.used, asked=response.asked, quota=response.quota
        )
    return GMSServerError(response.code, response.error)


class RpcTransport:
    def __init__(
        self,
        socket_path: str,
        *,
        connect_timeout: float | None = 10.0,
        spin_us: float | None = None,
    ) -> None:
        self.socket_path = socket_path
        sock = _connect(socket_path, connect_timeout)
        self._sock: socket.socket | None = sock
        self._decoder = FrameDecoder(CLIENT_MAX_FRAME_BYTES)
        # recvmsg() would allocate (and for big sizes mmap) a buffer per call.
        self._buffer = bytearray(_RECV_BYTES)
        self._lock = threading.Lock()
        if spin_us is None:
            spin_us = float(os.environ.get("GMS_CLIENT_SPIN_US", DEFAULT_SPIN_US))
        self._spin_s = spin_us / 1e6

    @property
    def closed(self) -> bool:
        return self._sock is None

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def call(self, request: object, expect: type[T]) -> tuple[T, list[int]]:
        """Send ``request``; return the ``expect`` response and the fds that came with it.

        The caller owns (and must close) the returned fds.
        """
        with self._lock:
            sock = self._sock
            if sock is None:
                raise GMSConnectionError("the connection is closed")
            try:
                sock.sendall(encode(request))
                body, fds = self._read_frame(sock, time.perf_counter(), type(request))
            except OSError as exc:
                raise GMSConnectionError(f"connection to {self.socket_path} failed: {exc}") from exc
        try:
            response = decode(body)
        except (ProtocolError, UnknownMessageType) as exc:
            _close_all(fds)
            raise GMSProtocolError(f"undecodable response: {exc}") from exc
        if isinstance(response, m.ErrorResponse):
            _close_all(fds)
            raise server_error(response)
        if not isinstance(response, expect):
            _close_all(fds)
            raise GMSProtocolError(f"expected {expect.__name__}, got {type(response).__name__}")
        return response, fds

    def _receive(self, sock: socket.socket, sent_at: float | None, kind: type) -> tuple[int, list, int]:
        """One recvmsg; the first of a response may poll before it blocks."""
        if sent_at is not None and _response_times.get(kind, 0.0) < self._spin_s / 2:
            deadline = sent_at + self._spin_s
            while time.perf_counter() < deadline:
                try:
                    n, ancillary, flags, _ = sock.recvmsg_into(
                        [self._buffer], _ANCILLARY_BYTES, socket.MSG_DONTWAIT
                    )
                except BlockingIOError:
                    continue
                _observe(kind, sent_at)
                return n, ancillary, flags
        n, ancillary, flags, _ = sock.recvmsg_into([self._buffer], _ANCILLARY_BYTES)
        if sent_at is not None:
            _observe(kind, sent_at)
        return n, ancillary, flags

    def _read_frame(self, sock: socket.socket, sent_at: float, kind: type) -> tuple[bytes, list[int]]:
        fds: list[int] = []
        try:
            while True:
                body = self._decoder.next_frame()
                if body is not None:
                    return body, fds
                n, ancillary, flags = self._receive(sock, sent_at, kind)
                sent_at = None  # only the first read of a response polls
                for level, kind, payload in ancillary:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        usable = len(payload) - len(payload) % array.array("i").itemsize
                        fds.extend(array.array("i", payload[:usable]))
                if flags & socket.MSG_CTRUNC:
                    raise GMSProtocolError("file descriptors were truncated in transit")
                if not n:
                    raise GMSConnectionError(f"the server at {self.socket_path} closed the connection")
                self._decoder.feed(memoryview(self._buffer)[:n])
        except BaseException:
            _close_all(fds)
            raise
