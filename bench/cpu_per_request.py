"""CPU instructions per request, counted, not timed: the server's and the client's.

A small VM's timings move by tens of per cent from run to run (the same
echo floor has measured 1.5x apart in one session), so an A/B of two trees
whose costs differ by a few per cent cannot be read off a clock.  Counted
instructions can: callgrind counts every user-space instruction a process
executes, the same count for the same work whatever else the machine does.
System calls' kernel time is not in it (the RPC rows of ``bench/rpc.py``
measure that, with the clock).

* Server: ``gms serve --backend host`` under callgrind; a raw client (bytes
  on the socket, no gms code: the same client for every tree) sets up a
  committed layout, warms up, then the counters are zeroed, N requests run,
  the counters are dumped: instructions per request of the server process
  alone.  Requests: a metadata get, a metadata put (64 bytes, one writer,
  over a key of its own), an export (one fd), an RO handshake
  (connect, handshake, close), an allocate and a free (2 MiB, one writer).
  Without the keeper (``--no-keeper``; a tree from before the keeper has
  none), and for this tree also with it (the default): the keeper is
  another process, and what the server does to feed it is counted.
* Client: the tree's ``RpcTransport`` against an echo server (the floor of
  ``bench/rpc.py``), polling off: instructions per call of the client process.
* The log's share (this tree only): the events a request records, folded,
  stored and encoded as the keeper is sent them, in one process with no
  server around them: a metadata put's one event, an RO handshake's four
  (opened and granted, released and closed: two batches).

    python bench/cpu_per_request.py [--quick | --n 2000] [--json PATH]
    python bench/cpu_per_request.py --compare /tmp/gms-before      # that tree, then this one

Needs valgrind (``apt-get install valgrind``) and takes a few minutes: each
server starts under callgrind (about 20 s).  Run it alone: on a loaded
machine requests reach the server later, its event loop wakes more often
per request, and that work is counted too (rows came out up to 20 % higher
beside another benchmark); alone, a row repeats to within about 1 %.
"""

from __future__ import annotations

import argparse
import array
import glob
import os
import re
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
from _common import cpu_name, print_table, wait_served, write_json  # noqa: E402

OPS = ("metadata_get", "metadata_put", "export", "handshake", "allocate_free")
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
from gms.fsm.events import (AllocationCreated, MetadataPut, RoConnect, RoDisconnect, RwCommit, RwConnect,
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
    for conn in range(100, 100 + n):
        encode_entries(log.extend([SessionOpened(conn, "default", 0, 0, conn, "RO", layout="w"),
                                   RoConnect(conn, layout="w")]))
        encode_entries(log.extend([RoDisconnect(conn, layout="w"), SessionClosed(conn, layout="w")]))
"""


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


def _has_keeper(tree: Path) -> bool:
    serve = tree / "gms" / "cli" / "serve.py"
    return serve.exists() and "--no-keeper" in serve.read_text()


def _totals(path: str) -> int:
    for line in Path(path).read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {path}")


def server_instructions(tree: Path, op: str, n: int, keeper: bool) -> int:
    """Instructions the server process executed per ``op``, counted while only those ran."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    with tempfile.TemporaryDirectory(prefix="gms-cpu-") as folder:
        sock = os.path.join(folder, "gms.sock")
        args = ["serve", "--backend", "host", "--socket", sock, "--log-level", "warning"]
        if _has_keeper(tree) and not keeper:
            args.append("--no-keeper")
        out = os.path.join(folder, "cg.%p")
        proc = subprocess.Popen(
            ["valgrind", "--tool=callgrind", "--trace-children=yes", f"--callgrind-out-file={out}",
             sys.executable, "-m", "gms", *args],
            env=env, cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        try:
            wait_served(sock, proc, timeout=300)
            subprocess.run([sys.executable, "-c", SETUP, sock], env=env, check=True)
            server_pid = _served_by(sock)
            run_ops(sock, op, 200)  # warm: the code paths and the server's caches
            subprocess.run(["callgrind_control", "-z", str(server_pid)], check=True, capture_output=True)
            run_ops(sock, op, n)
            subprocess.run(["callgrind_control", "-d", str(server_pid)], check=True, capture_output=True)
            time.sleep(0.5)
            dumps = sorted(glob.glob(os.path.join(folder, f"cg.{server_pid}.*")))
            if not dumps:
                raise RuntimeError("callgrind wrote no dump")
            return _totals(dumps[-1]) // n
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)


def _served_by(sock: str) -> int:
    """The pid of the process that answers on ``sock``: the server, not the keeper
    that made the listening socket (whose pid the peer credentials would name)."""
    from gms import get_runtime_state

    return get_runtime_state(sock).pid


def client_instructions(tree: Path, n: int) -> int:
    """Instructions of the tree's client per call against an echo server (polling off)."""
    env = dict(os.environ, PYTHONPATH=str(tree), GMS_CLIENT_SPIN_US="0")
    source = (HERE / "rpc.py").read_text()
    echo = re.search(r'ECHO_SERVER = r"""(.*?)"""', source, re.DOTALL).group(1)
    with tempfile.TemporaryDirectory(prefix="gms-cpu-") as folder:
        sock = os.path.join(folder, "echo.sock")
        server = subprocess.Popen([sys.executable, "-c", echo, sock])
        try:
            from rpc import wait_for  # a socket that takes a connection (no gms to ask)

            wait_for(sock, server)

            def count(calls: int) -> int:
                out = os.path.join(folder, f"client.{calls}.cg")
                subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
                                "-c", CLIENT_CALLS, sock, str(calls)], env=env, check=True, capture_output=True)
                return _totals(out)

            return (count(200 + n) - count(200)) // n
        finally:
            server.terminate()
            server.wait(30)


