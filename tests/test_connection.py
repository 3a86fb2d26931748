"""The protocol's connection rules, without sockets (gms/wire/connection.py)."""

from __future__ import annotations

import msgpack
import pytest

from gms.wire import ProtocolError, UnknownMessageType, encode
from gms.wire import messages as m
from gms.wire.codec import HEADER
from gms.wire.connection import NEED_DATA, PEER_CLOSED, ConnectionState, Refused, ServerConnection

CAP = 1024


def fed(*messages, cap: int = CAP) -> ServerConnection:
    conn = ServerConnection(cap)
    for message in messages:
        conn.receive_data(encode(message))
    return conn


def test_a_request_arrives_in_pieces_and_is_handed_out_whole():
    frame = encode(m.MetadataGetRequest("key"))
    conn = ServerConnection(CAP)
    for i in range(len(frame) - 1):
        conn.receive_data(frame[i : i + 1])
        assert conn.next_request() is NEED_DATA
    conn.receive_data(frame[-1:])
    assert conn.next_request() == m.MetadataGetRequest("key")


def test_one_request_at_a_time():
    conn = fed(m.MetadataGetRequest("a"), m.MetadataGetRequest("b"))
    assert conn.next_request() == m.MetadataGetRequest("a")
    assert conn.next_request() is NEED_DATA, "the second waits until the first is answered"
    conn.send(m.MetadataGetResponse(False))
    assert conn.next_request() == m.MetadataGetRequest("b")
    with pytest.raises(RuntimeError):
        ServerConnection(CAP).send(m.MetadataGetResponse(False))  # nothing to answer


@pytest.mark.parametrize("probe", [m.GetRuntimeStateRequest(), m.GetEventHistoryRequest(), m.RevokeRequest("w")])
def test_a_probe_or_admin_verb_is_first_and_only(probe):
    conn = fed(probe)
    assert conn.next_request() == probe
    conn.send(m.ErrorResponse("x", "PERMISSION_DENIED"))
    assert conn.closing, "answered, then closed"

    later = fed(m.HandshakeRequest("RO"), probe)
    later.next_request()
    later.send(m.HandshakeResponse(True, True, "RO"))
    refused = later.next_request()
    assert isinstance(refused, Refused) and refused.code == "STATE_VIOLATION"
    later.send(refused.reply())
    assert not later.closing, "refused, and the session goes on"


def test_the_frame_bound_widens_once_a_handshake_succeeds_and_a_second_is_the_rules_to_refuse():
    conn = fed(m.HandshakeRequest("RW"), m.HandshakeRequest("RW"), m.HandshakeRequest("RW"))
    assert isinstance(conn.next_request(), m.HandshakeRequest)
    conn.send(m.ErrorResponse("no", "PERMISSION_DENIED"))
    assert not conn.handshaken
    assert isinstance(conn.next_request(), m.HandshakeRequest), "a refusal did not use it up"
    conn.send(m.HandshakeResponse(True, False, "RW"))
    assert conn.handshaken
    # passed on: a connection holds one session, which gms.fsm.rules says
    # (the refusal over a real server: tests/test_takeover.py)
    assert isinstance(conn.next_request(), m.HandshakeRequest)


def test_a_lock_wait_that_timed_out_and_a_commit_close_the_connection():
    timed_out = fed(m.HandshakeRequest("RW", 10))
    timed_out.next_request()
    timed_out.send(m.HandshakeResponse(False, True, None))
    assert timed_out.closing

    writer = fed(m.HandshakeRequest("RW"), m.CommitRequest())
    writer.next_request()
    writer.send(m.HandshakeResponse(True, False, "RW"))
    writer.next_request()
    writer.send(m.CommitResponse(True, "h"))
    assert writer.closing
    assert writer.next_request() is NEED_DATA, "nothing more is read once closing"


def test_the_server_may_close_after_any_answer():
    conn = fed(m.HandshakeRequest("RO"))
    conn.next_request()
    conn.send(m.ErrorResponse("out of memory", "OUT_OF_MEMORY"), close=True)
    assert conn.closing


def test_an_unknown_message_is_answered_not_dropped():
    body = msgpack.packb({"type": "NoSuchRequest"})
    conn = ServerConnection(CAP)
    conn.receive_data(HEADER.pack(len(body)) + body)
    assert isinstance(conn.next_request(), UnknownMessageType)
    assert conn.state is ConnectionState.SERVING


