"""Lock fairness under contention, with real processes.

* 50 processes ask RW_OR_RO at once on an empty layout: exactly one becomes
  the writer, every other one a reader of its commit (each checks the bytes).
* The same, with the writer SIGKILLed before it commits: exactly one waiter
  becomes the writer, the rest read its commit.
* A writer that arrives during a stream of overlapping readers is granted
  once the readers it found leave: no reader is admitted after it queued.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time

import pytest

from gms.wire import messages as m

from ..helpers import RawConn, ServerProcess, wait_until
from .common import read_line, record, refold, scale, spawn, summary_ms

FLEET = 50
ROUNDS = scale(1, 5)
WRITERS = scale(3, 30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("fair"))
    yield server
    server.kill()


def run_fleet(server, layout: str, mode: str, on_line=None) -> tuple[list[dict], float]:
    fleet = spawn("fleet.py", server.socket, layout, FLEET, mode, f"{layout}/seed")
    try:
        assert json.loads(read_line(fleet)) == {"forked": FLEET}
        started = time.perf_counter()
        fleet.stdin.write("go\n")
        fleet.stdin.flush()
        lines = []
        while True:
            line = json.loads(read_line(fleet, timeout=120))
            lines.append(line)
            if on_line is not None:
                on_line(line, lines)
            if line.get("done"):
                break
        elapsed = time.perf_counter() - started
        fleet.wait(30)
    finally:
        if fleet.poll() is None:
            fleet.kill()
    errors = [line for line in lines if "error" in line]
    assert not errors, errors
    assert lines[-1] == {"done": True, "failed": 0}, lines[-1]
    return lines, elapsed


# A read lock granted: from the queue (RO_CONNECT) or with its session at once (READER_JOINED).
READ_GRANTS = ("RO_CONNECT", "READER_JOINED")


def read_grants(kinds) -> int:
    return sum(kinds.count(kind) for kind in READ_GRANTS)


def granted(lines, lock):
    return [line["pid"] for line in lines if line.get("granted") == lock]


def test_fifty_rw_or_ro_at_once_one_writer_the_rest_read_its_commit(server):
    waits, elapsed_all = [], []
    for n in range(ROUNDS):
        layout = f"fifty-{n}"
        since = server.state().last_event_seq
        lines, elapsed = run_fleet(server, layout, "commit")
        writers, readers = granted(lines, "RW"), granted(lines, "RO")
        assert len(writers) == 1 and len(readers) == FLEET - 1, (writers, len(readers))
        assert [line["pid"] for line in lines if line.get("committed")] == writers
        assert [line["checked"] for line in lines if "checked" in line] == [2] * (FLEET - 1)
        kinds = [e.kind for e in server.events(since) if e.layout == layout]
        assert (kinds.count("RW_CONNECT"), kinds.count("RW_COMMIT"), read_grants(kinds)) == (1, 1, FLEET - 1)
        waits += [line["waited_ms"] / 1000 for line in lines if line.get("granted") == "RO"]
        elapsed_all.append(elapsed)
    wait_until(lambda: server.state().sessions == 0, what="the fleet gone")
    refold(server)
    record("fairness", f"{FLEET} RW_OR_RO at once", rounds=ROUNDS, writers_per_round=1,
           readers_per_round=FLEET - 1, errors=0, round_s_max=round(max(elapsed_all), 2),
           **{f"reader_wait_{k}": v for k, v in summary_ms(waits).items() if k != "count"})


def test_the_writer_killed_exactly_one_waiter_takes_over(server):
    takeovers = []
    for n in range(ROUNDS):
        layout = f"takeover-{n}"
        since = server.state().last_event_seq
        killed = {}

        def on_line(line, lines, killed=killed):
            if line.get("holding"):
                # Everyone else waits behind the writer.
                wait_until(lambda: server.state().waiting == FLEET - 1, what="49 waiting")
                assert granted(lines, "RW") == [line["pid"]] and not granted(lines, "RO")
                killed["at"] = time.perf_counter()
                killed["pid"] = line["pid"]
                os.kill(line["pid"], signal.SIGKILL)
            elif line.get("granted") == "RW" and "pid" in killed:
                killed["next"] = time.perf_counter() - killed["at"]

        lines, _ = run_fleet(server, layout, "hold-first", on_line)
        writers, readers = granted(lines, "RW"), granted(lines, "RO")
        assert len(writers) == 2 and writers[0] == killed["pid"], writers
        assert len(readers) == FLEET - 2
        assert [line["pid"] for line in lines if line.get("committed")] == writers[1:]
        assert [line["checked"] for line in lines if "checked" in line] == [2] * (FLEET - 2)
        kinds = [e.kind for e in server.events(since) if e.layout == layout]
        assert (kinds.count("RW_CONNECT"), kinds.count("RW_ABORT"), kinds.count("RW_COMMIT"),
                read_grants(kinds)) == (2, 1, 1, FLEET - 2), kinds
        takeovers.append(killed["next"])
    wait_until(lambda: server.state().sessions == 0, what="the fleet gone")
    refold(server)
    record("fairness", "writer killed, one waiter takes over", rounds=ROUNDS, errors=0,
           **{f"kill_to_new_writer_{k}": v for k, v in summary_ms(takeovers).items() if k != "count"})


def test_a_waiting_writer_is_not_starved_by_a_stream_of_readers(server):
    layout = "stream"
    build_and_commit(server, layout)
    stop = threading.Event()
    errors: list[str] = []
    served = [0]

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            conn = RawConn(server.socket)
            try:
                response = conn.call(m.HandshakeRequest("RO", None, layout), timeout=60)
                if not (isinstance(response, m.HandshakeResponse) and response.success):
                    errors.append(repr(response))
                    return
                served[0] += 1
                time.sleep(rng.uniform(0.01, 0.04))  # hold it a moment: readers overlap
            except Exception as exc:  # noqa: BLE001 - counted, the test fails on any
                errors.append(repr(exc))
                return
            finally:
                conn.close()

    threads = [threading.Thread(target=reader, args=(n,), daemon=True) for n in range(8)]
    for thread in threads:
        thread.start()
    waits = []
    try:
        for _ in range(WRITERS):
            time.sleep(0.3)  # the stream runs
            wait_until(lambda: server.layout(layout).readers > 0, what="a reader holding the layout")
            since = server.state().last_event_seq
            writer = RawConn(server.socket)
            asked = time.perf_counter()
            response = writer.call(m.HandshakeRequest("RW", 30_000, layout), timeout=60)
            waits.append(time.perf_counter() - asked)
            assert response.success, "the writer was starved"
            mine = [e for e in server.events(since) if e.layout == layout]
            opened = next(i for i, e in enumerate(mine) if e.kind == "SESSION_OPENED" and e.fields["lock_type"] == "RW")
            connected = next(i for i, e in enumerate(mine) if e.kind == "RW_CONNECT")
            admitted = [e for e in mine[opened:connected] if e.kind in READ_GRANTS]
            assert not admitted, f"{len(admitted)} readers admitted while the writer waited"
            build_and_commit(server, layout, writer)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert not errors, errors[:5]
    wait_until(lambda: server.state().sessions == 0, what="readers gone")
    refold(server)
    record("fairness", "writer during a stream of readers", writers=WRITERS, readers_served=served[0],
           readers_admitted_while_writer_waited=0, errors=0,
           **{f"writer_wait_{k}": v for k, v in summary_ms(waits).items() if k != "count"})


def build_and_commit(server, layout: str, conn: RawConn | None = None) -> None:
    """Build and commit a one-allocation layout on ``conn`` (a new connection
    taking RW when none is given), then close it."""
    if conn is None:
        conn = RawConn(server.socket)
        assert conn.call(m.HandshakeRequest("RW", 30_000, layout)).success
    try:
        allocation = conn.call(m.AllocateRequest(2 << 20, "w"))
        assert isinstance(allocation, m.AllocateResponse), allocation
        assert conn.call(m.MetadataPutRequest("k", allocation.allocation_id, 0, b"v")).success
        assert conn.call(m.CommitRequest()).success
    finally:
        conn.close()