def log_instructions(tree: Path, what: str, n: int) -> int:
    """Instructions per request of the log alone (``LOG_EVENTS``): ``n`` requests' events less none."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    with tempfile.TemporaryDirectory(prefix="gms-cpu-") as folder:
        def count(requests: int) -> int:
            out = os.path.join(folder, f"log.{requests}.cg")
            subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
                            "-c", LOG_EVENTS, what, str(requests)], env=env, check=True, capture_output=True)
            return _totals(out)

        return (count(n) - count(0)) // n


def measure(tree: Path, n: int, with_keeper: bool, ops: tuple[str, ...] = OPS, bare: bool = True,
            logs: bool = True) -> dict:
    jobs = ([(op, False) for op in ops] if bare else []) + ([(op, True) for op in ops] if with_keeper else [])
    workers = max(1, min(len(jobs), (os.cpu_count() or 2)))
    with ThreadPoolExecutor(workers) as pool:  # one valgrind per CPU
        futures = {}
        for op, keeper in jobs:
            count = n // 2 if op in ("handshake", "allocate_free") else n  # the slow ones
            futures[op, keeper] = pool.submit(server_instructions, tree, op, count, keeper)
        client = pool.submit(client_instructions, tree, n)
        logs = {what: pool.submit(log_instructions, tree, what, n) for what in ("put", "handshake")} if logs else {}
        out = {f"server_{op}{'_keeper' if keeper else ''}": f.result() for (op, keeper), f in futures.items()}
        out["client_call"] = client.result()
        out |= {f"log_{what}": f.result() for what, f in logs.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="--n 400")
    parser.add_argument("--n", type=int, default=2000,
                        help="requests counted per row (half for handshakes, allocations)")
    parser.add_argument("--compare", type=Path, metavar="TREE", help="another checkout, counted the same way")
    parser.add_argument("--ops", default=",".join(OPS), help="the rows to count (comma-separated)")
    parser.add_argument("--keeper-only", action="store_true", help="this tree's rows with the keeper only")
    parser.add_argument("--json", default="bench/results/cpu_per_request.json")
    args = parser.parse_args()
    if args.quick:
        args.n = 400
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        sys.exit("cpu_per_request: needs valgrind (callgrind and callgrind_control)")
    results: dict = {"cpu": cpu_name(), "cores": os.cpu_count(), "n": args.n, "note": (
        "instructions per request (callgrind, user space): the server process alone; "
        "the client per call against an echo server"
    )}
    ops = tuple(op for op in args.ops.split(",") if op)
    if unknown := set(ops) - set(OPS):
        sys.exit(f"cpu_per_request: no such row {sorted(unknown)}; rows: {', '.join(OPS)}")
    this = measure(ROOT, args.n, with_keeper=_has_keeper(ROOT), ops=ops, bare=not args.keeper_only)
    results["this"] = {"tree": str(ROOT), **this}
    rows = []
    if args.compare:
        other = measure(args.compare, args.n, with_keeper=False, ops=ops, logs=False)
        results["other"] = {"tree": str(args.compare), **other}
        for name, value in this.items():
            base = other.get(name) if not name.endswith("_keeper") else other.get(name.removesuffix("_keeper"))
            ratio = f"{value / base:.2f}" if base else "-"
            rows.append((name, f"{base:,}" if base else "-", f"{value:,}", ratio))
        print_table(f"instructions per request ({results['cpu']}); {args.compare} -> this tree",
                    rows, header=("row", "other", "this", "this / other"))
    else:
        rows = [(name, f"{value:,}") for name, value in this.items()]
        print_table(f"instructions per request ({results['cpu']})", rows, header=("row", "instructions"))
    write_json(args.json, results)


if __name__ == "__main__":
    main()
