"""Tenants as real uids, for the isolation tests: a forked child of this process
drops to a uid (setgroups, setgid, setuid: root only), waits for the go, runs a
workload over real sockets and sends its figures back as JSON.

Forked rather than started: the interpreter and gms are loaded already, so
the child needs no read access to the checkout or the virtual environment
(which another uid may not have).  Workloads use raw protocol connections
(``tests.helpers.RawConn``): no threads, nothing that minds a fork.
"""

from __future__ import annotations

import json
import os
import resource
import select
import socket
import time

from gms.wire import FrameDecoder, decode, encode
from gms.wire import messages as m

from ..helpers import RawConn

MiB = 1 << 20


class AsUid:
    """``target(*args)`` in a child running as ``uid``, started by :meth:`go`."""

    def __init__(self, uid: int, target, *args) -> None:
        self._out, out = os.pipe()
        go, self._go = os.pipe()
        self.cpu_s: float | None = None  # the child's CPU seconds, once its result is in
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns into pytest
            code = 0
            try:
                os.close(self._out)
                os.close(self._go)
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                os.read(go, 1)
                result = target(*args)
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                result, code = {"crashed": f"{type(exc).__name__}: {exc}"}, 1
            used = resource.getrusage(resource.RUSAGE_SELF)  # what it took of the box
            data = json.dumps({"result": result, "cpu_s": round(used.ru_utime + used.ru_stime, 2)}).encode()
            while data:
                data = data[os.write(out, data):]
            os._exit(code)
        os.close(out)
        os.close(go)

    def go(self) -> None:
        os.write(self._go, b"x")
        os.close(self._go)

    def result(self, timeout: float = 60.0) -> dict:
        chunks, deadline = [], time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._out], [], [], left)[0]:
                os.kill(self.pid, 9)
                os.waitpid(self.pid, 0)
                raise AssertionError(f"no result from pid {self.pid} within {timeout} s")
            chunk = os.read(self._out, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        os.close(self._out)
        os.waitpid(self.pid, 0)
        sent = json.loads(b"".join(chunks))
        self.cpu_s = sent["cpu_s"]
        result = sent["result"]
        assert "crashed" not in result, result["crashed"]
        return result


def answer(conn: RawConn, request, timeout: float = 10.0):
    """The response (fds closed), or an ErrorResponse-like dict for a broken connection."""
    try:
        return conn.call(request, timeout)
    except (OSError, TimeoutError) as exc:
        return m.ErrorResponse(f"{type(exc).__name__}: {exc}", "CONNECTION")


def refusal(response) -> dict:
    return {k: getattr(response, k) for k in ("code", "limit", "scope", "used", "asked", "quota", "error")}


# -- workloads -------------------------------------------------------------------------


def reader_loop(path: str, layout: str, seconds: float) -> dict:
    """The victim: connect, handshake RO, list, export every allocation, read a
    key, close; again and again.  Each cycle's time, and every error."""
    latencies, errors = [], []
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        started = time.perf_counter()
        try:
            conn = RawConn(path)
        except OSError as exc:
            errors.append(f"connect: {exc}")
            continue
        try:
            granted = answer(conn, m.HandshakeRequest("RO", 5000, layout))
            if not getattr(granted, "success", False):
                errors.append(repr(granted)[:300])
                continue
            listing = answer(conn, m.ListAllocationsRequest())
            ids = [a.allocation_id for a in listing.allocations]
            conn.send(m.ExportAllocationsRequest(ids))
            exported, fds = conn.recv(10)
            for fd in fds:
                os.close(fd)
            if len(fds) != len(ids):
                errors.append(repr(exported)[:300])
                continue
            got = answer(conn, m.MetadataGetRequest("t0"))
            if not getattr(got, "found", False):
                errors.append(repr(got)[:300])
                continue
            latencies.append(time.perf_counter() - started)
        except (OSError, TimeoutError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            conn.close()
    return {"latencies": latencies, "errors": errors[:20], "error_count": len(errors)}


def metadata_flood(path: str, seconds: float, value_bytes: int) -> dict:
    """Metadata values of ``value_bytes`` under new keys until refused, then the
    same keys replaced (the log churns), on one layout then on a second."""
    puts, refusals, first = 0, 0, None
    stop = time.monotonic() + seconds
    layouts = ["x-meta-1", "x-meta-2"]
    conns = []
    for layout in layouts:
        conn = RawConn(path)
        assert answer(conn, m.HandshakeRequest("RW", 5000, layout)).success
        allocation = answer(conn, m.AllocateRequest(1, "w"))
        conns.append((conn, allocation.allocation_id))
    key = 0
    while time.monotonic() < stop:
        conn, allocation_id = conns[key % 2]
        value = bytes([key % 251]) * value_bytes
        response = answer(conn, m.MetadataPutRequest(f"k{key % 64}", allocation_id, 0, value))
        if isinstance(response, m.ErrorResponse):
            refusals += 1
            first = first or refusal(response)
            if response.code == "CONNECTION":
                break
            answer(conn, m.MetadataDeleteRequest(f"k{(key + 7) % 64}"))  # make room, and churn
        else:
            puts += 1
        key += 1
    for conn, _ in conns:
        conn.close()
    return {"puts": puts, "refusals": refusals, "first_refusal": first}


def metadata_fill(path: str, layout: str, batch: int = 200) -> dict:
    """As many tiny entries (a short key, a 1-byte value) as the tenant's metadata
    quota takes, pipelined ``batch`` at a time, then the layout committed: the
    most entries a tenant can make the daemon hold (issue 48's 2 million)."""
    conn = RawConn(path)
    assert answer(conn, m.HandshakeRequest("RW", 5000, layout)).success
    allocation_id = answer(conn, m.AllocateRequest(1, "w")).allocation_id
    stored, first, n = 0, None, 0
    while first is None:
        conn.send_raw(b"".join(encode(m.MetadataPutRequest(f"k{i}", allocation_id, 0, b"v"))
                               for i in range(n, n + batch)))
        for _ in range(batch):
            response, _ = conn.recv(60)
            if isinstance(response, m.ErrorResponse):
                first = first or refusal(response)
            else:
                stored += 1
        n += batch
    assert answer(conn, m.CommitRequest()).success
    conn.close()
    return {"entries": stored, "first_refusal": first}


def metadata_churn(path: str, seconds: float, value_bytes: int, keys: int) -> dict:
    """Values of ``value_bytes`` put under ``keys`` keys in turn, for ever replaced:
    within the tenant's metadata quota, never refused, every value new to the log
    (and to the keeper, which keeps the state and the events since its base)."""
    conn = RawConn(path)
    assert answer(conn, m.HandshakeRequest("RW", 5000, "x-churn")).success
    allocation = answer(conn, m.AllocateRequest(1, "w")).allocation_id
    puts, refusals, first, n = 0, 0, None, 0
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        response = answer(conn, m.MetadataPutRequest(f"k{n % keys}", allocation, 0, bytes([n % 251]) * value_bytes))
        if isinstance(response, m.ErrorResponse):
            refusals += 1
            first = first or refusal(response)
        else:
            puts += 1
        n += 1
    conn.close()
    return {"puts": puts, "refusals": refusals, "first_refusal": first}


def unread_scans(path: str, seconds: float, layout: str, scans: int) -> dict:
    """Ask for the layout's whole metadata ``scans`` times in one go, and read
    none of the answers: each waits, half sent, for a client that never reads."""
    conn = RawConn(path)
    assert answer(conn, m.HandshakeRequest("RO", 5000, layout)).success
    for _ in range(scans):
        conn.send(m.MetadataScanRequest(""))
    time.sleep(seconds)
    conn.close()
    return {"scans": scans}


def trickled_scans(path: str, seconds: float, layout: str, scans: int, chunk: int = 40 << 10,
                   every: float = 0.1) -> dict:
    """Ask for the layout's whole metadata ``scans`` times in one go, then read
    the answers as a trickle: ``chunk`` bytes every ``every`` seconds (issue 48's
    client: it always reads something, so "no byte moved" never saw it)."""
    conn = RawConn(path)
    assert answer(conn, m.HandshakeRequest("RO", 5000, layout)).success
    for _ in range(scans):
        conn.send(m.MetadataScanRequest(""))
    got, stop = 0, time.monotonic() + seconds
    conn.sock.settimeout(every)
    while time.monotonic() < stop:
        try:
            data = conn.sock.recv(chunk)
        except TimeoutError:
            continue
        except OSError:
            break
        if not data:
            break
        got += len(data)
        time.sleep(every)
    conn.close()
    return {"scans": scans, "read": got}


def cpu_hog(path: str, seconds: float) -> dict:
    """No request at all: one core's worth of computing, the floor any busy
    neighbour on the same box sets for the victim."""
    spins, stop = 0, time.monotonic() + seconds
    while time.monotonic() < stop:
        spins += 1
    return {"spins": spins}


def connection_flood(path: str, seconds: float) -> dict:
    """Connections opened as fast as they come, held idle; refusals read."""
    held: dict[int, socket.socket] = {}
    ready = select.epoll()
    counts = {"connected": 0, "refused": 0, "connect_failed": 0, "closed_idle": 0}
    first = None
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(1.0)
        try:
            sock.connect(path)
        except OSError:
            counts["connect_failed"] += 1
            sock.close()
            time.sleep(0.001)
            continue
        counts["connected"] += 1
        held[sock.fileno()] = sock
        ready.register(sock.fileno(), select.EPOLLIN | select.EPOLLRDHUP)
        # What the server said to the ones it gave up on (refused at once, or
        # closed after the handshake deadline), without waiting for any.
        for fd, _ in ready.poll(0):
            gone = held.pop(fd)
            ready.unregister(fd)
            response = left_behind(gone)
            if isinstance(response, m.ErrorResponse):
                counts["refused"] += 1
                first = first or refusal(response)
            else:
                counts["closed_idle"] += 1
            gone.close()
    for sock in held.values():
        sock.close()
    ready.close()
    return {**counts, "first_refusal": first, "held_at_end": len(held)}


def left_behind(sock: socket.socket):
    """The frame a closed connection left to read, if any (never waits: many
    sockets may be open, past what select() can watch)."""
    decoder = FrameDecoder(1 << 20)
    try:
        while data := sock.recv(1 << 16, socket.MSG_DONTWAIT):
            decoder.feed(data)
    except OSError:
        pass
    body = decoder.next_frame()
    return None if body is None else decode(body)


def partial_frames(path: str, seconds: float, connections: int, frame_bytes: int) -> dict:
    """Sessions that each send most of a big frame and never the rest."""
    frame = encode(m.MetadataListRequest("p" * (frame_bytes - 64)))[: frame_bytes - 4096]
    conns = []
    for _ in range(connections):
        conn = RawConn(path)
        if not getattr(answer(conn, m.HandshakeRequest("RO", 5000, "shared")), "success", False):
            conn.close()
            break
        conn.sock.setblocking(False)
        conns.append([conn, 0])
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        moved = False
        for entry in conns:
            conn, sent = entry
            if sent == len(frame):
                continue
            try:
                entry[1] += conn.sock.send(frame[sent : sent + (1 << 20)])
                moved = True
            except BlockingIOError:
                pass
        if not moved:
            time.sleep(0.01)
    sent = [s for _, s in conns]
    for conn, _ in conns:
        conn.close()
    return {"sessions": len(conns), "sent_mib": round(sum(sent) / MiB, 1), "whole_frames_sent": 0}


def allocation_flood(path: str, layout: str, seconds: float) -> dict:
    """1-byte allocations (2 MiB each, one fd each on the server) until refused;
    then the writer holds them for the rest of ``seconds``."""
    stop = time.monotonic() + seconds
    conn = RawConn(path)
    assert answer(conn, m.HandshakeRequest("RW", 5000, layout)).success
    made, result = 0, {"refusal": None, "refusal_s": None}
    while time.monotonic() < stop:
        started = time.perf_counter()
        response = answer(conn, m.AllocateRequest(1, "tiny"))
        if isinstance(response, m.ErrorResponse):
            result = {"refusal": refusal(response), "refusal_s": time.perf_counter() - started}
            break
        made += 1
    time.sleep(max(0.0, stop - time.monotonic()))
    again = answer(conn, m.AllocateRequest(1, "tiny"))  # still refused, still at once
    conn.close()
    return {"made": made, **result, "again": refusal(again) if isinstance(again, m.ErrorResponse) else None}


def layout_flood(path: str, seconds: float) -> dict:
    """Empty layouts committed one after another (0 bytes of quota each), new
    names for as long as it lasts."""
    committed, refused, first = 0, 0, None
    stop = time.monotonic() + seconds
    n = 0
    while n == 0 or time.monotonic() < stop:
        conn = RawConn(path)
        response = answer(conn, m.HandshakeRequest("RW", 5000, f"x-{n}"))
        if isinstance(response, m.ErrorResponse):
            refused += 1
            first = first or refusal(response)
        elif answer(conn, m.CommitRequest("unpinned")).success:
            committed += 1
        conn.close()
        n += 1
    return {"committed": committed, "refused": refused, "first_refusal": first}
