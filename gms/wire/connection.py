"""The server's side of one connection, without I/O (the h11 pattern).

:class:`ServerConnection` holds every rule of the protocol that concerns a
connection rather than a layout, and is driven by bytes in and messages
out, so each rule is tested without sockets:

* framing: frames of at most ``max_frame_bytes``, and of at most
  ``PRE_SESSION_MAX_FRAME_BYTES`` until a handshake succeeds (what may come
  before one, a handshake, a probe or an admin verb, is small, and a stranger
  must not make the server buffer megabytes); a frame that cannot be read
  or decoded, or a connection closed inside one, is a protocol error (the
  connection is not trusted: ``ERROR``);
* one request at a time: the next request is handed out only once the
  previous one is answered;
* a probe or an admin verb (``ONE_SHOT``) is answered only as the first and
  only request of a connection, then it closes; sent later it is refused;
* a second handshake on a connection is the rules' to refuse
  (``gms.fsm.rules``: a connection holds one session); this object only
  widens the frame bound once a handshake succeeds;
* close after the answers that end a session: a commit, a lock wait that
  timed out, and any the server marks so;
* read-ahead: while a request is being served the server keeps reading (to
  see a hang-up), but more than one whole frame pipelined behind it is a
  protocol error.

The Trio shell (``gms.server.service.session``) is the small loop around it: feed
what the socket gives, serve what comes out, send what it encodes.
"""

from __future__ import annotations

import enum

from . import messages as m
from .codec import (
    HEADER,
    FrameDecoder,
    ProtocolError,
    UnknownMessageType,
    decode,
    encode,
    encode_body,
)


class ConnectionState(enum.Enum):
    IDLE = "IDLE"  # waiting for a request
    SERVING = "SERVING"  # a request was handed out and is not answered yet
    CLOSING = "CLOSING"  # the last answer was sent: read nothing more
    ERROR = "ERROR"  # the peer broke the protocol: drop the connection


class _Sentinel:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


NEED_DATA = _Sentinel("NEED_DATA")  # no whole request yet: feed more bytes
PEER_CLOSED = _Sentinel("PEER_CLOSED")  # the peer closed between requests


class Refused:
    """A request the protocol itself refuses (answered with an error; the session goes on)."""

    def __init__(self, message: str, code: str = "STATE_VIOLATION") -> None:
        self.message = message
        self.code = code

    def reply(self) -> m.ErrorResponse:
        return m.ErrorResponse(self.message, self.code)


_CLOSES_AFTER = (m.CommitResponse,)
PRE_SESSION_MAX_FRAME_BYTES = 64 << 10


