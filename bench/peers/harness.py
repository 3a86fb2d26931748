"""What both sides of the same-run benchmark share: the timing loop, the raw
socket handshake, the fd count, the 8-process throughput loop, the layout to
import, and the child-process entry point.

It imports neither gms nor Dynamo's package: each side's module (gms_side.py,
dynamo_side.py) brings its own client and runs here in a process of its own.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/, for _common
from _common import percentile  # noqa: E402

Op = Callable[[], object]


# -- timing ----------------------------------------------------------------------


def measure(op: Op, n: int, warmup: int) -> list[int]:
    """``warmup`` untimed calls, then ``n`` timed ones: nanoseconds each, from the
    call to its return (what the user waits for)."""
    for _ in range(warmup):
        op()
    clock = time.perf_counter_ns
    samples = []
    for _ in range(n):
        t = clock()
        op()
        samples.append(clock() - t)
    return samples


def stats(samples_ns: list[int]) -> dict:
    s = [x / 1e3 for x in samples_ns]
    return {"p50_us": percentile(s, 0.50), "p99_us": percentile(s, 0.99),
            "mean_us": sum(s) / len(s), "n": len(s)}


# -- the raw handshake: bytes on the socket, no client library -------------------------


def frame(body: bytes) -> bytes:
    """Both sides frame the same way: a 4-byte big-endian length, then msgpack."""
    return struct.pack(">I", len(body)) + body


def read_frame(sock: socket.socket) -> bytes:
    header = b""
    while len(header) < 4:
        chunk = sock.recv(4 - len(header))
        if not chunk:
            raise ConnectionError("the server closed the connection")
        header += chunk
    (length,) = struct.unpack(">I", header)
    body = b""
    while len(body) < length:
        chunk = sock.recv(length - len(body))
        if not chunk:
            raise ConnectionError("the server closed the connection inside a frame")
        body += chunk
    return body


def raw_handshake(path: str, request: bytes) -> Op:
    """Connect, send the handshake's bytes, read the answer's frame, close."""

    def op() -> bytes:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            sock.sendall(request)
            return read_frame(sock)
        finally:
            sock.close()

    return op


# -- the server's fd table ----------------------------------------------------------------


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# -- throughput: N client processes in a closed loop ------------------------------------------


def _worker(make_op: Callable[[], Op], warmup: int, ready, go, start, duration: float, out, cpu) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, cpu)
    try:
        op = make_op()
        for _ in range(warmup):
            op()
    except BaseException as exc:  # the parent sees it instead of waiting forever
        ready.release()
        out.put(("error", repr(exc)))
        return
    ready.release()
    go.wait()
    clock = time.perf_counter
    while clock() < start.value:
        time.sleep(0.0005)
    end, count = start.value + duration, 0
    while clock() < end:
        op()
        count += 1
    out.put(("ok", count))


def throughput(make_op: Callable[[], Op], processes: int, duration: float, warmup: int = 50,
               first_cpu: int | None = None) -> dict:
    """Each process builds its own client (``make_op``, in the child: CUDA and
    sockets are never shared across fork), warms up, then every process runs its
    loop over the same ``duration``; requests answered per second, all together."""
    ctx = multiprocessing.get_context("fork")
    ready, go, start, out = ctx.Semaphore(0), ctx.Event(), ctx.Value("d", 0.0), ctx.Queue()
    # pinned: one CPU each from first_cpu up (this process itself may be pinned to
    # CPU 0, and children inherit that); too few CPUs: all of them, unpinned
    every = set(range(os.cpu_count() or 1))
    if first_cpu is None:
        cpus = [None]
    else:
        cpus = [{c} for c in sorted(every) if c >= first_cpu] or [every]
    procs = [ctx.Process(target=_worker, args=(make_op, warmup, ready, go, start, duration, out,
                                               cpus[i % len(cpus)]))
             for i in range(processes)]
    for p in procs:
        p.start()
    for _ in procs:
        if not ready.acquire(timeout=300):
            raise RuntimeError("a throughput worker never got ready")
    start.value = time.perf_counter() + 0.2  # every worker is awake before the clock starts
    go.set()
    results = [out.get(timeout=duration + 300) for _ in procs]
    for p in procs:
        p.join()
    errors = [r for kind, r in results if kind == "error"]
    if errors:
        raise RuntimeError(f"throughput worker failed: {errors[0]}")
    total = sum(r for _, r in results)
    return {"ops_per_s": total / duration, "requests": total, "processes": processes, "duration_s": duration}


# -- the layout a fresh process imports ------------------------------------------------------


def llama3_8b_sizes() -> list[int]:
    """Byte sizes of Llama-3-8B's 291 bf16 tensors (hidden 4096, intermediate 14336,
    8 KV heads of 128, vocabulary 128256, 32 layers): 16.06 GB, one allocation each,
    as an engine that allocates per tensor makes them."""
    hidden, inter, kv, vocab = 4096, 14336, 1024, 128256
    layer = [hidden, hidden * hidden, kv * hidden, kv * hidden, hidden * hidden,
             hidden, inter * hidden, inter * hidden, hidden * inter]
    shapes = [vocab * hidden] + layer * 32 + [hidden, vocab * hidden]
    return [2 * n for n in shapes]


def import_sizes(check: bool) -> list[int]:
    return [2 << 20] * 10 if check else llama3_8b_sizes()


# -- the child process ------------------------------------------------------------------------


def child_main(rows: dict[str, Callable[[dict], dict]]) -> None:
    """``python SIDE.py ROW PARAMS_JSON``: run one row, print its result as the last line."""
    row, params = sys.argv[1], json.loads(sys.argv[2])
    result = rows[row](params)
    sys.stdout.flush()
    print(json.dumps(result), flush=True)
