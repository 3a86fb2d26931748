"""The wire protocol: messages, framing, codec (sans-IO)."""

from . import messages
from .codec import (
    DEFAULT_MAX_FRAME_BYTES,
    FrameDecoder,
    FrameTooLarge,
    MalformedMessage,
    ProtocolError,
    UnknownMessageType,
    decode,
    encode,
)

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "FrameDecoder",
    "FrameTooLarge",
    "MalformedMessage",
    "ProtocolError",
    "UnknownMessageType",
    "decode",
    "encode",
    "messages",
]
