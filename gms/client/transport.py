"""The blocking RPC transport (internal): one socket, one request at a time.

Each call sends a frame and reads exactly one response frame, collecting any
fds that ride with it.  A lock makes a request/response pair atomic, so the
transport may be shared by threads.

Every call has a deadline (``timeout``, seconds; None waits as long as it
takes) covering the send and the whole reply.  A call that cannot finish
closes the transport, so a broken or abandoned stream is never read again:

* no reply in time: ``ResponseTimeoutError``;
* EOF, reset or broken pipe: ``LockRevokedError`` (or ``SessionEndedError``)
  if the server left a ``SessionEnded`` notice first, else ``ServerGoneError``;
* an unreadable frame: ``GMSProtocolError``.

A request over the server's frame cap is refused before anything is sent
(``RequestTooLargeError``) and the transport stays open.
"""

from __future__ import annotations

import array
import collections
import math
import os
import select
import socket
import struct
import threading
import time
from typing import TypeVar

from ..errors import (
    GMSConnectionError,
    GMSError,
    GMSProtocolError,
    GMSServerError,
    LimitExceededError,
    LockRevokedError,
    QuotaExceededError,
    RequestTooLargeError,
    ResponseTimeoutError,
    ServerGoneError,
    SessionEndedError,
    StaleMemoryLayoutError,
    UntrustedServerError,
)
from ..system.peer import SERVER_UIDS_ENV, UntrustedPeer, require_peer, trusted_server_uids
from ..wire import (
    DEFAULT_MAX_FRAME_BYTES,
    FrameDecoder,
    ProtocolError,
    UnknownMessageType,
    decode,
    encode,
)
from ..wire import messages as m
from ..wire.codec import HEADER
from ..wire.messages import MAX_FDS_PER_MESSAGE

