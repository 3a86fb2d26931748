"""Where gms's per-request time goes: an RO handshake, a metadata get and put, an allocate.

1. Timeline.  A gms server (host backend) in its own process, its session's
   socket, codec calls, dispatch and core calls wrapped to stamp
   ``perf_counter_ns``; a client process whose transport is wrapped the same
   way.  perf_counter is CLOCK_MONOTONIC on Linux, one clock for every
   process, so the stamps of both sides line up: per step, the median offset
   from the user's call and the median time since the step before.
2. Hotspots.  The same server under cProfile while one client loops: the
   functions with the most own time, in µs per request (cProfile's own
   overhead inflates every call alike).
3. Floors.  Echo servers for the same framing (4-byte length, then the body):
   trio, and asyncio streams (Dynamo's style) and protocols, on uvloop and on
   asyncio's own loop; gms's real server driven by the same raw clients
   (and Dynamo's, with ``--dynamo``).  Clients: one connection, blocking
   recv; the same, polling for the answer the way gms's client does; and
   connect + round trip + close.

    python bench/rpc_profile.py [--quick] [--cpus split|same|free] [--dynamo DIR] [--json PATH]
    python bench/rpc_profile.py --compare /tmp/scratch --cpus same [--rounds 5]

``--cpus``: where the processes run.  ``split`` (client on CPU 0, servers on
CPU 1) is a deployment's placement; ``same`` (all on CPU 0) makes every
microsecond CPU work, without cross-CPU wake-ups, and is the steadiest on a
small VM, so it is the one for A/B.  ``--server-path`` runs the server from
another gms tree; ``--compare TREE`` runs this tree's server and client and
TREE's (a scratch copy with a prototype change), interleaved, and prints the
deltas.  A run on the 2-core host: b51ebe4:docs/results/rpc_profile_2core.json.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import pstats
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from _common import cpu_name, percentile, print_table, tree_env, write_json  # noqa: E402

now = time.perf_counter_ns

# =============================================================================
# 1. the instrumented server (runs in its own process: ``--serve``)
# =============================================================================


def instrument(stamps: list) -> None:
    """Wrap the server's steps to stamp (conn, step, ns).  Wrappers, not copies: a
    step that a refactor renames is simply not stamped."""
    import trio

    from gms.server.edge import netio
    from gms.server.service import core as core_mod
    from gms.server.service import session as session_mod

    Session = session_mod.Session
    conn_of_task: dict = {}

    def conn() -> int:
        return conn_of_task.get(trio.lowlevel.current_task(), -1)

    # The session's channel (the one place its socket is read and written):
    # stamps when a read returns and a send finishes, for the current task's conn.
    receive, receive_into, send = netio.Channel.receive, netio.Channel.receive_into, netio.Channel.send

    async def stamped_receive(self, *args):
        data = await receive(self, *args)
        stamps.append((conn(), "woke" if len(data) else "eof", now()))
        return data

    async def stamped_receive_into(self, *args):
        n = await receive_into(self, *args)
        stamps.append((conn(), "woke" if n else "eof", now()))
        return n

    async def stamped_send(self, *args):
        await send(self, *args)
        stamps.append((conn(), "sent", now()))

    netio.Channel.receive, netio.Channel.receive_into = stamped_receive, stamped_receive_into
    netio.Channel.send = stamped_send

    init = Session.__init__

    def __init__(self, *args, **kwargs):
        started = now()
        init(self, *args, **kwargs)
        stamps.append((self.conn, "accepted", started))
        stamps.append((self.conn, "session made", now()))

    run = Session.run

    async def run_wrapped(self):
        conn_of_task[trio.lowlevel.current_task()] = self.conn
        stamps.append((self.conn, "task runs", now()))
        try:
            await run(self)
        finally:
            stamps.append((self.conn, "closed", now()))

    Session.__init__, Session.run = __init__, run_wrapped

    def stamped(fn, before: str, after: str):
        def wrapper(*args, **kwargs):
            stamps.append((conn(), before, now()))
            try:
                return fn(*args, **kwargs)
            finally:
                stamps.append((conn(), after, now()))

        return wrapper

    def stamped_async(fn, before: str, after: str):
        async def wrapper(*args, **kwargs):
            stamps.append((conn(), before, now()))
            try:
                return await fn(*args, **kwargs)
            finally:
                stamps.append((conn(), after, now()))

        return wrapper

    from gms.wire import connection as wire

    next_request, encode = wire.ServerConnection.next_request, wire.ServerConnection.send

    def stamped_next_request(self):
        started = now()
        request = next_request(self)
        if request is not wire.NEED_DATA and request is not wire.PEER_CLOSED:  # a request: one per decode
            stamps.extend([(conn(), "decode", started), (conn(), "decoded", now())])
        return request

    wire.ServerConnection.next_request = stamped_next_request
    wire.ServerConnection.send = stamped(encode, "encode", "encoded")
    Session._answer = stamped_async(Session._answer, "answer", "answered")
    Session._send = stamped_async(Session._send, "send", "send done")
    for name in ("handshake", "disconnect"):  # the core's own steps (a request's: Requests.handle, below)
        setattr(core_mod.ServiceCore, name,
                stamped(getattr(core_mod.ServiceCore, name), f"core.{name}", f"core.{name} done"))
    from gms.server.service import requests as requests_mod
    from gms.server.tiers import memory as memory_mod

    requests_mod.Requests.handle = stamped(requests_mod.Requests.handle, "core.handle", "core.handle done")
    # an allocation's memory: from the stock, made on the loop, or on the lane
    memory_mod.Memory.create = stamped_async(memory_mod.Memory.create, "memory.create", "memory.create done")


def serve(socket_path: str, stamps_path: str | None, cprofile_path: str | None) -> None:
    """``gms serve`` (on the backend ``--backend`` chose: ``GMS_PROFILE_BACKEND``),
    instrumented or profiled; the stamps or the profile are written when SIGTERM
    ends the server."""
    from gms.cli import main

    stamps: list = []
    if stamps_path:
        instrument(stamps)
    profile = None
    if cprofile_path:
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    # The server alone, in this process: under a keeper (a tree that has one,
    # by default) this process would be the keeper and the server its child,
    # unprofiled.  The keeper's share is in bench/cpu_per_request.py's rows.
    import gms.cli

    serve_py = Path(gms.cli.__file__).parent / "serve.py"
    alone = ["--no-keeper"] if serve_py.exists() and "--no-keeper" in serve_py.read_text() else []
    try:
        main(["serve", "--backend", os.environ.get("GMS_PROFILE_BACKEND", "host"), "--socket", socket_path, "--log-level", "warning", *alone])
    finally:
        if profile is not None:
            profile.disable()
            profile.dump_stats(cprofile_path)
        if stamps_path:
            Path(stamps_path).write_text(json.dumps(stamps))


SERVER_CPU: int | None = None  # set by --cpus: where every server process runs


def pinned() -> None:
    """preexec_fn of a server process: its CPU, if one was chosen."""
    if SERVER_CPU is not None:
        os.sched_setaffinity(0, {SERVER_CPU})


class ServerProcess:
    def __init__(self, directory: str, tree: Path, name: str, *, stamps: bool = False, cprofile: bool = False):
        self.socket = os.path.join(directory, f"{name}.sock")
        self.stamps_path = os.path.join(directory, f"{name}.stamps.json") if stamps else None
        self.profile_path = os.path.join(directory, f"{name}.prof") if cprofile else None
        env = tree_env(os.pathsep.join([str(tree), str(HERE)]))
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve", self.socket,
                                      self.stamps_path or "", self.profile_path or ""], env=env, preexec_fn=pinned)
        wait_for_socket(self.socket, self.proc)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)

    def stamps(self) -> list:
        return json.loads(Path(self.stamps_path).read_text())


def wait_for_socket(path: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while True:
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(path)
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"no server at {path}") from None
            time.sleep(0.05)
        finally:
            probe.close()


# =============================================================================
# 1. the instrumented client (this process) and the timeline
# =============================================================================


def instrument_client(stamps: list) -> None:
    from gms.client import transport as t

    def stamped(fn, before: str, after: str):
        def wrapper(*args, **kwargs):
            stamps.append((before, now()))
            try:
                return fn(*args, **kwargs)
            finally:
                stamps.append((after, now()))

        return wrapper

    t.encode = stamped(t.encode, "client encode", "client encoded")
    t.decode = stamped(t.decode, "client decode", "client decoded")
    t._connect = stamped(t._connect, "client connect", "client connected")
    Transport = t.RpcTransport
    read_frame, receive = Transport._read_frame, Transport._receive

    def _read_frame(self, *args, **kwargs):
        stamps.append(("client sent", now()))  # sendall returned just before
        return read_frame(self, *args, **kwargs)

    def _receive(self, *args, **kwargs):
        out = receive(self, *args, **kwargs)
        stamps.append(("client woke", now()))
        return out

    Transport._read_frame, Transport._receive = _read_frame, _receive


def build_layout(path: str) -> None:
    from gms import GMSClientMemoryManager

    writer = GMSClientMemoryManager(path)
    writer.connect("RW")
    ids = [writer.allocate_handle(2 << 20, "weights")[0] for _ in range(4)]
    writer.metadata_put_many([(f"key.{i}", ids[i % 4], i, b"v" * 64) for i in range(100)])
    writer.commit()
    writer.close()


def ops(path: str):
    """The operations profiled, each as the user calls it: (name, setup, op, teardown)."""
    from gms import GMSClientMemoryManager

    reader = GMSClientMemoryManager(path)
    hs = GMSClientMemoryManager(path)

    def handshake():
        hs.connect("RO")
        hs.abort()

    writer = GMSClientMemoryManager(path, layout="scratch")
    putter = GMSClientMemoryManager(path, layout="puts")
    target: list[str] = []
    keys = iter(range(1 << 40))

    def put_setup():
        putter.connect("RW")
        target.append(putter.allocate_handle(2 << 20, "bench")[0])

    def put():  # a new key each call, as a model's publish writes them (bench/peers' row)
        putter.metadata_put(f"k.{next(keys)}", target[0], 0, b"v" * 64)

    return {
        "handshake": (lambda: None, handshake, lambda: None),
        "metadata_get": (lambda: reader.connect("RO"), lambda: reader.metadata_get("key.42"), reader.close),
        "metadata_put": (put_setup, put, putter.close),
        "allocate": (lambda: writer.connect("RW"), lambda: writer.allocate_handle(2 << 20, "bench"), writer.close),
    }


def client_run(op, n: int, warmup: int, stamps: list) -> list[list]:
    """Each timed call's client stamps, from 'call' to 'returned' (and what follows)."""
    for _ in range(warmup):
        op()
    runs = []
    for _ in range(n):
        del stamps[:]
        stamps.append(("call", now()))
        op()
        stamps.append(("returned", now()))
        runs.append(list(stamps))
    return runs


