"""The cyclic collector's pauses in a server whose log grows: without and with gms.cyclegc.

The service core on host memory, in process (as ``bench/core_ops.py``
drives it), records RO handshakes (four events each) until the log holds
``--handshakes`` × 4 events; every collection is timed by a ``gc`` callback.
Each policy runs in a fresh process (the policy is the process's), the two
interleaved.  Per policy: the full (generation-2) collections, their share
of the run, the longest, and the handshakes' p50 / p99 / max.

    python bench/gc_pauses.py [--handshakes 100000] [--rounds 2] [--json PATH] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import cpu_name, percentile, print_table, write_json  # noqa: E402

POLICIES = ("collector as is", "gms.cyclegc")


def measure(policy: str, handshakes: int) -> dict:
    import gc

    import trio

    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
    started = [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses[info["generation"]].append(time.perf_counter() - started[0])

    async def run() -> dict:
        from gms.cuda.host import HostBackend
        from gms.peer import Peer
        from gms.server.service import core as core_module
        from gms.wire import messages as m

        peer = Peer(os.getpid(), os.getuid(), os.getgid())
        core = await core_module.open_core(HostBackend())

        def session(lock: str) -> int:
            conn = core.new_conn()
            core.handshake(conn, m.HandshakeRequest(lock, None, "weights"), peer, lambda grant: None)
            return conn

        writer = session("RW")
        await core.placement.allocate(writer, 2 << 20, "weights")
        core.requests.handle(writer, m.CommitRequest(None))
        core.disconnect(writer)
        if policy == "gms.cyclegc":
            from gms.cyclegc import install

            install()  # as `gms serve` does
        gc.callbacks.append(timed)
        samples = []
        t0 = time.perf_counter()
        for _ in range(handshakes):
            t = time.perf_counter_ns()
            core.disconnect(session("RO"))
            samples.append((time.perf_counter_ns() - t) / 1e3)
        elapsed = time.perf_counter() - t0
        gc.callbacks.remove(timed)
        full = pauses[2]
        return {
            "handshake_p50_us": percentile(samples, 0.5), "handshake_p99_us": percentile(samples, 0.99),
            "handshake_max_us": max(samples), "full_collections": len(full),
            "full_share_pct": 100 * sum(full) / elapsed, "longest_full_ms": 1e3 * max(full, default=0.0),
            "young_share_pct": 100 * (sum(pauses[0]) + sum(pauses[1])) / elapsed,
            "events_in_log": core.log.state.tick,
        }

    return trio.run(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--handshakes", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default="bench/results/gc_pauses.json")
    parser.add_argument("--quick", action="store_true", help="20,000 handshakes, one round")
    parser.add_argument("--one", choices=POLICIES, help=argparse.SUPPRESS)  # a child: one policy, JSON out
    args = parser.parse_args()
    if args.quick:
        args.handshakes, args.rounds = 20_000, 1
    if args.one:
        print(json.dumps(measure(args.one, args.handshakes)))
        return
    runs: dict[str, list[dict]] = {policy: [] for policy in POLICIES}
    for _ in range(args.rounds):
        for policy in POLICIES:
            out = subprocess.run([sys.executable, __file__, "--one", policy, "--handshakes", str(args.handshakes)],
                                 check=True, capture_output=True, text=True).stdout
            runs[policy].append(json.loads(out.splitlines()[-1]))
    medians = {policy: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for policy, rs in runs.items()}
    print_table(
        f"{args.handshakes} RO handshakes in process ({4 * args.handshakes} events logged), medians of "
        f"{args.rounds} runs, {cpu_name()}",
        [(policy, f"{r['full_collections']:.0f}", f"{r['full_share_pct']:.1f}%", f"{r['longest_full_ms']:.1f}",
          f"{r['handshake_p50_us']:.1f}", f"{r['handshake_p99_us']:.1f}", f"{r['handshake_max_us'] / 1e3:.1f}")
         for policy, r in medians.items()],
        header=("policy", "full collections", "their share", "longest ms", "p50 µs", "p99 µs", "max ms"),
    )
    write_json(args.json, {"cpu": cpu_name(), "cores": os.cpu_count(), "handshakes": args.handshakes,
                           "rounds": args.rounds, "medians": medians, "runs": runs})


if __name__ == "__main__":
    main()
