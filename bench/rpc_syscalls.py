"""The server's system calls and CPU per request under load, for one or more trees, turn about.

``bench/rpc.py`` says how long a request takes; this says what the server did
for it: ``perf stat`` on the serving process (its tracepoints for the calls a
request makes, and its task-clock) while ``bench/rpc.py``'s ``run_load`` drives
one scenario on a fresh server.  Reads per request above 1 are reads that found
nothing (each followed by an ``epoll_ctl`` and a wait); that is how a server
that reads too early shows itself (docs/performance.md, section 10).

    python bench/rpc_syscalls.py --trees /tmp/gms-before,. --op export --clients 16 --rounds 5
    python bench/rpc_syscalls.py --op metadata_get --clients 64 --rate 100      # open loop

Needs ``perf`` with tracepoints (``perf stat -e syscalls:sys_enter_recvfrom``
works as this user).  Each tree runs its own server and clients (PYTHONPATH);
the harness is this tree's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import cpu_name, print_table, tree_env, write_json  # noqa: E402

CALLS = ("recvfrom", "sendto", "sendmsg", "epoll_ctl", "epoll_wait", "close")
# Only these tracepoints: one on every system call (raw_syscalls) slows each enough to change
# what it measures (a server slower to read finds the next request there more often).
EVENTS = ["task-clock", *(f"syscalls:sys_enter_{c}" for c in CALLS)]

ONE_RUN = r"""
import json, os, signal, subprocess, sys, tempfile, time
sys.path.insert(0, sys.argv[1])
import rpc
from gms import get_runtime_state
op, clients, rate, events = sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
with tempfile.TemporaryDirectory() as folder:
    path, out = os.path.join(folder, "gms.sock"), os.path.join(folder, "perf")
    server = subprocess.Popen([sys.executable, "-m", "gms", "serve", "--backend", "host", "--socket", path,
                               "--log-level", "error"], start_new_session=True)
    try:
        rpc.wait_for(path, server)
        ids = rpc.setup_layout(path)
        perf = subprocess.Popen(["perf", "stat", "-x", ",", "-o", out, "-e", events,
                                 "-p", str(get_runtime_state(path).pid)])
        time.sleep(0.3)
        result = rpc.run_load(op, path, ids, clients, 2.0, rate=rate)
        perf.send_signal(signal.SIGINT)
        perf.wait()
        counts = {}
        for line in open(out):
            fields = line.strip().split(",")
            if len(fields) > 3 and fields[0][:1].isdigit():
                counts[fields[2]] = float(fields[0])
        # perf counts from before the warm-up: each client's 50 warm-up calls are requests too
        requests = clients * 50 + result["n"]
        print(json.dumps({"p50_us": result["p50_us"], "ops_per_s": result["ops_per_s"],
                          **{name: value / requests for name, value in counts.items()}}))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
"""


def one_run(tree: str, op: str, clients: int, rate: float) -> dict:
    out = subprocess.run([sys.executable, "-c", ONE_RUN, str(HERE), op, str(clients), str(rate), ",".join(EVENTS)],
                         env=tree_env(tree), cwd=tree, capture_output=True, text=True, check=True)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    named = {"p50_us": row["p50_us"], "ops_per_s": row["ops_per_s"],
             "server_cpu_us": row.get("task-clock", 0.0) * 1e3}  # perf's task-clock is in ms
    named |= {call: row.get(f"syscalls:sys_enter_{call}", 0.0) for call in CALLS}
    return named


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", default=".", help="checkouts, comma-separated (each its own server and client)")
    parser.add_argument("--op", default="export", choices=("metadata_get", "export", "handshake"))
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rate", type=float, default=0.0, help="requests/s per client (open loop); 0: closed")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default="bench/results/rpc_syscalls.json")
    args = parser.parse_args()
    trees = [str(Path(t).resolve()) for t in args.trees.split(",")]
    runs: dict[str, list[dict]] = {tree: [] for tree in trees}
    for _ in range(args.rounds):
        for tree in trees:
            runs[tree].append(one_run(tree, args.op, args.clients, args.rate))
            time.sleep(1.0)
    columns = ("ops_per_s", "p50_us", "server_cpu_us", *CALLS)
    rows = [(Path(tree).name, i + 1, *(f"{run[c]:,.0f}" if c == "ops_per_s" else f"{run[c]:.2f}" for c in columns))
            for tree in trees for i, run in enumerate(runs[tree])]
    loop = f"open loop, {args.rate:g}/s each" if args.rate else "closed loop"
    print_table(f"{args.op}, {args.clients} clients ({loop}), per request, {os.cpu_count()} cores of {cpu_name()}",
                rows, header=("tree", "round", "ops/s", "p50 µs", "server CPU µs", *CALLS))
    write_json(args.json, {"cpu": cpu_name(), "cores": os.cpu_count(), "op": args.op, "clients": args.clients,
                           "rate": args.rate, "runs": runs})


if __name__ == "__main__":
    main()
