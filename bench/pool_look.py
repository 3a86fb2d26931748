"""What one look of the self-sizing host pool costs the event loop, as a build grows.

The service core on host memory, in process: a writer builds a layout of N
small allocations; per N, medians of 5 rounds: the longest of a build's looks
(``PoolSizing.target``, a slice of the count each) against a count of the
whole build at once (what each look did before the count was sliced), each
on a layout just grown (the count's memory as cold as a server's), with
the garbage collector off while timed.

    python bench/pool_look.py [--sizes 1000,3000,6000] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import cpu_name, print_table, write_json  # noqa: E402

CHUNK = 64 << 20
ROUNDS = 5  # this VM stalls now and then for milliseconds: medians of rounds


async def measure(sizes: list[int]) -> list[dict]:
    from gms.cuda.host import HostBackend
    from gms.peer import Peer
    from gms.server.service.core import open_core
    from gms.server.tiers.pool_sizing import PoolSizing, whole_chunks
    from gms.wire import messages as m

    core = await open_core(HostBackend())
    conn = core.new_conn()
    core.handshake(conn, m.HandshakeRequest("RW", None, "model"), Peer(os.getpid(), os.getuid(), os.getgid()),
                   lambda grant: None)
    rows = []
    for size in sizes:
        while len(core.log.state.layouts["model"].allocations) < size:
            await core.placement.allocate(conn, 4096, "weights")
        wholes, longests = [], []
        gc.disable()  # a collection's pause is not a look's cost (gms.cyclegc bounds those)
        for _ in range(ROUNDS):
            await core.placement.allocate(conn, 4096, "weights")  # grown: counted again, cold
            started = time.perf_counter()
            whole_chunks(core.log.state.layouts["model"].allocations.values(), CHUNK)
            wholes.append(time.perf_counter() - started)
            await core.placement.allocate(conn, 4096, "weights")
            sizing, longest = PoolSizing(lambda: core.log.state, cap_bytes=1 << 40), 0.0
            for _ in range(size // 256 + 2):
                started = time.perf_counter()
                sizing.target(CHUNK)
                longest = max(longest, time.perf_counter() - started)
            longests.append(longest)
        gc.enable()
        whole, longest = statistics.median(wholes), statistics.median(longests)
        rows.append({"allocations": size, "whole_count_ms": 1e3 * whole, "longest_look_ms": 1e3 * longest})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,3000,6000")
    parser.add_argument("--json", default="bench/results/pool_look.json")
    parser.add_argument("--quick", action="store_true", help="1,000 allocations only")
    args = parser.parse_args()
    import trio

    rows = trio.run(measure, [1000] if args.quick else [int(n) for n in args.sizes.split(",")])
    print_table(f"one look of the host pool's sizing, {cpu_name()}",
                [(r["allocations"], f"{r['whole_count_ms']:.2f}", f"{r['longest_look_ms']:.2f}") for r in rows],
                header=("allocations building", "the whole count (ms)", "the longest look now (ms)"))
    write_json(args.json, {"cpu": cpu_name(), "cores": os.cpu_count(), "rows": rows})


if __name__ == "__main__":
    main()
