"""CUDA VMM: driver call latencies, and a reader importing a committed layout.

1. Per-call latency (median) of the server's create/export/release (no
   context) and the client's import/reserve/map/set-access/unmap, per size.
2. A committed layout of 1, 8 and 32 GiB in 2 MiB, 64 MiB and 1 GiB
   allocations, imported by a new reader process through gms (connect(RO),
   list, batched export, map every allocation).  Next to it, measured in the
   same run, the floor: a process that received the same fds from the server
   makes the driver calls alone (import, reserve, map, set-access) for each
   allocation.  gms maps a batch into one reservation and grants access once
   per contiguous run, so it can come in under that floor.

    python bench/vmm.py [--quick] [--json bench/results/vmm.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from _common import DRIVER_FLOOR, Server, cpu_name, print_table, run_json, write_json
from cuda.bindings import driver as cu

from gms.cuda import vmm

MiB, GiB = 1 << 20, 1 << 30
READER = r"""
import json, sys, time
from gms import GMSClientMemoryManager
from gms.cuda import vmm
vmm.VmmMapper(0)  # the CUDA context: an engine has one before it imports weights
mgr = GMSClientMemoryManager(sys.argv[1], device=0)  # process setup too (docs/client.md)
t0 = time.perf_counter()
mgr.connect("RO")
t1 = time.perf_counter()
ids = [h.allocation_id for h in mgr.list_handles()]
t2 = time.perf_counter()
vas = mgr.create_mappings(ids)
t3 = time.perf_counter()
print(json.dumps({"connect_s": t1 - t0, "list_s": t2 - t1, "map_s": t3 - t2, "n": len(vas)}))
"""


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def per_call(size: int, repeats: int) -> dict[str, float]:
    backend = vmm.VmmBackend(0)
    mapper = vmm.VmmMapper(0)
    samples: dict[str, list[float]] = {k: [] for k in (
        "cuMemCreate", "cuMemExportToShareableHandle", "dup", "cuMemImportFromShareableHandle",
        "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease(import)",
        "cuMemAddressFree", "cuMemRelease(server)", "close(imported fd)",
    )}
    access = mapper._access[True]
    for n in range(repeats):
        t, handle = timed(cu.cuMemCreate, size, backend._prop, 0)
        samples["cuMemCreate"].append(t)
        handle = handle[1]
        t, out = timed(cu.cuMemExportToShareableHandle, handle, vmm._POSIX_FD, 0)
        samples["cuMemExportToShareableHandle"].append(t)
        fd = int(out[1])
        t, dup = timed(os.dup, fd)
        samples["dup"].append(t)
        t, out = timed(cu.cuMemImportFromShareableHandle, dup, vmm._POSIX_FD)
        samples["cuMemImportFromShareableHandle"].append(t)
        imported = out[1]
        t, _ = timed(os.close, dup)
        samples["close(imported fd)"].append(t)
        t, out = timed(cu.cuMemAddressReserve, size, mapper.granularity, 0, 0)
        samples["cuMemAddressReserve"].append(t)
        va = out[1]
        t, _ = timed(cu.cuMemMap, va, size, 0, imported, 0)
        samples["cuMemMap"].append(t)
        t, _ = timed(cu.cuMemSetAccess, va, size, access, 1)
        samples["cuMemSetAccess"].append(t)
        t, _ = timed(cu.cuMemUnmap, va, size)
        samples["cuMemUnmap"].append(t)
        t, _ = timed(cu.cuMemRelease, imported)
        samples["cuMemRelease(import)"].append(t)
        t, _ = timed(cu.cuMemAddressFree, va, size)
        samples["cuMemAddressFree"].append(t)
        os.close(fd)
        t, _ = timed(cu.cuMemRelease, handle)
        samples["cuMemRelease(server)"].append(t)
    # The loop above creates on memory it has just released; the driver makes
    # the first export of such memory wait.  Here: many in a row, none released.
    handles, fresh = [], []
    for _ in range(min(repeats, 64 * GiB // size // 4)):
        start = time.perf_counter()
        handle = cu.cuMemCreate(size, backend._prop, 0)[1]
        fd = int(cu.cuMemExportToShareableHandle(handle, vmm._POSIX_FD, 0)[1])
        fresh.append(time.perf_counter() - start)
        handles.append((handle, fd))
    for handle, fd in handles:
        os.close(fd)
        cu.cuMemRelease(handle)
    samples["create + export, nothing released before"] = fresh
    return {k: statistics.median(v) * 1e6 for k, v in samples.items()}


def gms_import(count: int, size: int, tmp: str) -> dict:
    """A real server holds the committed layout; new processes import it."""
    from gms import GMSClientMemoryManager

    with Server(tmp, name=f"bench-{count}-{size}") as server:
        writer = GMSClientMemoryManager(server.socket)
        writer.connect("RW")
        for _ in range(count):
            writer.allocate_handle(size, "weights")
        writer.commit()
        writer.close()
        runs = [run_json(READER, server.socket) for _ in range(3)]
        best = min(runs, key=lambda r: r["map_s"] + r["connect_s"] + r["list_s"])
        best["runs"] = runs
        best["floor_s"] = min(run_json(DRIVER_FLOOR, server.socket)["floor_s"] for _ in range(3))
        return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default="bench/results/vmm.json")
    args = parser.parse_args()
    repeats = 20 if args.quick else 100

    calls = {label: per_call(size, repeats) for label, size in (("2 MiB", 2 * MiB), ("64 MiB", 64 * MiB), ("1 GiB", GiB))}
    names = list(next(iter(calls.values())))
    print_table(
        "driver calls, median µs",
        [(name, *(f"{calls[s][name]:.1f}" for s in calls)) for name in names],
        header=("call", *calls),
    )

    totals = (1, 8) if args.quick else (1, 8, 32)
    layouts = []
    with tempfile.TemporaryDirectory() as tmp:
        for total in totals:
            for size_label, size in (("2 MiB", 2 * MiB), ("64 MiB", 64 * MiB), ("1 GiB", GiB)):
                count = total * GiB // size
                if count > 4096:
                    continue  # 32 GiB of 2 MiB: minutes of server-side creation for one more row
                got = gms_import(count, size, tmp)
                floor_s = got["floor_s"]
                path_s = got["list_s"] + got["map_s"]
                layouts.append({
                    "total_gib": total, "allocation": size_label, "count": count,
                    "floor_ms": floor_s * 1e3, "gms_connect_ms": got["connect_s"] * 1e3,
                    "gms_list_ms": got["list_s"] * 1e3, "gms_map_ms": got["map_s"] * 1e3,
                    "gms_import_ms": (got["connect_s"] + path_s) * 1e3,
                    "ratio_mapping_path_to_floor": path_s / floor_s,
                    "gib_per_s": total / (got["connect_s"] + path_s),
                })
    print_table(
        "reader import of a committed layout (new process, connect(RO) to all mapped)",
        [(f"{r['total_gib']} GiB", r["allocation"], r["count"], f"{r['floor_ms']:.1f}",
          f"{r['gms_connect_ms']:.2f}", f"{r['gms_list_ms'] + r['gms_map_ms']:.1f}",
          f"{r['gms_import_ms']:.1f}", f"{r['ratio_mapping_path_to_floor']:.2f}x",
          f"{r['gib_per_s']:,.0f}") for r in layouts],
        header=("layout", "alloc", "n", "floor ms", "connect ms", "list+map ms", "total ms",
                "map path / floor", "GiB/s"),
    )
    gpu = vmm.VmmBackend(0)
    write_json(args.json, {
        "gpu": gpu.device_name, "gpu_uuid": gpu.uuid, "cpu": cpu_name(),
        "driver_calls_us": calls, "layouts": layouts,
    })


if __name__ == "__main__":
    main()