T = TypeVar("T")
_DEFAULT = object()  # "the transport's own timeout"
# Plain ints: ``int & IntFlag`` runs the enum's reflected operator, a few µs a call.
_SEND_FLAGS = int(socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
_MSG_CTRUNC = int(socket.MSG_CTRUNC)
_HUNG_UP = select.POLLHUP | select.POLLRDHUP | select.POLLERR

_RECV_BYTES = 256 * 1024
_buffers = threading.local()


def _thread_buffer() -> bytearray:
    """One receive buffer per thread, shared by its transports: recvmsg() would
    allocate one per call, and a new 256 KiB buffer per connection cost a
    handshake about 24 µs (bench/rpc_profile.py).  Sharing is safe: a call
    reads its frame out of the buffer (the decoder copies) before returning,
    and a thread makes one call at a time.  So a call asks for the buffer of
    the thread making it, never of the thread that made the transport: a
    transport made in one thread and used in another would otherwise share
    a buffer with the first thread's other calls (a response read in one was
    overwritten by the other's)."""
    buffer = getattr(_buffers, "buffer", None)
    if buffer is None:
        buffer = _buffers.buffer = bytearray(_RECV_BYTES)
    return buffer
_ANCILLARY_BYTES = socket.CMSG_SPACE(MAX_FDS_PER_MESSAGE * array.array("i").itemsize)
# The client trusts its server, but not without bound.
CLIENT_MAX_FRAME_BYTES = 1 << 30
# Waking a process blocked in recv costs tens of microseconds on many hosts,
# more than the server needs to answer.  So the client first polls for the
# answer, for up to GMS_CLIENT_SPIN_US (0 turns polling off), and falls back
# to blocking.  Polling only pays when answers are quick: the process keeps a
# median of recent response times per request type and polls only while it
# is under half the window, so on a loaded machine nobody spins: with 64
# clients on 2 cores (answers in ~200 µs) polling clients took CPU the server
# needed (docs/performance.md, section 3).  Only polled answers count: a
# blocked one's time includes the wake-up, so counting it kept a request
# that had once been slow out of polling for good (a metadata put on the
# 2-core host, bench/peers/run.py --backend host: 136 µs, 55 µs since); and
# a median, not a mean, so that a few slow answers (a keeper waking on the
# same cores) do not stop it.  Every
# PROBE_EVERY-th unpolled call polls anyway, so a kind that became quick
# again is seen to.  Handshakes always poll: their time includes lock waits,
# which say nothing about the server's speed.  The window is 200 µs where the
# client shares a few CPUs with the server, 1 ms where it has many (a GPU
# host's 16: a metadata put answered in ~120 µs there went unpolled at 200).
SPIN_US_FEW_CPUS, SPIN_US_MANY_CPUS, FEW_CPUS = 200.0, 1000.0, 4


def _default_spin_us() -> float:
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return SPIN_US_FEW_CPUS if cpus <= FEW_CPUS else SPIN_US_MANY_CPUS


DEFAULT_SPIN_US = _default_spin_us()
PROBE_EVERY = 32
_RECENT = 9
_recent: dict[type, collections.deque[float]] = {}
_median: dict[type, float] = {}
_unpolled: dict[type, int] = {}


def _connect(socket_path: str, timeout: float | None) -> socket.socket:
    """Connect, waiting out a full listen backlog (a storm of clients starting at
    once, or a flood from someone else).  A blocking AF_UNIX connect waits in the
    kernel, in line (first come, first served), for the server to accept,
    bounded by SO_SNDTIMEO; a non-blocking one would fail with EAGAIN and could
    only retry, losing its turn to every connect that waits."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = 0.001
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        left = None if deadline is None else max(0.001, deadline - time.monotonic())
        if left is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(left))
        try:
            sock.connect(socket_path)
        except BlockingIOError as exc:  # the wait in line timed out
            sock.close()
            if deadline is not None and time.monotonic() + pause > deadline:
                raise GMSConnectionError(f"gms server at {socket_path} is not accepting: {exc}") from exc
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
            continue
        except OSError as exc:
            sock.close()
            raise GMSConnectionError(f"no gms server at {socket_path}: {exc}") from exc
        if left is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(0))  # calls keep their own deadlines
        try:  # before a byte is sent: whoever answers here gets nothing from us, nor we from it
            require_peer(sock, trusted_server_uids(), f"the process serving {socket_path}")
        except UntrustedPeer as exc:
            sock.close()
            raise UntrustedServerError(
                f"{exc}: not a gms server this client trusts (set {SERVER_UIDS_ENV} to trust a daemon "
                "run as another user)"
            ) from None
        return sock


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


def _observe(kind: type, sent_at: float) -> None:
    if kind is not m.HandshakeRequest:
        recent = _recent.get(kind)
        if recent is None:
            recent = _recent[kind] = collections.deque(maxlen=_RECENT)
        recent.append(time.perf_counter() - sent_at)
        _median[kind] = sorted(recent)[len(recent) // 2]


def _polls(kind: type, window_s: float) -> bool:
    """Should this call of ``kind`` poll for its answer (see DEFAULT_SPIN_US)?"""
    if _median.get(kind, 0.0) < window_s / 2:
        return True
    skipped = _unpolled.get(kind, 0) + 1
    _unpolled[kind] = 0 if skipped >= PROBE_EVERY else skipped
    return skipped >= PROBE_EVERY


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def server_error(response: m.ErrorResponse) -> GMSError:
    if response.code == "QUOTA_EXCEEDED" and None not in (response.used, response.asked, response.quota):
        return QuotaExceededError(
            response.error, scope=response.scope, used=response.used, asked=response.asked, quota=response.quota
        )
    if response.limit and None not in (response.used, response.asked, response.quota):
        return LimitExceededError(
            response.code, response.error, limit=response.limit, scope=response.scope, used=response.used,
            asked=response.asked, bound=response.quota,
        )
    if response.code == "STALE_LAYOUT":
        return StaleMemoryLayoutError(response.error)
    return GMSServerError(response.code, response.error)


def session_ended_error(notice: m.SessionEnded, where: str) -> SessionEndedError:
    if notice.reason == "revoked":
        return LockRevokedError(notice.reason, f"an admin revoked this session's lock at {where}")
    return SessionEndedError(notice.reason, f"the server at {where} ended the session: {notice.reason}")


def _sooner(deadline: float | None, idle: float | None) -> float | None:
    """The earlier of ``deadline`` and ``idle`` seconds from now (None: none)."""
    if idle is None:
        return deadline
    now_idle = time.monotonic() + idle
    return now_idle if deadline is None else min(deadline, now_idle)


_LOCK_WAITING = b"LockWaiting"


def _is_lock_waiting(body) -> bool:
    """A ``LockWaiting`` notice (told apart without decoding every answer)."""
    if _LOCK_WAITING not in bytes(body[:64]):
        return False
    try:
        return isinstance(decode(body), m.LockWaiting)
    except (ProtocolError, UnknownMessageType):
        return False


class _Deadline(Exception):
    """Internal: the call's deadline passed."""


class RpcTransport:
    def __init__(
        self,
        socket_path: str,
        *,
        connect_timeout: float | None = 10.0,
        timeout: float | None = None,
        spin_us: float | None = None,
    ) -> None:
        self.socket_path = socket_path
        sock = _connect(socket_path, connect_timeout)
        self._sock: socket.socket | None = sock
        self._decoder = FrameDecoder(CLIENT_MAX_FRAME_BYTES)
        self._lock = threading.Lock()
        self.timeout = timeout  # the default deadline of a call, seconds
        # The server's frame cap; the handshake names it (0 there: the default).
        self.max_request_bytes = DEFAULT_MAX_FRAME_BYTES
        self._receive_timeout: float | None = None  # SO_RCVTIMEO as set (None: none)
        self._writable = select.poll()
        self._writable.register(sock.fileno(), select.POLLOUT)
        if spin_us is None:
            spin_us = float(os.environ.get("GMS_CLIENT_SPIN_US", DEFAULT_SPIN_US))
        self._spin_s = spin_us / 1e6

    @property
    def closed(self) -> bool:
        return self._sock is None

    def hung_up(self) -> bool:
        """Has the server closed (or reset) the connection?  The kernel knows
        (POLLHUP, POLLRDHUP) even while nothing is being read; asking reads nothing."""
        sock = self._sock
        fd = -1 if sock is None else sock.fileno()
        if fd < 0:  # closed (maybe by another thread just now)
            return True
        poller = select.poll()
        poller.register(fd, _HUNG_UP)
        return bool(poller.poll(0))

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def ended(self) -> GMSConnectionError:
        """Close a connection the server hung up on; the error that says why
        (a ``SessionEnded`` notice it left, or none: the server went away)."""
        with self._lock:
            return self._broken(None)

    def call(
        self, request: object, expect: type[T], timeout=_DEFAULT, *, idle: float | None = None,
        first_word: float | None = None,
    ) -> tuple[T, list[int]]:
        """Send ``request``; return the ``expect`` response and the fds that came with it.

        ``timeout`` (seconds, None: no deadline) defaults to the transport's.
        ``idle``: the answer may take longer, as long as the server says at
        least this often that it still waits (``LockWaiting``, to a handshake
        that asked for it): silence for ``idle`` seconds is a timeout.
        ``first_word``: the server's first word (an answer, or that it waits)
        must come within this long, however long ``idle`` is (a server that
        accepts and never answers is given up in seconds, not minutes).
        The caller owns (and must close) the returned fds.
        """
        frame = encode(request)
        size = len(frame) - HEADER.size
        if size > self.max_request_bytes:
            raise RequestTooLargeError(
                f"{type(request).__name__} of {size} bytes is over the server's frame cap of "
                f"{self.max_request_bytes} bytes: not sent",
                size=size, limit=self.max_request_bytes,
            )
        if timeout is _DEFAULT:
            timeout = self.timeout
        with self._lock:
            sock = self._sock
            if sock is None:
                raise GMSConnectionError("the connection is closed")
            overall = None if timeout is None else time.monotonic() + timeout
            silence = idle if first_word is None or idle is None else min(idle, first_word)
            deadline = _sooner(overall, silence)
            try:
                self._send(sock, frame, deadline)
                body, fds = self._read_frame(sock, time.perf_counter(), type(request), deadline)
                while idle is not None and body is not None and not fds and _is_lock_waiting(body):
                    silence = idle
                    deadline = _sooner(overall, idle)  # it still waits: silence is counted afresh
                    body, fds = self._read_frame(sock, None, type(request), deadline)
            except _Deadline:
                self._close()  # the reply may still come: this stream cannot be trusted again
                quiet = overall is None or (silence is not None and time.monotonic() < overall)
                raise ResponseTimeoutError(
                    f"no answer from the gms server at {self.socket_path} to {type(request).__name__}: "
                    + (f"it said nothing for {silence:g} s" if quiet else f"none within {timeout:g} s")
                ) from None
            except OSError as exc:
                raise self._broken(exc) from exc
            except ProtocolError as exc:
                self._close()
                raise GMSProtocolError(f"unreadable frame from {self.socket_path}: {exc}") from exc
            except GMSProtocolError:
                self._close()
                raise
            if body is None:
                raise self._broken(None)
        try:
            response = decode(body)
        except (ProtocolError, UnknownMessageType) as exc:
            _close_all(fds)
            raise GMSProtocolError(f"undecodable response: {exc}") from exc
        if isinstance(response, m.SessionEnded):  # in place of the response: the end is deliberate
            _close_all(fds)
            self.close()
            raise session_ended_error(response, self.socket_path)
        if isinstance(response, m.ErrorResponse):
            _close_all(fds)
            raise server_error(response)
        if not isinstance(response, expect):
            _close_all(fds)
            raise GMSProtocolError(f"expected {expect.__name__}, got {type(response).__name__}")
        return response, fds

    def _broken(self, exc: OSError | None) -> GMSConnectionError:
        """The connection broke (under the lock): read what the server left
        behind it, close, and say why."""
        notice = self._notice_left()
        self._close()
        if isinstance(notice, m.ErrorResponse):  # a connection refused at once (a limit)
            return server_error(notice)
        if notice is not None:
            return session_ended_error(notice, self.socket_path)
        why = f": {exc}" if exc is not None else ""
        return ServerGoneError(f"the gms server at {self.socket_path} closed the connection{why}")

    def _notice_left(self) -> m.SessionEnded | m.ErrorResponse | None:
        """A ``SessionEnded`` among the bytes still readable (the kernel keeps
        what the server sent before it closed), or the error a server that
        refused the connection left; None."""
        sock = self._sock
        if sock is None:
            return None
        try:
            while True:
                data = sock.recv(_RECV_BYTES, socket.MSG_DONTWAIT)
                if not data:
                    break
                self._decoder.feed(data)
        except OSError:
            pass
        try:
            while (body := self._decoder.next_frame()) is not None:
                message = decode(body)
                if isinstance(message, m.SessionEnded | m.ErrorResponse):
                    return message
        except (ProtocolError, UnknownMessageType):
            pass
        return None

    def _send(self, sock: socket.socket, frame: bytes, deadline: float | None) -> None:
        """The whole frame, never blocking past the deadline (a server that does
        not read fills the socket's buffer)."""
        try:
            sent = sock.send(frame, _SEND_FLAGS)  # most frames go whole at once
        except BlockingIOError:
            sent = 0
        view = memoryview(frame)[sent:]
        while view:
            try:
                view = view[sock.send(view, _SEND_FLAGS) :]
            except BlockingIOError:
                self._wait(self._writable, deadline)

    def _wait(self, poller: select.poll, deadline: float | None) -> None:
        if deadline is None:
            poller.poll()
            return
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(math.ceil(left * 1000)):
            raise _Deadline

    def _receive(
        self,
        sock: socket.socket,
        buffer: bytearray | memoryview,
        sent_at: float | None,
        kind: type,
        deadline: float | None,
    ) -> tuple[int, list, int]:
        """One recvmsg; the first of a response may spin before it blocks."""
        polled = sent_at is not None and self._spin_s > 0 and _polls(kind, self._spin_s)
        if polled:
            spin_until = sent_at + self._spin_s
            while time.perf_counter() < spin_until:
                try:
                    n, ancillary, flags, _ = sock.recvmsg_into(
                        [buffer], _ANCILLARY_BYTES, socket.MSG_DONTWAIT
                    )
                except BlockingIOError:
                    continue
                _observe(kind, sent_at)
                return n, ancillary, flags
        while True:
            self._bound_receive(sock, deadline)
            try:
                n, ancillary, flags, _ = sock.recvmsg_into([buffer], _ANCILLARY_BYTES)
            except BlockingIOError:  # SO_RCVTIMEO ran out: maybe early, never late
                continue
            if polled:  # its answer took longer than the window: slow, whatever the wake-up cost
                _observe(kind, sent_at)
            return n, ancillary, flags

    def _bound_receive(self, sock: socket.socket, deadline: float | None) -> None:
        """Make a blocking receive return by ``deadline`` (raise _Deadline if it passed).

        The kernel's receive timeout does it, not a poll(2) before each read:
        sleeping in poll and then reading cost a blocking call about 28 µs
        more (bench/rpc.py, no polling, 2 cores).  The option is set only
        when the one set would wait past the deadline (so calls of one timeout
        set it once); a receive that times out early loops here again."""
        if deadline is None:
            wanted = None
        else:
            wanted = deadline - time.monotonic()
            if wanted <= 0:
                raise _Deadline
        current = self._receive_timeout
        if current == wanted or (wanted is not None and current is not None and current <= wanted):
            return
        if wanted is not None:  # a little under: the next call's deadline is then past it, no setsockopt
            wanted = max(wanted * 0.99, 1e-6)  # 0 would mean no timeout at all
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(wanted or 0.0))
        self._receive_timeout = wanted

    def _read_frame(
        self, sock: socket.socket, sent_at: float, kind: type, deadline: float | None
    ) -> tuple[bytes | None, list[int]]:
        """The next frame's body and its fds; None at EOF (between frames or inside one)."""
        fds: list[int] = []
        buffer = _thread_buffer()  # recvmsg() would allocate (for big sizes, mmap) one per call
        try:
            while True:
                body = self._decoder.next_frame()
                if body is not None:
                    return body, fds
                space = self._decoder.body_space()  # a big answer: read straight into its own buffer
                into = buffer if space is None else space
                n, ancillary, flags = self._receive(sock, into, sent_at, kind, deadline)
                sent_at = None  # only the first read of a response polls
                for level, kind_, payload in ancillary:
                    if level == socket.SOL_SOCKET and kind_ == socket.SCM_RIGHTS:
                        usable = len(payload) - len(payload) % array.array("i").itemsize
                        fds.extend(array.array("i", payload[:usable]))
                if flags & _MSG_CTRUNC:
                    raise GMSProtocolError("file descriptors were truncated in transit")
                if not n:
                    _close_all(fds)
                    return None, []
                if space is None:
                    self._decoder.feed(memoryview(buffer)[:n])
                else:
                    self._decoder.wrote(n)
        except BaseException:
            _close_all(fds)
            raise
