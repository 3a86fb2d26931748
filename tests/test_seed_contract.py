"""The seed's single-layout clients read the runtime state at its top level.

Wire contract: raw msgpack, no gms message classes on the reading side, as a
seed-era client or probe written in any language would read it.  Since
layouts arrived the figures live per layout; the seed's names stay at the
top level, describing the default layout ``weights``.
"""

from __future__ import annotations

import socket

import msgpack

from gms.client import GMSClientMemoryManager
from gms.wire.codec import HEADER

from .helpers import MiB

SEED_FIELDS = {
    "state": str, "has_rw_session": bool, "ro_session_count": int, "waiting_writers": int,
    "committed": bool, "allocation_count": int, "total_bytes": int, "memory_layout_hash": str,
    "backend": str, "device": int,
}


def raw_runtime_state(path: str) -> dict:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(path)
        body = msgpack.packb({"type": "GetRuntimeStateRequest"})
        sock.sendall(HEADER.pack(len(body)) + body)
        data = b""
        while len(data) < HEADER.size or len(data) < HEADER.size + HEADER.unpack_from(data)[0]:
            chunk = sock.recv(1 << 20)
            assert chunk, "closed before the answer"
            data += chunk
    return msgpack.unpackb(data[HEADER.size :], raw=False)


def test_a_seed_client_reads_the_default_layout_at_the_top_level(server):
    empty = raw_runtime_state(server.socket)
    assert empty["type"] == "GetRuntimeStateResponse"
    for name, kind in SEED_FIELDS.items():
        assert type(empty[name]) is kind, (name, empty[name])
    assert (empty["state"], empty["committed"], empty["allocation_count"]) == ("EMPTY", False, 0)

    writer = GMSClientMemoryManager(server.socket, layout="weights")
    writer.connect("RW")
    writer.allocate_handle(4 * MiB)
    building = raw_runtime_state(server.socket)
    assert (building["state"], building["has_rw_session"], building["allocation_count"]) == ("RW", True, 1)
    assert building["total_bytes"] == 4 * MiB and building["memory_layout_hash"] == ""
    writer.commit()
    committed_hash = writer.get_memory_layout_hash()

    other = GMSClientMemoryManager(server.socket, layout="kv_cache")  # another layout: not the seed's
    other.connect("RW")
    other.allocate_handle(2 * MiB)
    reader = GMSClientMemoryManager(server.socket, layout="weights")
    reader.connect("RO")
    read = raw_runtime_state(server.socket)
    assert (read["state"], read["committed"], read["ro_session_count"], read["has_rw_session"]) == (
        "RO", True, 1, False,
    )
    assert (read["allocation_count"], read["total_bytes"]) == (1, 4 * MiB)
    assert read["memory_layout_hash"] == committed_hash != ""
    for manager in (reader, other, writer):
        manager.close()
