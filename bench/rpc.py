"""RPC latency and throughput under load, next to a raw socket echo floor.

Closed loop: N clients (spread over worker processes, threads within) each
send the next request as soon as the last answer arrives, for a fixed time.
Open loop: 64 clients each send 100 requests/s on a schedule; latency counts
from the scheduled time, so a server that falls behind shows it.

Operations: metadata get, export (an fd per answer), RO handshake (connect,
handshake, close), allocate+free (one writer: RW is exclusive).  The floor is
the same clients doing a 40-byte round trip with a Trio echo server, so it
runs the gms client's own code and a Trio server, without the protocol.
Beside the latency, the server's CPU per request (user + system time of the
serving process over the timed window, from /proc, divided by the requests
answered in it): on a machine the clients share with the server, what the
server takes is what the clients lack.

    python bench/rpc.py [--quick] [--backend host|cuda] [--clients 1,16,64,256]
    # before/after in one run, turn about (the tree of another commit, same host):
    git worktree add /tmp/gms-before <commit>
    python bench/rpc.py --quick --compare /tmp/gms-before --runs 3 --json docs/results/rpc_compare_2core.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from _common import compare_trees, cpu_name, percentile, print_comparison, print_table, write_json

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


def wait_for(path: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            probe = socket.socket(socket.AF_UNIX)
            probe.connect(path)
            probe.close()
            return
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"no server at {path}") from None
            time.sleep(0.05)


# -- one client's loop -------------------------------------------------------------


def make_op(kind: str, path: str, ids: list[str]):
    """Set up a client; return the callable one request is."""
    from gms import GMSClientMemoryManager
    from gms.client.transport import RpcTransport
    from gms.wire import messages as m

    if kind == "echo":
        # The gms client itself, against a server that echoes frames back: a
        # response frame echoed decodes as the response expected.  So the
        # floor runs the same client code (encode, poll, recvmsg, decode) and
        # differs from an RPC only by what the server does.
        transport = RpcTransport(path)
        message = m.GetStateHashResponse("x" * 24)
        return lambda: transport.call(message, m.GetStateHashResponse)
    if kind == "handshake":
        def handshake():
            transport = RpcTransport(path)
            transport.call(m.HandshakeRequest("RO"), m.HandshakeResponse)
            transport.close()

        return handshake
    mgr = GMSClientMemoryManager(path)
    if kind == "allocate_free":
        mgr.connect("RW")

        def allocate_free():
            allocation_id, _ = mgr.allocate_handle(2 << 20, "weights")
            mgr.free_handle(allocation_id)

        return allocate_free
    mgr.connect("RO")
    if kind == "metadata_get":
        return lambda: mgr.metadata_get("key.42")
    if kind == "export":
        def export():
            os.close(mgr.export_handle(ids[0]))

        return export
    raise ValueError(kind)


def client_thread(kind, path, ids, ready, start, duration, rate, out) -> None:
    op = make_op(kind, path, ids)
    for _ in range(50):
        op()
    ready()  # the clock starts once every client has connected and warmed up
    start_at = start()
    samples: list[float] = []
    now = time.perf_counter
    while now() < start_at:
        time.sleep(0.0005)
    end = start_at + duration
    if rate:  # open loop: sends on a schedule, latency counted from the schedule
        period = 1.0 / rate
        due = start_at + random.random() * period
        while due < end:
            wait = due - now()
            if wait > 0:
                time.sleep(wait)
            op()
            samples.append(now() - due)
            due += period
    else:
        while True:
            t = now()
            if t >= end:
                break
            op()
            samples.append(now() - t)
    out.extend(samples)


def worker(kind, path, ids, threads, ready, go, start, duration, rate, queue) -> None:
    results: list[float] = []
    errors: list[str] = []
    warmed = threading.Barrier(threads, action=ready.release)

    def wait_for_start() -> float:
        go.wait()
        return start.value

    def client() -> None:
        try:
            client_thread(kind, path, ids, warmed.wait, wait_for_start, duration, rate, results)
        except BaseException:  # reported to the parent, which stops the run
            errors.append(traceback.format_exc())
            warmed.abort()
            ready.release()  # the parent need not wait for this worker

    pool = [threading.Thread(target=client) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    queue.put((results, errors))


MAX_PROCESSES = 64
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system time a process has used (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


def run_load(kind: str, path: str, ids: list[str], clients: int, duration: float, rate: float = 0.0,
             server_pid: int | None = None) -> dict:
    # One process per client up to 64: threads sharing a GIL would measure the
    # harness.  Beyond 64, threads share processes (the server is saturated).
    processes = min(clients, MAX_PROCESSES)
    per = [clients // processes + (1 if i < clients % processes else 0) for i in range(processes)]
    ctx = multiprocessing.get_context("fork")
    queue, ready, go, start = ctx.Queue(), ctx.Semaphore(0), ctx.Event(), ctx.Value("d", 0.0)
    procs = [ctx.Process(target=worker, args=(kind, path, ids, n, ready, go, start, duration, rate, queue))
             for n in per]
    for p in procs:
        p.start()
    for _ in procs:  # every worker's clients are connected and warm (or one failed)
        if not ready.acquire(timeout=300):
            break
    start.value = time.perf_counter() + 0.5  # time for every worker to wake and wait for it
    go.set()
    if server_pid is not None:
        time.sleep(max(0.0, start.value - time.perf_counter()))
        cpu_at_start = cpu_seconds(server_pid)
    samples: list[float] = []
    errors: list[str] = []
    for _ in procs:
        got, failed = queue.get(timeout=duration * 2 + 120)  # a worker that died sends nothing
        samples += got
        errors += failed
    server_cpu = None if server_pid is None else cpu_seconds(server_pid) - cpu_at_start
    for p in procs:
        p.join()
    if errors or not samples:
        raise RuntimeError(f"{kind} with {clients} clients: no samples\n" + "".join(errors[:2]))
    return {
        "clients": clients,
        "p50_us": percentile(samples, 0.5) * 1e6,
        "p99_us": percentile(samples, 0.99) * 1e6,
        "ops_per_s": len(samples) / duration,
        "n": len(samples),
        "server_cpu_us": None if server_cpu is None else server_cpu / len(samples) * 1e6,
    }


def _build_layout(path: str, queue) -> None:
    from gms import GMSClientMemoryManager

    writer = GMSClientMemoryManager(path)
    writer.connect("RW")
    ids = [writer.allocate_handle(2 << 20, "weights")[0] for _ in range(4)]
    writer.metadata_put_many([(f"key.{i}", ids[i % 4], i, b"v" * 64) for i in range(100)])
    writer.commit()
    writer.close()
    queue.put(ids)


def setup_layout(path: str) -> list[str]:
    """Built in a child: a connected manager initialises CUDA (on the cuda
    backend), and the clients forked from this process later could not.
    The modules are imported here, so that forked clients start warm."""
    importlib.import_module("gms.client")  # modules only; no CUDA yet

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    builder = ctx.Process(target=_build_layout, args=(path, queue))
    builder.start()
    ids = queue.get(timeout=120)
    builder.join()
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--backend", default="host", choices=("host", "cuda"))
    parser.add_argument("--clients", default="1,16,64,256")
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--compare", metavar="TREE", help="another checkout to run before this one, turn about")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    counts = [1, 16] if args.quick else [int(c) for c in args.clients.split(",")]
    duration = 1.0 if args.quick else args.duration
    json_path = args.json or f"bench/results/rpc_{args.backend}.json"
    if args.compare:
        passed = ["--backend", args.backend, "--clients", ",".join(map(str, counts)), "--duration", str(duration)]
        compared = compare_trees(__file__, args.compare, args.runs, passed)
        for field, what in (("_p50_us", "p50"), ("_server_cpu_us", "the server's CPU per request")):
            names = [name for name in compared["median"]["after"] if name.endswith(field)]
            print_comparison(f"RPC {what} on the {args.backend} backend, {os.cpu_count()} cores of {cpu_name()} "
                             f"(µs, median of {args.runs} runs each)", compared, names)
        write_json(json_path, {"backend": args.backend, "cpu": cpu_name(), "cores": os.cpu_count(), **compared})
        return

    results: dict = {"backend": args.backend, "cpu": cpu_name(), "cores": os.cpu_count(),
                     "duration_s": duration, "closed": {}, "open": {}}
    with tempfile.TemporaryDirectory() as directory:
        gms_path, echo_path = os.path.join(directory, "gms.sock"), os.path.join(directory, "echo.sock")
        server = subprocess.Popen([sys.executable, "-m", "gms", "serve", "--backend", args.backend,
                                   "--socket", gms_path, "--log-level", "warning"])
        echo = subprocess.Popen([sys.executable, "-c", ECHO_SERVER, echo_path])
        try:
            wait_for(gms_path, server)
            wait_for(echo_path, echo)
            ids = setup_layout(gms_path)
            from gms import get_runtime_state

            # The process that answers: under its keeper, not the one started here.
            pids = {gms_path: get_runtime_state(gms_path).pid, echo_path: echo.pid}

            def load(kind: str, path: str, clients: int, seconds: float = duration, rate: float = 0.0) -> dict:
                return run_load(kind, path, ids, clients, seconds, rate, server_pid=pids[path])

            for kind, path in (("echo", echo_path), ("metadata_get", gms_path), ("export", gms_path),
                               ("handshake", gms_path)):
                results["closed"][kind] = [load(kind, path, n) for n in counts]
            for kind, path in (("echo", echo_path), ("metadata_get", gms_path)):
                results["open"][kind] = load(kind, path, 64, duration * 2, rate=100.0)
            os.environ["GMS_CLIENT_SPIN_US"] = "0"  # one client, no polling: the plain blocking path
            results["closed"]["metadata_get_no_spin"] = [load("metadata_get", gms_path, 1)]
            results["closed"]["echo_no_spin"] = [load("echo", echo_path, 1)]
            del os.environ["GMS_CLIENT_SPIN_US"]
            # Last: a writer's RW_CONNECT clears the committed layout the readers used.
            results["closed"]["allocate_free"] = [load("allocate_free", gms_path, 1)]
        finally:
            server.terminate()
            echo.terminate()
            server.wait(30)
            echo.wait(30)

    named = {f"{kind}_x{r['clients']}": r for kind, runs in results["closed"].items() for r in runs}
    named |= {f"{kind}_open_x{r['clients']}": r for kind, r in results["open"].items()}
    rows = [(name, r["clients"], f"{r['p50_us']:.0f}", f"{r['p99_us']:.0f}", f"{r['ops_per_s']:,.0f}",
             f"{r['server_cpu_us']:.1f}") for name, r in named.items()]
    print_table(f"RPC on the {args.backend} backend, {results['cores']} cores of {results['cpu']} "
                "(open: 100/s each)", rows,
                header=("operation", "clients", "p50 µs", "p99 µs", "ops/s", "server CPU µs/req"))
    if json_path == "-":  # for --compare: each p50 and the server's CPU per request, by name
        print(json.dumps({f"{name}_{field}": r[field] for name, r in named.items()
                          for field in ("p50_us", "server_cpu_us")}))
        return
    write_json(json_path, results)


if __name__ == "__main__":
    main()