@pytest.mark.parametrize(
    "raw",
    [
        HEADER.pack(CAP + 1),  # a frame over the cap
        HEADER.pack(3) + b"\xc1\xc1\xc1",  # not msgpack
        HEADER.pack(2) + msgpack.packb([1]),  # not a map
        HEADER.pack(len(msgpack.packb({"type": "AllocateRequest", "size": "big"})))
        + msgpack.packb({"type": "AllocateRequest", "size": "big"}),  # a field of the wrong type
    ],
)
def test_bytes_that_cannot_be_trusted_are_an_error_state(raw):
    conn = ServerConnection(CAP)
    conn.receive_data(raw)
    with pytest.raises(ProtocolError):
        conn.next_request()
    assert conn.state is ConnectionState.ERROR


def test_closed_between_requests_or_inside_a_frame():
    conn = ServerConnection(CAP)
    conn.receive_data(b"")
    assert conn.next_request() is PEER_CLOSED
    partial = ServerConnection(CAP)
    partial.receive_data(encode(m.GetStateHashRequest())[:3])
    partial.receive_data(b"")
    with pytest.raises(ProtocolError, match="inside a frame"):
        partial.next_request()


def test_read_ahead_while_serving_is_one_frame_at_most():
    conn = fed(m.HandshakeRequest("RW"))
    assert isinstance(conn.next_request(), m.HandshakeRequest)
    one = encode(m.MetadataGetRequest("k" * 500))
    conn.receive_data(one)  # one frame pipelined behind a waiting handshake: fine
    assert not conn.overflowed
    conn.receive_data(one)
    assert conn.overflowed and conn.state is ConnectionState.ERROR
    with pytest.raises(ProtocolError, match="pipelined while waiting for the answer to HandshakeRequest"):
        conn.next_request()


def test_a_big_request_is_read_into_its_own_buffer_and_handed_out_as_it_is():
    """Past DIRECT_BYTES the rest of a frame goes straight into a buffer of its
    frame's size (no copies as it grows); bytes fed or written mix freely, and the
    frame after it is untouched."""
    value = bytes(range(256)) * 1024  # 256 KiB
    big, small = encode(m.MetadataPutRequest("k", "a", 0, value)), encode(m.MetadataGetRequest("k"))
    conn = ServerConnection(1 << 20)
    conn.receive_data(big[:1000])
    space = conn.body_space()
    assert space is not None and len(space) == len(big) - 1000 == conn.wanted
    space[:5000] = big[1000:6000]
    conn.wrote(5000)
    assert conn.buffered == 6000 and conn.next_request() is NEED_DATA
    conn.receive_data(big[6000:] + small[:3])  # fed, not written: the surplus is the next frame's
    assert conn.body_space() is None, "the body is whole"
    assert conn.next_request() == m.MetadataPutRequest("k", "a", 0, value)
    conn.send(m.MetadataPutResponse(True))
    assert conn.freeze()["buffered"] == small[:3]
    conn.receive_data(small[3:])
    assert conn.next_request() == m.MetadataGetRequest("k")


def test_a_small_or_oversized_frame_gets_no_buffer_of_its_own():
    conn = fed(m.MetadataGetRequest("k"))
    assert conn.body_space() is None
    huge = ServerConnection(CAP * 100)
    huge.receive_data(HEADER.pack(CAP * 1000))
    assert huge.body_space() is None, "nothing is made for a frame over the cap"
    with pytest.raises(ProtocolError):
        huge.next_request()


def test_a_big_frame_half_read_is_handed_over_as_it_came():
    frame = encode(m.MetadataPutRequest("k", "a", 0, b"x" * (200 << 10)))
    conn = ServerConnection(1 << 20)
    conn.receive_data(frame[:70_000])
    conn.body_space()[:10] = frame[70_000:70_010]
    conn.wrote(10)
    frozen = conn.freeze()
    assert frozen["buffered"] == frame[:70_010]
    thawed = ServerConnection.thaw(1 << 20, frozen)
    thawed.receive_data(frame[70_010:])
    assert thawed.next_request() == m.MetadataPutRequest("k", "a", 0, b"x" * (200 << 10))


def test_a_peer_that_closes_inside_a_big_frame_is_an_error():
    frame = encode(m.MetadataPutRequest("k", "a", 0, b"x" * (200 << 10)))
    conn = ServerConnection(1 << 20)
    conn.receive_data(frame[:100_000])
    assert conn.body_space() is not None
    conn.wrote(0)  # the read found the peer gone
    with pytest.raises(ProtocolError, match="closed inside a frame"):
        conn.next_request()