class ServerConnection:
    def __init__(self, max_frame_bytes: int, pre_session_max_frame_bytes: int | None = None) -> None:
        self.state = ConnectionState.IDLE
        self.handshaken = False
        self.requests = 0  # handed out so far
        self._max_frame_bytes = max_frame_bytes
        first = max_frame_bytes if pre_session_max_frame_bytes is None else pre_session_max_frame_bytes
        self._decoder = FrameDecoder(min(max_frame_bytes, first))
        self._read_ahead_limit = max_frame_bytes + HEADER.size  # one whole frame
        self._eof = False
        self._serving: object = None
        self._one_shot = False

    # -- bytes in -----------------------------------------------------------------

    def receive_data(self, data: bytes | memoryview) -> None:
        """What the socket gave; empty means the peer closed its end."""
        if not data:
            self._eof = True
            return
        self._decoder.feed(data)
        if self.state is ConnectionState.SERVING and self._decoder.pending > self._read_ahead_limit:
            self.state = ConnectionState.ERROR

    def body_space(self) -> memoryview | None:
        """Where the rest of a big request begun may be read to, with no copy
        (``FrameDecoder.body_space``); None: read and :meth:`receive_data`."""
        return self._decoder.body_space()

    def wrote(self, n: int) -> None:
        """``n`` bytes were read into :meth:`body_space`; 0: the peer closed."""
        if not n:
            self._eof = True
            return
        self._decoder.wrote(n)

    @property
    def overflowed(self) -> bool:
        """More than a frame was pipelined while a request was served."""
        return self.state is ConnectionState.ERROR and self._decoder.pending > self._read_ahead_limit

    def overflow_error(self) -> ProtocolError:
        return ProtocolError(
            f"more than a frame pipelined while waiting for the answer to {type(self._serving).__name__}"
        )

    @property
    def eof(self) -> bool:
        return self._eof

    @property
    def buffered(self) -> int:
        """Bytes received and not yet handed out as a request (the server holds them)."""
        return self._decoder.pending

    @property
    def wanted(self) -> int:
        """Bytes the request begun still lacks: how much a read may ask for at once."""
        return self._decoder.wanted

    def next_request(self):
        """The next request (a message, an :class:`UnknownMessageType`, or a
        :class:`Refused`), ``NEED_DATA`` or ``PEER_CLOSED``.  Raises
        ProtocolError for bytes that cannot be trusted."""
        if self.state is not ConnectionState.IDLE:
            if self.state is ConnectionState.ERROR:
                raise self.overflow_error()
            return NEED_DATA  # serving (one at a time) or closing: nothing more is read
        try:
            body = self._decoder.next_frame()
            if body is None:
                if not self._eof:
                    return NEED_DATA
                if self._decoder.pending:
                    raise ProtocolError(f"connection closed inside a frame ({self._decoder.pending} bytes)")
                return PEER_CLOSED
            try:
                message = decode(body)
            except UnknownMessageType as unknown:
                message = unknown  # decodable: answered with an error
        except ProtocolError:
            self.state = ConnectionState.ERROR
            raise
        self.state = ConnectionState.SERVING
        self.requests += 1
        self._serving = self._admit(message)
        return self._serving

    def _admit(self, message: object) -> object:
        first = self.requests == 1
        shape = m.SHAPES.get(type(message))
        if shape is not None and (wrong := shape(message)) is not None:
            code, why = wrong
            return Refused(why, code)
        if isinstance(message, m.ONE_SHOT):
            if first:
                self._one_shot = True
                return message
            return Refused(f"{type(message).__name__} must be the first and only request of a connection")
        return message

    # -- messages out -----------------------------------------------------------------

    def send(self, response: object, *, close: bool = False) -> bytes:
        """Encode the answer to the request being served; ``close``: the last one."""
        if self.state is not ConnectionState.SERVING:
            raise RuntimeError(f"no request to answer (connection {self.state.value})")
        request = self._serving
        if isinstance(request, m.HandshakeRequest) and isinstance(response, m.HandshakeResponse):
            self.handshaken = True
            self._decoder.max_frame_bytes = self._max_frame_bytes
            close = close or not response.success  # the lock wait timed out
        if close or self._one_shot or isinstance(response, _CLOSES_AFTER):
            self.state = ConnectionState.CLOSING
        else:
            self.state = ConnectionState.IDLE
        self._serving = None
        return encode(response)

    def notice(self, message: object) -> bytes:
        """Encode an unsolicited last frame (``SessionEnded``): nothing is read or answered after it."""
        self.state = ConnectionState.CLOSING
        self._serving = None
        return encode(message)

    @property
    def closing(self) -> bool:
        return self.state is ConnectionState.CLOSING

    # -- hand-over --------------------------------------------------------------------

    def freeze(self) -> dict:
        """Everything this object knows, as plain values, for a server taking over:
        the request being served goes as its wire body, the bytes read ahead as they are."""
        serving = self._serving
        return {
            "state": self.state.value,
            "handshaken": self.handshaken,
            "requests": self.requests,
            "buffered": self._decoder.unread(),
            "eof": self._eof,
            "one_shot": self._one_shot,
            "serving": encode_body(serving) if serving is not None else b"",
        }

    @classmethod
    def thaw(
        cls, max_frame_bytes: int, frozen: dict, pre_session_max_frame_bytes: int | None = None
    ) -> ServerConnection:
        """The object :meth:`freeze` described, going on under ``max_frame_bytes``
        (and ``pre_session_max_frame_bytes`` until it handshakes, as a new one)."""
        connection = cls(max_frame_bytes, pre_session_max_frame_bytes)
        connection.state = ConnectionState(frozen["state"])
        connection.handshaken = frozen["handshaken"]
        if connection.handshaken:
            connection._decoder.max_frame_bytes = max_frame_bytes
        connection.requests = frozen["requests"]
        connection._decoder.feed(frozen["buffered"])
        connection._eof = frozen["eof"]
        connection._one_shot = frozen["one_shot"]
        if frozen["serving"]:
            connection._serving = decode(frozen["serving"])
        return connection

    @property
    def serving(self) -> object:
        """The request being served (None between requests)."""
        return self._serving
