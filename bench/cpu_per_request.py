"""CPU work per request, counted, not timed: the server's, its floor's, the client's.

A small VM's timings move by tens of per cent from run to run (the same
echo floor has measured 1.5x apart in one session), so an A/B of two trees
whose costs differ by a few per cent cannot be read off a clock.  Counted
work can.  Two counters (``--count``):

* ``instructions`` (the default): callgrind counts every user-space
  instruction a process executes, C included, the same count for the same
  work whatever else the machine does.  Needs valgrind; a few minutes (each
  server starts under callgrind, about 20 s).
* ``opcodes``: the Python bytecodes the process's main thread runs (where the
  server's event loop runs; work handed to a thread is not counted), from a
  ``sys.settrace`` hook the script puts first on the counted processes'
  import path.  No valgrind and about ten seconds with ``--quick``: CI runs it
  (``.ci/run``) against ``docs/results/cpu_per_request_opcodes_2core.json``,
  so a change that adds work to a request shows as a ratio in its log.

System calls' kernel time is in neither (``bench/peers/`` times requests).

* Server: ``gms serve --backend host``, counted; a raw client (bytes on the
  socket, no gms code: the same client for every tree) sets up a committed
  layout, warms up, then the count is zeroed, N requests run, the count is
  read: per request of the server process alone.  Requests: a metadata get,
  a metadata put (64 bytes, one writer, over a key of its own), an export
  (one fd), an RO handshake (connect, handshake, close), an allocate and a
  free (2 MiB, one writer).  Without the keeper (``--no-keeper``; a tree from
  before the keeper has none), and for this tree also with it (the default):
  the keeper is another process, and what the server does to feed it is counted.
* Floors: a bare Trio echo server (``ECHO_SERVER``), counted the same way
  under the same client: ``round_trip`` a get's frame and back on an open
  connection, ``connect`` a connect, a handshake's frame and back, a close.
* Client: the tree's ``RpcTransport`` against the echo server, polling off:
  per call of the client process.
* The log's share (this tree only): the events a request records, folded,
  stored and encoded as the keeper is sent them, in one process with no
  server around them: a metadata put's one event; an RO handshake's two
  (READER_JOINED, READER_LEFT: its session with its lock, each way); and
  ``sessions``, the session opened and closed with no lock, the least any
  handshake that is logged could cost.

    python bench/cpu_per_request.py [--quick | --n 2000] [--count opcodes] [--out DIR]
    python bench/cpu_per_request.py --compare /tmp/gms-before      # that tree, then this one
    python bench/cpu_per_request.py --count opcodes --quick --baseline docs/results/cpu_per_request_opcodes_2core.json

Run it alone: on a loaded machine requests reach the server later, its
event loop wakes more often per request, and that work is counted too (rows
came out up to 20 % higher beside another benchmark); alone, a row repeats
to within about 1 % (both counters).
"""

from __future__ import annotations

import argparse
import array
import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from _common import add_out, cpu_name, print_table, tree_env, wait_for, wait_served, write_results  # noqa: E402

OPS = ("metadata_get", "metadata_put", "export", "handshake", "allocate_free")
LOGGED = ("put", "handshake", "sessions")  # the log's share: LOG_EVENTS
FLOORS = ("round_trip", "connect")  # a bare Trio echo server: a get's frame and back; a connect, a frame, a close
_HEADER = struct.Struct(">I")

SETUP = r"""
import sys
from gms import GMSClientMemoryManager
writer = GMSClientMemoryManager(sys.argv[1])
writer.connect("RW")
ids = [writer.allocate_handle(2 << 20, "weights")[0] for _ in range(4)]
for i in range(100):
    writer.metadata_put(f"key.{i}", ids[i % 4], i, b"v" * 64)
writer.commit()
"""

CLIENT_CALLS = r"""
import sys
from gms.client.transport import RpcTransport
from gms.wire import messages as m
transport = RpcTransport(sys.argv[1])
message = m.GetStateHashResponse("x" * 24)
for _ in range(int(sys.argv[2])):
    transport.call(message, m.GetStateHashResponse)
"""