def server_requests(stamps: list) -> list[dict]:
    """Group the server's stamps into requests, one per 'decode': what comes before
    a decode (the accept, the session's start, the read that woke it) belongs to
    it, what comes after (dispatch, encode, send; at the end the hang-up and the
    teardown) to the request being served."""
    by_conn: dict[int, list] = {}
    for conn, step, t in stamps:
        if conn != -1:
            by_conn.setdefault(conn, []).append((step, t))
    leading = {"accepted", "session made", "task runs", "woke"}
    requests = []
    for steps in by_conn.values():
        current: dict | None = None
        ahead: dict = {}
        for step, t in sorted(steps, key=lambda s: s[1]):
            if step == "decode":
                current = dict(ahead)
                requests.append(current)
                ahead = {}
            if step in leading or current is None:
                ahead.setdefault(step, t)
            elif step == "sent":
                current[step] = t  # a frame sent in pieces: the last piece counts
            else:
                current.setdefault(step, t)
    return sorted(requests, key=lambda r: r.get("decoded", 0))


def timeline(client_runs: list[list], requests: list[dict]) -> list[tuple[str, float, float]]:
    """Median offset of every step from the call, both sides merged; a server
    request belongs to the call during which it was decoded."""
    decoded = [r.get("decoded", 0) for r in requests]
    offsets: dict[str, list[float]] = {}
    for run in client_runs:
        steps = dict(reversed(run))  # first occurrence of each step wins
        t0, t1 = steps["call"], steps["returned"]
        i = bisect.bisect_left(decoded, t0)
        if i < len(requests) and decoded[i] <= t1:
            for step, t in requests[i].items():
                steps.setdefault(f"server {step}", t)
        for step, t in steps.items():
            offsets.setdefault(step, []).append((t - t0) / 1e3)
    rows = sorted(((s, statistics.median(v)) for s, v in offsets.items() if len(v) >= len(client_runs) // 2),
                  key=lambda r: r[1])
    out, last = [], 0.0
    for step, offset in rows:
        out.append((step, offset, offset - last))
        last = offset
    return out


def run_timelines(tree: Path, n: int, warmup: int) -> dict:
    # The client blocks for its answers here (no polling): polling moves a step's
    # cost into the other process's wake-up, and its on/off switch (a moving
    # average against half the window) flips between runs; the plain runs below
    # measure both ways.
    os.environ["GMS_CLIENT_SPIN_US"] = "0"
    stamps: list = []
    instrument_client(stamps)
    results = {}
    with tempfile.TemporaryDirectory(prefix="gms-prof-") as directory:
        server = ServerProcess(directory, tree, "stamped", stamps=True)
        try:
            build_layout(server.socket)
            table = ops(server.socket)
            runs = {}
            for name, (setup, op, teardown) in table.items():
                setup()
                runs[name] = client_run(op, n, warmup, stamps)
                teardown()
        finally:
            server.stop()
        requests = server_requests(server.stamps())
    for name, client_runs in runs.items():
        results[name] = {
            "total_us": statistics.median((r[-1][1] - r[0][1]) / 1e3 for r in client_runs),
            "steps": timeline(client_runs, requests),
        }
    return results


def run_plain(tree: Path, n: int, warmup: int, spin_us: float | None) -> dict:
    """The same calls against an uninstrumented server, with no client wrappers (in a
    fresh process): what the stamps cost, and what the client's polling does
    (``spin_us`` None: gms's default)."""
    code = r"""
import json, sys, time
sys.path.insert(0, sys.argv[3])
import rpc_profile as rp
out = {}
table = rp.ops(sys.argv[1])
n, warmup = map(int, sys.argv[2].split(","))
for name, (setup, op, teardown) in table.items():
    setup()
    for _ in range(warmup):
        op()
    samples = []
    for _ in range(n):
        t = time.perf_counter_ns(); op(); samples.append((time.perf_counter_ns() - t) / 1e3)
    teardown()
    out[name] = {"p50_us": rp.percentile(samples, 0.5), "p99_us": rp.percentile(samples, 0.99)}
print(json.dumps(out))
"""
    with tempfile.TemporaryDirectory(prefix="gms-prof-") as directory:
        server = ServerProcess(directory, tree, "plain")
        try:
            build_layout(server.socket)
            env = tree_env(str(ROOT))
            env.pop("GMS_CLIENT_SPIN_US", None)
            if spin_us is not None:
                env["GMS_CLIENT_SPIN_US"] = str(spin_us)
            out = subprocess.run([sys.executable, "-c", code, server.socket, f"{n},{warmup}", str(HERE)],
                                 capture_output=True, text=True, check=True, env=env)
        finally:
            server.stop()
    return json.loads(out.stdout.strip().splitlines()[-1])


# =============================================================================
# 2. hotspots: the server under cProfile
# =============================================================================


def run_hotspots(tree: Path, n: int, top: int) -> dict:
    results = {}
    for name in ("handshake", "metadata_get", "allocate"):
        with tempfile.TemporaryDirectory(prefix="gms-prof-") as directory:
            server = ServerProcess(directory, tree, "profiled", cprofile=True)
            try:
                build_layout(server.socket)
                setup, op, teardown = ops(server.socket)[name]
                setup()
                for _ in range(n):
                    op()
                teardown()
            finally:
                server.stop()
            stats = pstats.Stats(server.profile_path)
        rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
        results[name] = [
            {"function": f"{Path(f).name}:{line} {fn}", "calls_per_request": nc / n,
             "own_us_per_request": tt / n * 1e6, "cumulative_us_per_request": ct / n * 1e6}
            for (f, line, fn), (cc, nc, tt, ct, _) in rows
        ]
    return results


# =============================================================================
# 3. floors: echo servers with the same framing, and raw clients
# =============================================================================

HEADER = struct.Struct(">I")


async def _trio_echo(path: str) -> None:
    import trio

    async def serve(sock) -> None:
        with sock:
            buffer, pending = bytearray(65536), bytearray()
            while True:
                n = await sock.recv_into(buffer)
                if not n:
                    return
                pending += memoryview(buffer)[:n]
                while len(pending) >= 4:
                    end = 4 + HEADER.unpack_from(pending)[0]
                    if len(pending) < end:
                        break
                    frame = bytes(pending[:end])
                    del pending[:end]
                    await sock.send(frame)

    listener = trio.socket.socket(socket.AF_UNIX)
    await listener.bind(path)
    listener.listen(1024)
    async with trio.open_nursery() as nursery:
        while True:
            sock, _ = await listener.accept()
            nursery.start_soon(serve, sock)


async def _trio_direct_echo(path: str) -> None:
    """Trio, calling the socket first and waiting only when it would block: trio's
    own socket methods yield to the scheduler after every call that succeeds."""
    import trio

    wait_readable, wait_writable = trio.lowlevel.wait_readable, trio.lowlevel.wait_writable

    async def serve(sock) -> None:
        with sock:
            buffer, pending = bytearray(65536), bytearray()
            while True:
                try:
                    n = sock.recv_into(buffer)
                except BlockingIOError:
                    await wait_readable(sock)
                    continue
                if not n:
                    return
                pending += memoryview(buffer)[:n]
                while len(pending) >= 4:
                    end = 4 + HEADER.unpack_from(pending)[0]
                    if len(pending) < end:
                        break
                    view = memoryview(bytes(pending[:end]))
                    del pending[:end]
                    while view:
                        try:
                            view = view[sock.send(view):]
                        except BlockingIOError:
                            await wait_writable(sock)

    listener = socket.socket(socket.AF_UNIX)
    listener.setblocking(False)
    listener.bind(path)
    listener.listen(1024)
    async with trio.open_nursery() as nursery:
        while True:
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                await wait_readable(listener)
                continue
            sock.setblocking(False)
            nursery.start_soon(serve, sock)


async def _asyncio_streams_echo(path: str) -> None:
    async def serve(reader, writer) -> None:  # readexactly + write + drain, as Dynamo's server
        try:
            while True:
                header = await reader.readexactly(4)
                body = await reader.readexactly(HEADER.unpack(header)[0])
                writer.write(header + body)
                await writer.drain()
        except asyncio.IncompleteReadError:
            writer.close()

    server = await asyncio.start_unix_server(serve, path=path)
    await server.serve_forever()


class _EchoProtocol(asyncio.Protocol):
    def connection_made(self, transport) -> None:
        self.transport, self.pending = transport, bytearray()

    def data_received(self, data: bytes) -> None:
        self.pending += data
        while len(self.pending) >= 4:
            end = 4 + HEADER.unpack_from(self.pending)[0]
            if len(self.pending) < end:
                return
            self.transport.write(bytes(self.pending[:end]))
            del self.pending[:end]


async def _asyncio_protocol_echo(path: str) -> None:
    server = await asyncio.get_running_loop().create_unix_server(_EchoProtocol, path=path)
    await server.serve_forever()


ECHO = {
    "trio": lambda path: __import__("trio").run(_trio_echo, path),
    "trio, direct socket calls": lambda path: __import__("trio").run(_trio_direct_echo, path),
    "asyncio streams, uvloop": lambda path: __import__("uvloop").run(_asyncio_streams_echo(path)),
    "asyncio protocol, uvloop": lambda path: __import__("uvloop").run(_asyncio_protocol_echo(path)),
    "asyncio streams": lambda path: asyncio.run(_asyncio_streams_echo(path)),
    "asyncio protocol": lambda path: asyncio.run(_asyncio_protocol_echo(path)),
}


class RawClient:
    """Bytes on a socket: no client library.  ``spin_us`` > 0 polls for the answer
    first (MSG_DONTWAIT), as gms's client does, then blocks."""

    def __init__(self, path: str, spin_us: float = 0.0) -> None:
        self.path, self.spin_ns = path, int(spin_us * 1000)
        self.buffer = bytearray(65536)
        self.sock = None

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.path)

    def close(self) -> None:
        self.sock.close()

    def _recv(self) -> int:
        if self.spin_ns:
            deadline = now() + self.spin_ns
            while now() < deadline:
                try:
                    return self.sock.recv_into(self.buffer, 0, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue
        return self.sock.recv_into(self.buffer)

    def call(self, frame: bytes) -> bytes:
        self.sock.sendall(frame)
        got = bytearray()
        while True:
            n = self._recv()
            if not n:
                raise ConnectionError("closed")
            got += memoryview(self.buffer)[:n]
            if len(got) >= 4 and len(got) >= 4 + HEADER.unpack_from(got)[0]:
                return bytes(got)


def _frame(obj: dict) -> bytes:
    import msgpack

    body = msgpack.packb(obj, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def floor_rows(path: str, handshake: bytes, request: bytes | None, n: int, n_connect: int) -> dict:
    """Round trips on one connection (blocking, polling) and connect + round trip + close."""
    out = {}
    for label, spin in (("round trip, blocking", 0.0), ("round trip, polling 200 µs", 200.0)):
        if request is None:
            continue
        client = RawClient(path, spin)
        client.connect()
        client.call(handshake)
        for _ in range(200):
            client.call(request)
        samples = []
        for _ in range(n):
            t = now()
            client.call(request)
            samples.append((now() - t) / 1e3)
        client.close()
        out[label] = {"p50_us": percentile(samples, 0.5), "p99_us": percentile(samples, 0.99)}
    samples = []
    client = RawClient(path)
    for i in range(n_connect + 100):
        t = now()
        client.connect()
        client.call(handshake)
        client.close()
        if i >= 100:
            samples.append((now() - t) / 1e3)
    out["connect, round trip, close"] = {"p50_us": percentile(samples, 0.5), "p99_us": percentile(samples, 0.99)}
    return out


def run_floors(tree: Path, dynamo: Path | None, n: int, n_connect: int) -> dict:
    results = {}
    echo = _frame({"type": "MetadataGetRequest", "key": "key.42"})  # 40 bytes: a get's size
    with tempfile.TemporaryDirectory(prefix="gms-floor-") as directory:
        for kind in ECHO:
            path = os.path.join(directory, f"echo{len(results)}.sock")
            proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--echo", kind, path],
                                    preexec_fn=pinned)
            try:
                wait_for_socket(path, proc)
                results[f"echo: {kind}"] = floor_rows(path, echo, echo, n, n_connect)
            except (ImportError, RuntimeError) as exc:
                results[f"echo: {kind}"] = {"error": str(exc)}
            finally:
                proc.terminate()
                proc.wait(30)
        server = ServerProcess(directory, tree, "gms")
        try:
            build_layout(server.socket)
            results["gms server (raw client)"] = floor_rows(
                server.socket, _frame({"type": "HandshakeRequest", "lock_type": "RO"}),
                _frame({"type": "MetadataGetRequest", "key": "key.42"}), n, n_connect)
        finally:
            server.stop()
        if dynamo is not None:
            results["Dynamo server (raw client)"] = dynamo_floor(dynamo, directory, n, n_connect)
    return results


def dynamo_floor(peer: Path, directory: str, n: int, n_connect: int) -> dict:
    """Dynamo's server (bench/peers) with the same raw clients: a layout committed by
    its own client in a child process, then the raw handshake and get."""
    sys.path.insert(0, str(HERE / "peers"))
    import dynamo_side

    server = dynamo_side.start_server(peer, directory)
    if SERVER_CPU is not None:
        for task in os.listdir(f"/proc/{server.pid}/task"):  # its server runs in a thread of its own
            os.sched_setaffinity(int(task), {SERVER_CPU})
    try:
        params = json.dumps({"socket": server.socket, "server_pid": server.pid})
        subprocess.run([sys.executable, str(HERE / "peers" / "dynamo_side.py"), "setup", params],
                       check=True, capture_output=True, env=dynamo_side.peer_env(peer))
        return floor_rows(server.socket, _frame({"type": "handshake_request", "lock_type": "ro", "timeout_ms": None}),
                          _frame({"type": "metadata_get_request", "key": "key.42"}), n, n_connect)
    finally:
        server.terminate()
        server.wait(60)


# =============================================================================
# A/B: this tree against another (a scratch copy with a prototype change)
# =============================================================================


def measure_tree(n: int) -> dict:
    """In a process whose PYTHONPATH starts with a gms tree: that tree's server and
    client, the client blocking for answers; raw-socket rows as well, so a server
    change shows without the client's share."""
    os.environ["GMS_CLIENT_SPIN_US"] = "0"
    import gms

    tree = Path(gms.__file__).resolve().parent.parent
    out = {}
    with tempfile.TemporaryDirectory(prefix="gms-ab-") as directory:
        server = ServerProcess(directory, tree, "ab")
        try:
            build_layout(server.socket)
            raw = floor_rows(server.socket, _frame({"type": "HandshakeRequest", "lock_type": "RO"}),
                             _frame({"type": "MetadataGetRequest", "key": "key.42"}), n, max(200, n // 2))
            out["raw handshake"] = raw["connect, round trip, close"]
            out["raw metadata get"] = raw["round trip, blocking"]
            for name, (setup, op, teardown) in ops(server.socket).items():
                setup()
                for _ in range(n // 5):
                    op()
                samples = []
                for _ in range(n):
                    t = now()
                    op()
                    samples.append((now() - t) / 1e3)
                teardown()
                out[f"client {name}"] = {"p50_us": percentile(samples, 0.5), "p99_us": percentile(samples, 0.99)}
        finally:
            server.stop()
    return out


def run_compare(base: Path, other: Path, n: int, rounds: int, cpus: str) -> dict:
    """Both trees, interleaved ``rounds`` times (drift hits both alike); medians of p50."""
    runs: dict[str, list] = {"base": [], "other": []}
    for _ in range(rounds):
        for label, tree in (("base", base), ("other", other)):
            env = tree_env(os.pathsep.join([str(tree), str(HERE)]))
            out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--measure", str(n), cpus],
                                 capture_output=True, text=True, env=env, check=True)
            runs[label].append(json.loads(out.stdout.strip().splitlines()[-1]))
    table = {}
    for row in runs["base"][0]:
        b = statistics.median(r[row]["p50_us"] for r in runs["base"])
        o = statistics.median(r[row]["p50_us"] for r in runs["other"])
        table[row] = {"base_p50_us": b, "other_p50_us": o, "delta_us": o - b, "delta_pct": 100 * (o - b) / b}
    return {"base": str(base), "other": str(other), "rounds": rounds, "rows": table, "runs": runs}


# =============================================================================
# the report
# =============================================================================


def main() -> None:
    global SERVER_CPU
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(sys.argv[2], sys.argv[3] or None, sys.argv[4] or None)
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--echo":
        ECHO[sys.argv[2]](sys.argv[3])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--measure":
        if sys.argv[3] != "free":
            SERVER_CPU = 1 if sys.argv[3] == "split" else 0
            os.sched_setaffinity(0, {0})
        print(json.dumps(measure_tree(int(sys.argv[2]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--n", type=int, default=3000, help="timed calls per operation")
    parser.add_argument("--server-path", type=Path, default=ROOT, help="the gms tree the server runs from")
    parser.add_argument("--dynamo", type=Path, help="the peer's folder: add Dynamo's server to the floors")
    parser.add_argument("--compare", type=Path, metavar="TREE",
                        help="A/B: this tree's server and client against TREE's, interleaved")
    parser.add_argument("--rounds", type=int, default=5, help="--compare: rounds of both trees")
    parser.add_argument("--backend", default="host", choices=("host", "cuda"),
                        help="the instrumented and profiled servers' backend (the floors need none)")
    parser.add_argument("--only", choices=("timeline", "hotspots", "floors"))
    parser.add_argument("--cpus", default="split", choices=("split", "same", "free"),
                        help="split: client on CPU 0, servers on CPU 1; same: all on CPU 0; free: the scheduler's choice")
    parser.add_argument("--json", default="bench/results/rpc_profile.json")
    args = parser.parse_args()
    os.environ["GMS_PROFILE_BACKEND"] = args.backend  # read by every server process this run starts
    n = 500 if args.quick else args.n
    if args.compare:
        result = run_compare(args.server_path, args.compare.resolve(), n, args.rounds, args.cpus)
        print_table(f"A/B, {args.rounds} rounds interleaved, medians of p50 (µs), CPUs {args.cpus}: "
                    f"{result['base']} -> {result['other']}",
                    [(row, f"{r['base_p50_us']:.1f}", f"{r['other_p50_us']:.1f}", f"{r['delta_us']:+.1f}",
                      f"{r['delta_pct']:+.0f}%") for row, r in result["rows"].items()],
                    header=("row", "base", "other", "delta", ""))
        write_json(args.json.replace(".json", "_compare.json"), result)
        return
    # Where the two processes run decides how fast one wakes the other: on this
    # kind of VM a wake-up on another CPU costs tens of µs more than a hand-off on
    # the same one, and the scheduler's choice differs from run to run.
    if args.cpus != "free":
        SERVER_CPU = 1 if args.cpus == "split" else 0
        os.sched_setaffinity(0, {0})
    results: dict = {"cpu": cpu_name(), "cores": os.cpu_count(), "python": sys.version.split()[0],
                     "server_path": str(args.server_path), "n": n, "cpus": args.cpus}
    if args.only in (None, "timeline"):
        results["timeline"] = run_timelines(args.server_path, n, n // 5)
        results["plain_blocking"] = run_plain(args.server_path, n, n // 5, 0)
        results["plain_polling"] = run_plain(args.server_path, n, n // 5, None)
        for name, r in results["timeline"].items():
            blocking, polling = results["plain_blocking"][name], results["plain_polling"][name]
            print_table(f"{name}: {r['total_us']:.0f} µs with stamps (client blocking); without stamps "
                        f"{blocking['p50_us']:.0f} µs blocking, {polling['p50_us']:.0f} µs polling (gms's default; "
                        f"p99 {blocking['p99_us']:.0f} and {polling['p99_us']:.0f}); medians over {n} calls",
                        [(step, f"{offset:.1f}", f"{delta:.1f}") for step, offset, delta in r["steps"]],
                        header=("step", "at µs", "since last µs"))
    if args.only in (None, "hotspots"):
        results["hotspots"] = run_hotspots(args.server_path, n, 25)
        for name, rows in results["hotspots"].items():
            print_table(f"server hotspots, {name} (cProfile, µs per request)",
                        [(r["function"][:80], f"{r['calls_per_request']:.1f}", f"{r['own_us_per_request']:.2f}",
                          f"{r['cumulative_us_per_request']:.2f}") for r in rows],
                        header=("function", "calls", "own µs", "cumulative µs"))
    if args.only in (None, "floors"):
        results["floors"] = run_floors(args.server_path, args.dynamo, n * 2, max(200, n // 2))
        rows = []
        for server, r in results["floors"].items():
            for client, s in r.items():
                if client == "error":
                    rows.append((server, s[:60], "", ""))
                else:
                    rows.append((server, client, f"{s['p50_us']:.1f}", f"{s['p99_us']:.1f}"))
        print_table("floors: the same framing, raw clients", rows, header=("server", "client", "p50 µs", "p99 µs"))
    write_json(args.json, results)


if __name__ == "__main__":
    main()
