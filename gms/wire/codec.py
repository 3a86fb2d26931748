"""Framing and (de)serialization: sans-IO, shared by the server and the client.

A frame is a 4-byte big-endian length N followed by N bytes of msgpack.
Decoding is strict: a field of the wrong type is a malformed message (the
server drops the connection), never coerced; an unknown ``"type"`` is a
decodable message the server answers with an error.  Extra keys are ignored,
so a newer peer's optional fields do not break an older one.
"""

from __future__ import annotations

import struct
import typing
from collections.abc import Callable
from typing import Any

import cattrs
import msgpack

from .messages import REGISTRY

HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME_BYTES = 16 << 20
DIRECT_BYTES = 64 << 10  # a frame body past this may be read into a buffer of its own


class ProtocolError(Exception):
    """A frame that cannot be read or decoded: the connection is not trusted."""


class FrameTooLarge(ProtocolError):
    pass


class MalformedMessage(ProtocolError):
    pass


class UnknownMessageType(Exception):
    """Decodable, but no message has this name: answered with an error."""

    def __init__(self, name: str) -> None:
        super().__init__(f"unknown message type {name!r}")
        self.name = name


def _exact(kind: type) -> Callable[[Any, Any], Any]:
    def structure(value: Any, _: Any) -> Any:
        if type(value) is not kind:
            raise MalformedMessage(f"expected {kind.__name__}, got {type(value).__name__}")
        return value

    return structure


def _make_converter() -> cattrs.Converter:
    converter = cattrs.Converter(detailed_validation=False)
    for kind in (int, str, bytes, bool, dict):
        converter.register_structure_hook(kind, _exact(kind))
    converter.register_structure_hook(
        float, lambda v, _: float(v) if type(v) in (int, float) else _exact(float)(v, _)
    )

    def is_list(t: Any) -> bool:
        return typing.get_origin(t) is list

    def list_hook(t: Any) -> Callable[[Any, Any], list]:
        (element,) = typing.get_args(t)
        # Columns of thousands of primitives: check their types, keep msgpack's list.
        primitive = element in (int, str, bytes)
        inner = None if primitive else converter.get_structure_hook(element)

        def structure(value: Any, _: Any) -> list:
            if type(value) is not list:
                raise MalformedMessage(f"expected a list, got {type(value).__name__}")
            if primitive:
                if not all(type(item) is element for item in value):
                    raise MalformedMessage(f"expected a list of {element.__name__}")
                return value
            return [inner(item, element) for item in value]

        return structure

    converter.register_structure_hook_factory(is_list, list_hook)
    return converter


converter = _make_converter()
_structure = {name: converter.get_structure_hook(cls) for name, cls in REGISTRY.items()}
_unstructure = {cls: converter.get_unstructure_hook(cls) for cls in REGISTRY.values()}
_packb = msgpack.Packer(use_bin_type=True).pack


def encode_body(message: Any) -> bytes:
    body = _unstructure[type(message)](message)
    body["type"] = type(message).__name__
    return _packb(body)


def encode(message: Any) -> bytes:
    """The whole frame: header and body."""
    body = encode_body(message)
    return HEADER.pack(len(body)) + body


def decode(body: bytes | bytearray) -> Any:
    try:
        raw = msgpack.unpackb(body, raw=False)
    except Exception as exc:  # the trust boundary: any failure means "cannot decode"
        raise MalformedMessage(f"not msgpack: {exc}") from exc
    if type(raw) is not dict:
        raise MalformedMessage(f"message is a {type(raw).__name__}, not a map")
    name = raw.pop("type", None)
    if type(name) is not str:
        raise MalformedMessage("message has no string 'type'")
    structure = _structure.get(name)
    if structure is None:
        raise UnknownMessageType(name)
    try:
        return structure(raw, REGISTRY[name])
    except MalformedMessage:
        raise
    except Exception as exc:
        raise MalformedMessage(f"bad {name}: {exc!r}") from exc


class FrameDecoder:
    """Feed bytes in, take whole frame bodies out.

    A big frame (past ``DIRECT_BYTES``) can be read straight into a buffer of
    its own: :meth:`body_space` gives the part still to fill, :meth:`wrote`
    says how much a read put there, and :meth:`next_frame` hands the buffer
    out as it is.  Fed through :meth:`feed` instead, a 1 MiB body had been
    copied four times (into the buffer as it grew, out of it twice) in the
    one step of the event loop that decoded it."""

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()  # headers and small frames (and bytes after a big body)
        self._body: bytearray | None = None  # a big frame's body, being filled
        self._filled = 0

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        body = self._body
        if body is None:
            self._buffer += data
            return
        take = min(len(data), len(body) - self._filled)
        body[self._filled : self._filled + take] = data[:take]
        self._filled += take
        if take < len(data):
            self._buffer += data[take:]

    def _length(self) -> int | None:
        """The body length the buffer's next frame declares (None: its header is not whole)."""
        return HEADER.unpack_from(self._buffer)[0] if len(self._buffer) >= HEADER.size else None

    def body_space(self) -> memoryview | None:
        """Where the rest of the big frame begun may be read to (None: no such frame).
        Its buffer is made here, at its whole size: a caller that bounds what a
        peer makes it hold asks only once it allows that much."""
        if self._body is None:
            buffer, length = self._buffer, self._length()
            if length is None or length <= DIRECT_BYTES or length > self.max_frame_bytes:
                return None
            self._body = bytearray(length)
            have = min(len(buffer) - HEADER.size, length)
            self._body[:have] = memoryview(buffer)[HEADER.size : HEADER.size + have]
            self._filled = have
            del buffer[: HEADER.size + have]
        if self._filled == len(self._body):
            return None
        return memoryview(self._body)[self._filled :]

    def wrote(self, n: int) -> None:
        """``n`` bytes were read into :meth:`body_space`."""
        self._filled += n

    @property
    def pending(self) -> int:
        """Bytes fed (or written) and not yet handed out."""
        body = 0 if self._body is None else HEADER.size + self._filled
        return body + len(self._buffer)

    @property
    def wanted(self) -> int:
        """Bytes the frame begun still lacks (0 until its header is whole)."""
        if self._body is not None:
            return len(self._body) - self._filled
        length = self._length()
        if length is None:
            return 0
        return max(0, HEADER.size + min(length, self.max_frame_bytes) - len(self._buffer))

    def next_frame(self) -> bytes | bytearray | None:
        body = self._body
        if body is not None:
            if self._filled < len(body):
                return None
            self._body = None
            return body
        buffer, length = self._buffer, self._length()
        if length is None:
            return None
        if length > self.max_frame_bytes:
            raise FrameTooLarge(f"frame of {length} bytes exceeds {self.max_frame_bytes}")
        end = HEADER.size + length
        if len(buffer) < end:
            return None
        body = bytes(buffer[HEADER.size : end])
        del buffer[:end]
        return body

    def unread(self) -> bytes:
        """Every byte fed and not handed out, as it came (a take-over hands them on)."""
        if self._body is None:
            return bytes(self._buffer)
        return HEADER.pack(len(self._body)) + bytes(self._body[: self._filled]) + bytes(self._buffer)