LOG_EVENTS = r"""
import sys
from gms.fsm import Limits, compute_layout_hash
from gms.fsm.events import (AllocationCreated, MetadataPut, ReaderJoined, ReaderLeft, RwCommit, RwConnect,
                            ServerStarted, SessionClosed, SessionOpened)
from gms.handover.image import encode_entries
from gms.store import EventLog
what, n = sys.argv[1], int(sys.argv[2])
log = EventLog(max_bytes=64 << 20)  # the server's default bound
log.append(ServerStarted(0, 1 << 40, None, None, {"default": None}, Limits().as_dict(), backend="host", device=0,
                         device_uuid="x", layout=""))
log.extend([SessionOpened(1, "default", 0, 0, 1, "RW", layout="w"), RwConnect(1, layout="w"),
            AllocationCreated(1, "a0", 2 << 20, 2 << 20, "w", 0, layout="w")])
if what == "put":
    put = MetadataPut(1, "key.0", "a0", 0, b"v" * 64, layout="w")
    for _ in range(n):
        encode_entries(log.extend([put]))
else:
    layout = log.state.layout("w")
    digest = compute_layout_hash(layout.allocations.values(), layout.metadata.values())
    log.extend([RwCommit(1, digest, "device", layout="w"), SessionClosed(1, layout="w")])
    # "handshake": a reader's session with its lock, one event each way; "sessions": the
    # session alone, no lock (the least a logged session costs)
    lock = what == "handshake"
    for conn in range(100, 100 + n):
        opened = (ReaderJoined if lock else SessionOpened)(conn, "default", 0, 0, conn, "RO", layout="w")
        encode_entries(log.extend([opened]))
        encode_entries(log.extend([(ReaderLeft if lock else SessionClosed)(conn, layout="w")]))
"""


# The floor: a bare Trio server that answers each read with what it read.
ECHO_SERVER = r"""
import os, socket, sys, trio
async def serve(sock):
    with sock:
        while True:
            data = await sock.recv(65536)
            if not data:
                return
            await sock.send(data)
async def main(path):
    listener = trio.socket.socket(socket.AF_UNIX)
    await listener.bind(path)
    listener.listen(1024)
    async with trio.open_nursery() as nursery:
        while True:
            sock, _ = await listener.accept()
            nursery.start_soon(serve, sock)
trio.run(main, sys.argv[1])
"""


def wait_listening(path: str, proc: subprocess.Popen) -> None:
    """Until a socket at ``path`` takes a connection (no gms there to ask)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.socket(socket.AF_UNIX) as probe:
                probe.connect(path)
            return
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"no server at {path}") from None
            time.sleep(0.05)


# -- the raw client (no gms code) --------------------------------------------------------


def _frame(message: dict) -> bytes:
    import msgpack

    body = msgpack.packb(message, use_bin_type=True)
    return _HEADER.pack(len(body)) + body


def _call(sock: socket.socket, frame: bytes) -> dict:
    import msgpack

    sock.sendall(frame)
    got = b""
    while True:
        data, ancillary, _, _ = sock.recvmsg(65536, socket.CMSG_SPACE(4 * 4))
        for _, _, payload in ancillary:  # an export's fd: closed at once
            for fd in array.array("i", payload[: len(payload) - len(payload) % 4]):
                os.close(fd)
        if not data:
            raise ConnectionError("the server closed the connection")
        got += data
        if len(got) >= 4 and len(got) >= 4 + _HEADER.unpack_from(got)[0]:
            return msgpack.unpackb(got[4:], raw=False)


def _connect(path: str, lock: str, layout: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    _call(sock, _frame({"type": "HandshakeRequest", "lock_type": lock, "layout": layout}))
    return sock


def run_ops(path: str, op: str, n: int) -> None:
    """``n`` requests of ``op``, one after the other (what is counted)."""
    if op == "handshake":
        hello = _frame({"type": "HandshakeRequest", "lock_type": "RO", "layout": "weights"})
        for _ in range(n):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            _call(sock, hello)
            sock.close()
            time.sleep(0.0005)  # the server's unwind of the last, before the next connects
        return
    if op == "allocate_free":
        sock = _connect(path, "RW", "scratch")
        allocate = _frame({"type": "AllocateRequest", "size": 2 << 20, "tag": "scratch"})
        for _ in range(n):
            made = _call(sock, allocate)
            _call(sock, _frame({"type": "FreeAllocationRequest", "allocation_id": made["allocation_id"]}))
        sock.close()
        return
    if op == "metadata_put":
        sock = _connect(path, "RW", "scratch")
        made = _call(sock, _frame({"type": "AllocateRequest", "size": 2 << 20, "tag": "scratch"}))
        put = _frame({"type": "MetadataPutRequest", "key": "key.0", "allocation_id": made["allocation_id"],
                      "offset_bytes": 0, "value": b"v" * 64})
        for _ in range(n):
            _call(sock, put)
        sock.close()
        return
    sock = _connect(path, "RO", "weights")
    if op == "metadata_get":
        request = _frame({"type": "MetadataGetRequest", "key": "key.42"})
    else:
        listed = _call(sock, _frame({"type": "ListAllocationsRequest"}))
        first = listed["allocations"][0]["allocation_id"]
        request = _frame({"type": "ExportAllocationRequest", "allocation_id": first})
    for _ in range(n):
        _call(sock, request)
    sock.close()


# -- counting --------------------------------------------------------------------------------

# The opcode counter's hook, put first on the import path of every process the
# count starts (as ``sitecustomize``): with GMS_BENCH_OPCODES set, a process counts
# the bytecodes its main thread runs (where the server's event loop runs; work
# handed to a thread is not counted) from SIGUSR1 to SIGUSR2, or, with
# GMS_BENCH_OPCODES_ALL, from start to exit, and writes the count beside it.
OPCODE_HOOK = r"""
import atexit, os, signal, sys
_folder = os.environ.get("GMS_BENCH_OPCODES")
if _folder:
    _count = [0]

    def _local(frame, event, arg):
        if event == "opcode":
            _count[0] += 1
        return _local

    def _call(frame, event, arg):
        frame.f_trace_opcodes = True
        return _local

    def _mark(name):
        path = os.path.join(_folder, f"{os.getpid()}.{name}")
        with open(path + ".tmp", "w") as out:
            out.write(str(_count[0]))
        os.replace(path + ".tmp", path)

    def _start(signum=None, frame=None):
        _count[0] = 0
        while frame is not None:  # the frames running now (the loop's) count too
            frame.f_trace, frame.f_trace_opcodes = _local, True
            frame = frame.f_back
        sys.settrace(_call)
        _mark("started")

    def _stop(signum=None, frame=None):
        sys.settrace(None)
        while frame is not None:
            frame.f_trace = None
            frame = frame.f_back
        _mark("count")

    if os.environ.get("GMS_BENCH_OPCODES_ALL"):
        _start(frame=sys._getframe())
        atexit.register(_stop)
    else:
        signal.signal(signal.SIGUSR1, _start)
        signal.signal(signal.SIGUSR2, _stop)
