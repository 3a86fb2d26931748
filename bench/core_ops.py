"""The service core's own cost per request, in process: no socket, no client.

``gms.server.core.ServiceCore`` on host memory, driven the way the Trio
shell drives it, one request type at a time (best of 5 loops):

* handshake + close   open_session, request_lock (RO, granted at once), disconnect
* metadata get        on a committed layout, as a reader
* export              one fd (closed again)
* allocate + free     2 MiB, as a writer

What ``bench/rpc.py`` measures over a socket is this plus the transport
and the client; this part is the decide / append / fold work of each
request, so a change to the core shows here first.

    python bench/core_ops.py [--loops 3000]
    # the same against the single-layout core, for the comparison in docs/performance.md:
    git worktree add /tmp/gms-before 01b4875
    (cd /tmp/gms-before && PYTHONPATH=. python /path/to/this/bench/core_ops.py --json /tmp/before.json)
"""

from __future__ import annotations

import argparse
import os
import time

from _common import cpu_name, print_table, write_json


def best_us(fn, loops: int, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(loops):
            fn()
        best = min(best, (time.perf_counter() - t0) / loops)
    return best * 1e6


def measure(loops: int) -> dict:
    from gms.cuda.host import HostBackend
    from gms.server.core import ServiceCore
    from gms.wire import messages as m

    try:
        from gms.server.peer import Peer
    except ImportError:  # the single-layout core had no peers
        def Peer(*ids):  # stands in for the class
            return ids

    peer = Peer(os.getpid(), os.getuid(), os.getgid())
    if hasattr(ServiceCore, "open_session"):
        core = ServiceCore(HostBackend(), None)

        def session(lock: str, layout: str = "weights") -> int:
            conn = core.new_conn()
            requested = core.open_session(conn, m.HandshakeRequest(lock, None, layout), peer)
            core.request_lock(conn, requested, lambda grant: None)
            return conn

        commit = m.CommitRequest(None)
    else:  # the single-layout core before 1f087a3 (one core per layout), for comparisons
        from gms.fsm import RequestedLockType

        cores = {}

        def session(lock: str, layout: str = "weights") -> int:
            nonlocal core
            if layout not in cores:
                cores[layout] = ServiceCore(HostBackend(), tag=layout)
            core = cores[layout]
            conn = core.new_conn()
            core.request_lock(conn, RequestedLockType(lock), lambda grant: None)
            return conn

        core = None
        commit = m.CommitRequest()

    writer = session("RW")
    ids = [core.allocate(writer, 2 << 20, "weights").allocation_id for _ in range(4)]
    core.handle(writer, m.MetadataPutManyRequest(
        [m.MetadataEntryInfo(f"key.{i}", ids[i % 4], i, b"v" * 64) for i in range(100)]))
    core.handle(writer, commit)
    core.disconnect(writer)
    reader = session("RO")

    def handshake() -> None:
        core.disconnect(session("RO"))

    def get() -> None:
        core.handle(reader, m.MetadataGetRequest("key.42"))

    def export() -> None:
        os.close(core.handle(reader, m.ExportAllocationRequest(ids[0])).fds[0])

    out = {"handshake_close_us": best_us(handshake, loops), "metadata_get_us": best_us(get, loops),
           "export_us": best_us(export, loops)}
    core.disconnect(reader)
    kv = session("RW", "kv_cache")

    def allocate_free() -> None:
        allocated = core.allocate(kv, 2 << 20, "kv_cache")
        core.handle(kv, m.FreeAllocationRequest(allocated.allocation_id))

    out["allocate_free_us"] = best_us(allocate_free, max(1, loops // 3))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--loops", type=int, default=3000)
    parser.add_argument("--json", default="bench/results/core_ops.json")
    args = parser.parse_args()
    results = {"cpu": cpu_name(), "cores": os.cpu_count(), **measure(300 if args.quick else args.loops)}
    print_table("the service core, in process, per request (µs, best of 5 loops)",
                [(k.removesuffix("_us").replace("_", " "), f"{v:.1f}") for k, v in results.items() if k.endswith("_us")])
    write_json(args.json, results)


if __name__ == "__main__":
    main()
