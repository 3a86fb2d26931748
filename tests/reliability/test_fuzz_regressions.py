"""Every finding of the hostile-frame campaign, replayed against a fresh server.

A finding (``findings/*.json``, written by ``test_fuzz.py`` when a frame
kills or hangs the server, or leaves a session behind) holds the frames of
the connections that did it, byte for byte, and which of them carried fds.
Each is replayed the way the campaign sent it; then the server must be
alive, every session of a closed connection gone, no waiter left, and the
committed layouts (one held by a reader, as in the campaign) intact.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from gms.wire import messages as m

from ..helpers import RawConn, ServerProcess, wait_until
from .common import open_dir, record, stop
from .fuzz import Frame
from .test_crash import commit_pattern, read_back
from .test_fuzz import SERVER_ARGS, Conn, alive

FINDINGS = sorted((Path(__file__).parent / "findings").glob("*.json"))


@pytest.mark.parametrize("path", FINDINGS, ids=[p.stem for p in FINDINGS])
def test_a_finding_no_longer_hurts_the_server(path):
    import random

    finding = json.loads(path.read_text())
    server = ServerProcess(open_dir(), *SERVER_ARGS)
    try:
        commit_pattern(server, "sentinel", "sentinel")
        commit_pattern(server, "fz-ro", "fz-ro")
        committed = {name: server.layout(name).memory_layout_hash for name in ("sentinel", "fz-ro")}
        anchor = RawConn(server.socket)
        assert anchor.call(m.HandshakeRequest("RO", 5000, "fz-ro")).success
        rng = random.Random(0)
        for frames in finding["connections"]:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(server.socket)
            conn = Conn(sock)
            try:
                for f in frames:
                    conn.send(Frame(f["kind"], bytes.fromhex(f["hex"]), "maybe", None, tuple(f["fds"])), rng)
                    if finding["scenario"] == "connection":
                        conn.receive(1)
                    elif f["kind"] == "handshake":
                        time.sleep(0.05)  # queued before what follows arrives (as in the campaign)
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                pass
            conn.close()

        def settled() -> bool:
            state = server.state()
            return state.sessions == 1 and state.waiting == 0

        wait_until(settled, timeout=10, what="every closed connection's session gone")
        assert alive(server), server.log
        anchor.close()
        wait_until(lambda: server.state().sessions == 0, what="the anchor gone")
        for name, layout_hash in committed.items():
            assert server.layout(name).memory_layout_hash == layout_hash, name
            assert read_back(server, name) == 2
        record("fuzz", f"regression {path.stem}", connections=len(finding["connections"]), errors=0)
    finally:
        stop(server)
