"""The trust boundary: hostile frames drop only their own connection.

Undecodable frames drop the connection and unwind its lock; decodable but
invalid requests get an ErrorResponse and the session goes on; nothing a
client sends corrupts the committed layout or stops the server.
"""

from __future__ import annotations

import struct

import msgpack
import pytest

from gms.wire import messages as m

from .helpers import RawConn, build_layout, wait_until
from .test_server_locks import commit_layout


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


HOSTILE = {
    "garbage": frame(b"\xc1\xc1\xc1 not msgpack"),
    "not-a-map": frame(msgpack.packb([1, 2, 3])),
    "no-type": frame(msgpack.packb({"size": 5})),
    "type-not-a-string": frame(msgpack.packb({"type": 7})),
    "wrong-field-type": frame(msgpack.packb({"type": "AllocateRequest", "size": "big", "tag": "w"})),
    "bool-for-int": frame(msgpack.packb({"type": "AllocateRequest", "size": True, "tag": "w"})),
    "missing-field": frame(msgpack.packb({"type": "MetadataPutRequest", "key": "k"})),
    "list-of-wrong-things": frame(msgpack.packb({"type": "ExportAllocationsRequest", "allocation_ids": "x"})),
    "list-of-mixed-things": frame(msgpack.packb({"type": "ExportAllocationsRequest", "allocation_ids": ["a", 5]})),
    "oversized-length": struct.pack(">I", 0xFFFFFFF0) + b"\x80",
    "truncated-then-close": struct.pack(">I", 100) + b"\x81\xa4type",
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_undecodable_frame_drops_the_writer_and_unwinds(server, case):
    writer = RawConn(server.socket)
    writer.handshake("RW")
    build_layout(writer)
    writer.send_raw(HOSTILE[case])
    if case == "truncated-then-close":
        writer.sock.shutdown(1)
    assert writer.closed_by_peer(), "the server stops trusting the connection"
    wait_until(lambda: server.layout().state == "EMPTY", what="RW_ABORT after the drop")
    events = server.events()
    dropped = [e for e in events if e.kind == "CONNECTION_DROPPED"]
    assert len(dropped) == 1 and dropped[0].fields["reason"]
    assert [e.kind for e in events][-3:] == ["CONNECTION_DROPPED", "RW_ABORT", "SESSION_CLOSED"]
    assert server.layout().allocation_count == 0


@pytest.mark.parametrize("case", ["garbage", "oversized-length", "wrong-field-type"])
def test_a_hostile_reader_cannot_touch_the_committed_layout(server, case):
    layout_hash = commit_layout(server, sizes=(2 << 20, 4 << 20))
    good = RawConn(server.socket)
    good.handshake("RO")
    bad = RawConn(server.socket)
    bad.handshake("RO")
    bad.send_raw(HOSTILE[case])
    assert bad.closed_by_peer()
    wait_until(lambda: server.layout().readers == 1, what="bad reader unwound")
    state = server.state()
    assert (state.layout("weights").state, state.layout("weights").memory_layout_hash, state.layout("weights").allocation_count) == ("RO", layout_hash, 2)
    assert good.call(m.MetadataGetRequest("t1")).found


def test_frame_cap_is_configurable(start_server):
    server = start_server("--max-frame-bytes", "4KiB")
    conn = RawConn(server.socket)
    conn.handshake("RW")
    (allocation,) = build_layout(conn, sizes=(1 << 20,))
    conn.send(m.MetadataPutRequest("big", allocation.allocation_id, 0, b"x" * 8192))
    assert conn.closed_by_peer()
    dropped = [e for e in server.events() if e.kind == "CONNECTION_DROPPED"]
    assert "exceeds 4096" in dropped[-1].fields["reason"]


def test_invalid_requests_get_errors_and_the_session_goes_on(server):
    conn = RawConn(server.socket)

    def error(request) -> str:
        response = conn.call(request)
        assert isinstance(response, m.ErrorResponse), response
        assert response.error
        return response.code

    assert error(m.AllocateRequest(1 << 20, "w")) == "NOT_CONNECTED"  # before handshake
    assert error(m.MetadataGetRequest("k")) == "NOT_CONNECTED"
    conn.send_raw(frame(msgpack.packb({"type": "NoSuchRequest", "x": 1})))
    response, _ = conn.recv()
    assert (type(response), response.code) == (m.ErrorResponse, "UNKNOWN_MESSAGE")
    assert error(m.HandshakeResponse(True, True, "RW")) == "UNKNOWN_MESSAGE"  # not a request
    assert error(m.HandshakeRequest("READ_WRITE")) == "INVALID_ARGUMENT"
    assert conn.handshake("RW").success  # still a healthy session
    assert error(m.AllocateRequest(0, "w")) == "INVALID_ARGUMENT"
    assert error(m.AllocateRequest(-5, "w")) == "INVALID_ARGUMENT"
    assert error(m.AllocateRequest(1 << 20, "")) == "INVALID_ARGUMENT"
    assert error(m.AllocateRequest(1 << 62, "w")) == "LIMIT_EXCEEDED"
    assert error(m.FreeAllocationRequest("nope")) == "UNKNOWN_ALLOCATION"
    assert error(m.ExportAllocationRequest("nope")) == "UNKNOWN_ALLOCATION"
    (allocation,) = build_layout(conn, sizes=(1 << 20,))
    aid = allocation.allocation_id
    assert error(m.MetadataPutRequest("k", aid, 1 << 20, b"")) == "OFFSET_OUT_OF_BOUNDS"
    assert error(m.MetadataPutRequest("k", aid, -1, b"")) == "OFFSET_OUT_OF_BOUNDS"
    assert error(m.MetadataPutRequest("k", "nope", 0, b"")) == "UNKNOWN_ALLOCATION"
    assert error(m.MetadataPutRequest("k", aid, 0, b"x" * (2 << 20))) == "LIMIT_EXCEEDED"
    assert error(m.MetadataPutRequest("", aid, 0, b"")) == "INVALID_ARGUMENT"
    assert error(m.ExportAllocationsRequest([aid] * 254)) == "LIMIT_EXCEEDED"
    assert conn.call(m.MetadataDeleteRequest("absent")) == m.MetadataDeleteResponse(False)
    assert conn.call(m.MetadataGetRequest("absent")) == m.MetadataGetResponse(False)
    commit = conn.call(m.CommitRequest())
    assert commit.success
    reader = RawConn(server.socket)
    reader.handshake("RO")
    for request in (
        m.AllocateRequest(1 << 20, "w"),
        m.FreeAllocationRequest(aid),
        m.MetadataPutRequest("k", aid, 0, b""),
        m.MetadataDeleteRequest("t0"),
        m.CommitRequest(),
    ):
        response = reader.call(request)
        assert (type(response), response.code) == (m.ErrorResponse, "MODE_VIOLATION"), request
    state = server.state()
    assert (state.layout("weights").state, state.layout("weights").memory_layout_hash) == ("RO", commit.memory_layout_hash)


def test_metadata_put_many_is_all_or_nothing(server):
    conn = RawConn(server.socket)
    conn.handshake("RW")
    (allocation,) = build_layout(conn, sizes=(1 << 20,))
    aid = allocation.allocation_id
    good = m.MetadataEntryInfo("a", aid, 0, b"1")
    bad = m.MetadataEntryInfo("b", aid, 1 << 21, b"2")
    response = conn.call(m.MetadataPutManyRequest([good, bad]))
    assert response.code == "OFFSET_OUT_OF_BOUNDS"
    assert conn.call(m.MetadataListRequest("")).keys == ["t0"]
    entries = [m.MetadataEntryInfo(f"k{i}", aid, i, b"v%d" % i) for i in range(300)]
    assert conn.call(m.MetadataPutManyRequest(entries)) == m.MetadataPutManyResponse(True, 300)
    scan = conn.call(m.MetadataScanRequest("k1"))
    assert scan.keys == sorted(f"k{i}" for i in range(300) if f"k{i}".startswith("k1"))
    assert next(scan.rows()) == ("k1", aid, 1, b"v1")
    # Answers are cached per prefix while the metadata stays the same: any change shows.
    conn.call(m.MetadataPutRequest("k1", aid, 7, b"new"))
    conn.call(m.MetadataDeleteRequest("k10"))
    again = conn.call(m.MetadataScanRequest("k1"))
    assert next(again.rows()) == ("k1", aid, 7, b"new")
    assert again.keys == [k for k in scan.keys if k != "k10"]


def test_scan_columns_of_unequal_length_are_refused():
    with pytest.raises(ValueError, match="differ in length"):
        m.MetadataScanResponse(["a", "b"], ["x", "y"], [0], [b"", b""]).rows()


def test_server_survives_a_storm_of_hostile_clients(server):
    commit_layout(server)
    before = server.layout().memory_layout_hash
    for _ in range(20):
        for payload in HOSTILE.values():
            conn = RawConn(server.socket)
            conn.handshake("RO")
            conn.send_raw(payload)
            conn.close()
    wait_until(lambda: server.layout().readers == 0, what="all unwound")
    state = server.state()
    assert (state.layout("weights").state, state.layout("weights").memory_layout_hash) == ("COMMITTED", before)
    assert server.proc.poll() is None


def test_scans_of_huge_prefixes_do_not_pin_server_memory(server):
    """Regression (tests/reliability): the metadata-scan cache kept each prefix a
    reader sent; 64 prefixes of 4 MiB pinned 256 MiB in the server for good."""
    commit_layout(server)
    reader = RawConn(server.socket)
    reader.handshake("RO")

    def rss() -> int:
        with open(f"/proc/{server.pid}/status") as status:
            return next(int(line.split()[1]) << 10 for line in status if line.startswith("VmRSS:"))

    before = rss()
    for n in range(63):  # the cache holds 64 answers
        response = reader.call(m.MetadataScanRequest(f"{n}" + "p" * (4 << 20)))
        assert response.keys == []
    grown = rss() - before
    assert grown < 64 << 20, f"server RSS grew by {grown >> 20} MiB"
    assert reader.call(m.MetadataScanRequest("t")).keys == ["t0"]  # short prefixes still work
