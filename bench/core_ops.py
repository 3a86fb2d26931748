"""The service core's own cost per request, in process: no socket, no client.

The core on host memory, driven the way the Trio shell drives it, one
request type at a time (best of 5 loops):

* handshake + close   handshake (RO, granted at once), disconnect
* metadata get        on a committed layout, as a reader
* export              one fd (closed again)
* allocate + free     2 MiB, as a writer (the memory is made on the GPU lane's
                      thread since the core's memory effects left the event loop)

What ``bench/rpc.py`` measures over a socket is this plus the transport
and the client; this part is the decide / append / fold work of each
request, so a change to the core shows here first.

    python bench/core_ops.py [--loops 3000]
    # before/after in one run, interleaved (the tree of another commit, same host):
    git worktree add /tmp/gms-before <commit>
    python bench/core_ops.py --compare /tmp/gms-before --runs 3 --json docs/results/core_ops_2core.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import compare_trees, cpu_name, print_comparison, print_table, write_json  # noqa: E402

KINDS = ("handshake_close_us", "metadata_get_us", "export_us", "allocate_free_us")


def best_us(fn, loops: int, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(loops):
            fn()
        best = min(best, (time.perf_counter() - t0) / loops)
    return best * 1e6


async def best_us_async(fn, loops: int, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(loops):
            await fn()
        best = min(best, (time.perf_counter() - t0) / loops)
    return best * 1e6


def measure(loops: int) -> dict:
    import trio

    return trio.run(_measure, loops)


async def _measure(loops: int) -> dict:
    from gms.cuda.host import HostBackend
    from gms.server.service import core as core_module
    from gms.peer import Peer
    from gms.wire import messages as m

    peer = Peer(os.getpid(), os.getuid(), os.getgid())
    if hasattr(core_module, "open_core"):  # the core with lanes (memory effects off the loop)
        core = await core_module.open_core(HostBackend())
        handle = core.requests.handle

        async def allocate(conn: int, size: int, tag: str):
            return await core.placement.allocate(conn, size, tag)
    else:  # the synchronous core before it, for comparisons
        core = core_module.ServiceCore(HostBackend(), None)
        handle = core.handle

        async def allocate(conn: int, size: int, tag: str):
            return core.allocate(conn, size, tag)

    def session(lock: str, layout: str = "weights") -> int:
        conn = core.new_conn()
        request = m.HandshakeRequest(lock, None, layout)
        if hasattr(core, "handshake"):  # the shell's one call (the session and its grant in one batch)
            core.handshake(conn, request, peer, lambda grant: None)
        else:  # the two halves before it
            core.request_lock(conn, core.open_session(conn, request, peer), lambda grant: None)
        return conn

    writer = session("RW")
    ids = [(await allocate(writer, 2 << 20, "weights")).allocation_id for _ in range(4)]
    handle(writer, m.MetadataPutManyRequest(
        [m.MetadataEntryInfo(f"key.{i}", ids[i % 4], i, b"v" * 64) for i in range(100)]))
    handle(writer, m.CommitRequest(None))
    core.disconnect(writer)
    reader = session("RO")

    def handshake() -> None:
        core.disconnect(session("RO"))

    def get() -> None:
        handle(reader, m.MetadataGetRequest("key.42"))

    def export() -> None:
        os.close(handle(reader, m.ExportAllocationRequest(ids[0])).fds[0])

    out = {"handshake_close_us": best_us(handshake, loops), "metadata_get_us": best_us(get, loops),
           "export_us": best_us(export, loops)}
    core.disconnect(reader)
    kv = session("RW", "kv_cache")

    async def allocate_free() -> None:
        allocated = await allocate(kv, 2 << 20, "kv_cache")
        handle(kv, m.FreeAllocationRequest(allocated.allocation_id))

    out["allocate_free_us"] = await best_us_async(allocate_free, max(1, loops // 3))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--loops", type=int, default=3000)
    parser.add_argument("--compare", metavar="TREE", help="another checkout to run before this one, interleaved")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", default="bench/results/core_ops.json")
    args = parser.parse_args()
    loops = 300 if args.quick else args.loops
    if args.compare:
        compared = compare_trees(__file__, args.compare, args.runs, ["--loops", str(loops)])
        results = {"cpu": cpu_name(), "cores": os.cpu_count(), "loops": loops, **compared}
        print_comparison("the service core, in process, per request (µs, median of runs of best-of-5 loops)",
                         compared, list(KINDS))
        write_json(args.json, results)
        return
    results = {"cpu": cpu_name(), "cores": os.cpu_count(), **measure(loops)}
    if args.json == "-":
        print(json.dumps(results))
        return
    print_table("the service core, in process, per request (µs, best of 5 loops)",
                [(k.removesuffix("_us").replace("_", " "), f"{v:.1f}") for k, v in results.items() if k.endswith("_us")])
    write_json(args.json, results)


if __name__ == "__main__":
    main()