"""


def _wait_file(path: str, what: str, timeout: float = 120) -> str:
    wait_for(lambda: os.path.exists(path), timeout, f"the {what} ({path})", poll=0.01)
    return Path(path).read_text()


class Callgrind:
    """Machine instructions in user space, C included (valgrind's callgrind)."""

    unit = "instructions"

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def command(self, argv: list[str], name: str = "cg") -> list[str]:
        return ["valgrind", "--tool=callgrind", "--trace-children=yes",
                f"--callgrind-out-file={os.path.join(self.folder, name)}.%p", *argv]

    def env(self, env: dict) -> dict:
        return env

    def zero(self, pid: int) -> None:
        subprocess.run(["callgrind_control", "-z", str(pid)], check=True, capture_output=True)

    def read(self, pid: int, name: str = "cg") -> int:
        """The count since :meth:`zero` of a live process (``callgrind_control -d``)."""
        subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
        time.sleep(0.5)
        dumps = sorted(glob.glob(os.path.join(self.folder, f"{name}.{pid}.*")))
        if not dumps:
            raise RuntimeError("callgrind wrote no dump")
        return _totals(dumps[-1])

    def whole(self, argv: list[str], env: dict, name: str) -> int:
        """The count of a process run to its end."""
        subprocess.run(self.command(argv, name), env=env, check=True, capture_output=True)
        (dump,) = glob.glob(os.path.join(self.folder, f"{name}.*"))
        count = _totals(dump)
        os.unlink(dump)
        return count


class Opcodes:
    """Python bytecodes the main thread runs (sys.settrace's opcode events):
    no valgrind, within any machine's reach (CI's), C work not counted."""

    unit = "opcodes"

    def __init__(self, folder: str) -> None:
        self.folder = folder
        Path(folder, "sitecustomize.py").write_text(OPCODE_HOOK)

    def command(self, argv: list[str], name: str = "") -> list[str]:
        return argv

    def env(self, env: dict) -> dict:
        path = os.pathsep.join(filter(None, [self.folder, env.get("PYTHONPATH")]))
        return {**env, "PYTHONPATH": path, "GMS_BENCH_OPCODES": self.folder}

    def zero(self, pid: int) -> None:
        os.kill(pid, signal.SIGUSR1)
        _wait_file(os.path.join(self.folder, f"{pid}.started"), "start of the count")

    def read(self, pid: int, name: str = "") -> int:
        path = os.path.join(self.folder, f"{pid}.count")
        os.kill(pid, signal.SIGUSR2)
        count = int(_wait_file(path, "count"))
        os.unlink(path)
        return count

    def whole(self, argv: list[str], env: dict, name: str) -> int:
        subprocess.run(argv, env={**self.env(env), "GMS_BENCH_OPCODES_ALL": "1"}, check=True, capture_output=True)
        (path,) = glob.glob(os.path.join(self.folder, "*.count"))
        count = int(Path(path).read_text())
        os.unlink(path)
        return count


COUNTERS = {"instructions": Callgrind, "opcodes": Opcodes}


def _has_keeper(tree: Path) -> bool:
    serve = tree / "gms" / "cli" / "serve.py"
    return serve.exists() and "--no-keeper" in serve.read_text()


def _totals(path: str) -> int:
    for line in Path(path).read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {path}")


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # the group: a keeper outlives a server that died early
    except ProcessLookupError:
        return  # none left: the early death is the error to see
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def server_count(tree: Path, op: str, n: int, keeper: bool, counter: type) -> int:
    """What the server process ran per ``op``, counted while only those ran."""
    with tempfile.TemporaryDirectory(prefix="gms-cpu-") as folder:
        count = counter(folder)
        env = count.env(tree_env(str(tree)))
        sock = os.path.join(folder, "gms.sock")
        args = ["serve", "--backend", "host", "--socket", sock, "--log-level", "warning"]
        if _has_keeper(tree) and not keeper:
            args.append("--no-keeper")
        proc = subprocess.Popen(count.command([sys.executable, "-m", "gms", *args]), env=env, cwd=folder,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_served(sock, proc, timeout=300)
            subprocess.run([sys.executable, "-c", SETUP, sock], env=env, check=True)
            server_pid = _served_by(sock)
            run_ops(sock, op, 200)  # warm: the code paths and the server's caches
            count.zero(server_pid)
            run_ops(sock, op, n)
            return count.read(server_pid) // n
        finally:
            _stop(proc)


@contextlib.contextmanager
def echo_server(folder: str, count=None):
    """ECHO_SERVER on a socket in ``folder``, counted by ``count`` if given; yields the socket and the process."""
    sock = os.path.join(folder, "echo.sock")
    argv = [sys.executable, "-c", ECHO_SERVER, sock]
    proc = subprocess.Popen(count.command(argv) if count else argv, env=count.env(dict(os.environ)) if count else None,
                            cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_listening(sock, proc)
        yield sock, proc
    finally:
        _stop(proc)


def floor_count(op: str, n: int, counter: type) -> int:
    """The same per request of the echo server: ``round_trip`` a get's frame and back,
    ``connect`` a handshake's connect, frame and close."""
    with tempfile.TemporaryDirectory(prefix="gms-cpu-") as folder:
        count = counter(folder)
        with echo_server(folder, count) as (sock, proc):
            ops = "handshake" if op == "connect" else "metadata_get"
            run_ops(sock, ops, 200)  # (the echo answers each frame with itself)
            count.zero(proc.pid)
            run_ops(sock, ops, n)
            return count.read(proc.pid) // n


def _served_by(sock: str) -> int:
    """The pid of the process that answers on ``sock``: the server, not the keeper
    that made the listening socket (whose pid the peer credentials would name)."""
    from gms import get_runtime_state

    return get_runtime_state(sock).pid


def client_count(tree: Path, n: int, counter: type) -> int:
    """The tree's client per call against the echo server (polling off)."""
    env = tree_env(str(tree), GMS_CLIENT_SPIN_US="0")
    with tempfile.TemporaryDirectory(prefix="gms-cpu-") as folder:
        count = counter(folder)
        with echo_server(folder) as (sock, _):
            def calls(k: int) -> int:
                return count.whole([sys.executable, "-c", CLIENT_CALLS, sock, str(k)], env, f"client.{k}")

            return (calls(200 + n) - calls(200)) // n


def log_count(tree: Path, what: str, n: int, counter: type) -> int:
    """The log alone per request (``LOG_EVENTS``): ``n`` requests' events less none."""
    env = tree_env(str(tree))
    with tempfile.TemporaryDirectory(prefix="gms-cpu-") as folder:
        count = counter(folder)

        def requests(k: int) -> int:
            return count.whole([sys.executable, "-c", LOG_EVENTS, what, str(k)], env, f"log.{k}")

        return (requests(n) - requests(0)) // n


def measure(tree: Path, n: int, with_keeper: bool, counter: type, ops: tuple[str, ...] = OPS, bare: bool = True,
            extras: bool = True) -> dict:
    """Every row of ``tree``: its server's per request (without the keeper where
    ``bare``, with it where ``with_keeper``) and, where ``extras``, Trio's
    floors, the client's call and the log's share."""
    jobs = ([(op, False) for op in ops] if bare else []) + ([(op, True) for op in ops] if with_keeper else [])
    workers = max(1, min(len(jobs), (os.cpu_count() or 2)))
    with ThreadPoolExecutor(workers) as pool:  # one counted process per CPU
        futures = {}
        for op, keeper in jobs:
            count = n // 2 if op in ("handshake", "allocate_free") else n  # the slow ones
            futures[f"server_{op}{'_keeper' if keeper else ''}"] = pool.submit(
                server_count, tree, op, count, keeper, counter)
        if extras:
            for floor in FLOORS:
                futures[f"floor_{floor}"] = pool.submit(floor_count, floor, n // 2 if floor == "connect" else n,
                                                        counter)
            futures["client_call"] = pool.submit(client_count, tree, n, counter)
            for what in LOGGED:
                futures[f"log_{what}"] = pool.submit(log_count, tree, what, n, counter)
        return {name: future.result() for name, future in futures.items()}


def against_baseline(this: dict, path: Path) -> list[tuple]:
    """Each row against the same row of a committed count (``--baseline``)."""
    base = json.loads(path.read_text())["this"]
    return [(name, f"{base[name]:,}" if name in base else "-", f"{value:,}",
             f"{value / base[name]:.2f}" if base.get(name) else "-") for name, value in this.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="--n 400")
    parser.add_argument("--n", type=int, default=2000,
                        help="requests counted per row (half for handshakes, allocations)")
    parser.add_argument("--count", choices=sorted(COUNTERS), default="instructions",
                        help="instructions (callgrind; the default) or opcodes (no valgrind)")
    parser.add_argument("--compare", type=Path, metavar="TREE", help="another checkout, counted the same way")
    parser.add_argument("--baseline", type=Path, metavar="JSON", help="a count of this script's to set each row against")
    parser.add_argument("--ops", default=",".join(OPS), help="the rows to count (comma-separated)")
    parser.add_argument("--keeper-only", action="store_true", help="this tree's rows with the keeper only")
    add_out(parser)  # cpu_per_request[_opcodes].json
    args = parser.parse_args()
    if args.quick:
        args.n = 400
    counter = COUNTERS[args.count]
    if counter is Callgrind and (shutil.which("valgrind") is None or shutil.which("callgrind_control") is None):
        sys.exit("cpu_per_request: needs valgrind (callgrind and callgrind_control), or --count opcodes")
    results: dict = {"cpu": cpu_name(), "cores": os.cpu_count(), "python": sys.version.split()[0], "n": args.n,
                     "unit": counter.unit, "note": (
        f"{counter.unit} per request: the server process alone ({counter.__doc__.split(chr(10))[0]}); "
        "floors: a bare Trio echo server; the client per call against it"
    )}
    ops = tuple(op for op in args.ops.split(",") if op)
    if unknown := set(ops) - set(OPS):
        sys.exit(f"cpu_per_request: no such row {sorted(unknown)}; rows: {', '.join(OPS)}")
    this = measure(ROOT, args.n, _has_keeper(ROOT), counter, ops=ops, bare=not args.keeper_only)
    results["this"] = {"tree": str(ROOT), **this}
    title = f"{counter.unit} per request ({results['cpu']}, {results['cores']} cores)"
    if args.compare:
        other = measure(args.compare, args.n, False, counter, ops=ops, extras=False)
        results["other"] = {"tree": str(args.compare), **other}
        rows = []
        for name, value in this.items():
            base = other.get(name.removesuffix("_keeper"))
            rows.append((name, f"{base:,}" if base else "-", f"{value:,}", f"{value / base:.2f}" if base else "-"))
        print_table(f"{title}; {args.compare} -> this tree", rows, header=("row", "other", "this", "this / other"))
    elif args.baseline:
        print_table(f"{title}; against {args.baseline}", against_baseline(this, args.baseline),
                    header=("row", "baseline", "this", "this / baseline"))
    else:
        print_table(title, [(name, f"{value:,}") for name, value in this.items()], header=("row", counter.unit))
    suffix = "" if counter is Callgrind else f"_{args.count}"
    write_results(args.out, f"cpu_per_request{suffix}", results)


if __name__ == "__main__":
    main()
