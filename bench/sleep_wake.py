"""Sleep and wake: release GPU memory and take it back, pointers intact.

For 8 and 32 GiB in 1 GiB allocations, one process (as an engine would):

* weights   sleep = unmap_all_vas + abort;  wake = connect(RO) + remap_all_vas
* KV cache  sleep = unmap_all_vas + abort;  wake = connect(RW) +
            reallocate_all_handles + remap_all_vas (fresh memory)
* offload   what vLLM's level-1 sleep does: copy to pinned host memory and
            free the GPU copy; wake = allocate and copy back (pinned buffer made
            once, outside the timing)
* floor     the driver calls alone: unmap + release to sleep; import, reserve,
            map, set-access to wake, for the same allocations; for the KV
            cache also create + export (fresh memory) before those

    python bench/sleep_wake.py [--quick] [--sizes 8,32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from _common import Server, add_out, cpu_name, print_table, write_results

GiB = 1 << 30


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def weights(path: str, gib: int, repeats: int) -> dict:
    from gms import GMSClientMemoryManager

    writer = GMSClientMemoryManager(path)
    writer.connect("RW")
    for _ in range(gib):
        writer.allocate_handle(GiB, "weights")
    writer.commit()
    writer.close()
    mgr = GMSClientMemoryManager(path)
    mgr.connect("RO")
    mgr.create_mappings([h.allocation_id for h in mgr.list_handles()])
    sleeps, wakes = [], []
    for _ in range(repeats):
        sleeps.append(timed(lambda: (mgr.unmap_all_vas(), mgr.abort())))
        wakes.append(timed(lambda: (mgr.connect("RO"), mgr.remap_all_vas())))
    floor = driver_floor(mgr)
    mgr.close()
    return {"sleep_s": statistics.median(sleeps), "wake_s": statistics.median(wakes), **floor}


def kv_cache(path: str, gib: int, repeats: int) -> dict:
    """Sleep counts until the server has given the memory back to the driver
    (what another process needs); wake starts right after, on memory the
    driver has just taken back, as a wake after the primary exits does."""
    from gms import GMSClientMemoryManager, get_runtime_state

    mgr = GMSClientMemoryManager(path, layout="kv_cache")
    mgr.connect("RW")
    for _ in range(gib):
        mgr.create_mapping(size=GiB, tag="kv_cache")
    sleeps, freed, wakes = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        mgr.unmap_all_vas()
        mgr.abort()
        sleeps.append(time.perf_counter() - start)
        while get_runtime_state(path).server_handle_count:
            pass
        freed.append(time.perf_counter() - start)
        wakes.append(timed(lambda: (mgr.connect("RW"), mgr.reallocate_all_handles("kv_cache"), mgr.remap_all_vas())))
    mgr.close()
    return {"sleep_s": statistics.median(sleeps), "freed_s": statistics.median(freed),
            "wake_s": statistics.median(wakes), **fresh_floor(gib, repeats)}


def fresh_floor(gib: int, repeats: int) -> dict:
    """The driver calls of a KV wake alone, in this process: create and export
    (the server's part), import, reserve, map, set-access, for ``gib`` 1 GiB
    allocations, each time right after releasing as many."""
    from cuda.bindings import driver as cu

    from gms.cuda import vmm

    mapper = vmm.VmmMapper(0)
    prop = vmm._allocation_prop(0)
    access = mapper._access[True]

    def create_all() -> list:
        handles = [cu.cuMemCreate(GiB, prop, 0)[1] for _ in range(gib)]
        return [(h, cu.cuMemExportToShareableHandle(h, vmm._POSIX_FD, 0)[1]) for h in handles]

    def release_all(created: list, mapped: list = ()) -> None:
        for va, handle in mapped:
            cu.cuMemUnmap(va, GiB)
            cu.cuMemRelease(handle)
            cu.cuMemAddressFree(va, GiB)
        for handle, fd in created:
            os.close(fd)
            cu.cuMemRelease(handle)

    wakes = []
    created = create_all()
    for _ in range(repeats):
        release_all(created)
        start = time.perf_counter()
        created = create_all()
        mapped = []
        for _, fd in created:
            handle = cu.cuMemImportFromShareableHandle(fd, vmm._POSIX_FD)[1]
            va = cu.cuMemAddressReserve(GiB, mapper.granularity, 0, 0)[1]
            cu.cuMemMap(va, GiB, 0, handle, 0)
            cu.cuMemSetAccess(va, GiB, access, 1)
            mapped.append((va, handle))
        wakes.append(time.perf_counter() - start)
        release_all([], mapped)
    release_all(created)
    return {"floor_wake_s": statistics.median(wakes)}


def driver_floor(mgr) -> dict:
    """Driver calls alone on fds from the same server: wake (import, reserve,
    map, set-access per allocation) and sleep (unmap, release)."""
    from cuda.bindings import driver as cu

    from gms.cuda import vmm

    mapper = mgr._mapper
    exported = mgr.export_handles([h.allocation_id for h in mgr.list_handles()])
    access = mapper._access[False]
    start = time.perf_counter()
    mapped = []
    for info, fd in exported:
        _, handle = cu.cuMemImportFromShareableHandle(fd, vmm._POSIX_FD)
        _, va = cu.cuMemAddressReserve(info.aligned_size, mapper.granularity, 0, 0)
        cu.cuMemMap(va, info.aligned_size, 0, handle, 0)
        cu.cuMemSetAccess(va, info.aligned_size, access, 1)
        mapped.append((va, info.aligned_size, handle))
    wake = time.perf_counter() - start
    start = time.perf_counter()
    for va, size, handle in mapped:
        cu.cuMemUnmap(va, size)
        cu.cuMemRelease(handle)
    sleep = time.perf_counter() - start
    for (va, size, _), (_, fd) in zip(mapped, exported):
        cu.cuMemAddressFree(va, size)
        os.close(fd)
    return {"floor_wake_s": wake, "floor_sleep_s": sleep}


def offload(gib: int, repeats: int) -> dict:
    import torch

    host = torch.empty(gib * GiB, dtype=torch.uint8, pin_memory=True)
    gpu = torch.randint(0, 255, (gib * GiB,), dtype=torch.uint8, device="cuda")
    sleeps, wakes = [], []
    for _ in range(repeats):
        def sleep():
            nonlocal gpu
            host.copy_(gpu, non_blocking=True)
            torch.cuda.synchronize()
            gpu = None
            torch.cuda.empty_cache()

        def wake():
            nonlocal gpu
            gpu = torch.empty(gib * GiB, dtype=torch.uint8, device="cuda")
            gpu.copy_(host, non_blocking=True)
            torch.cuda.synchronize()

        sleeps.append(timed(sleep))
        wakes.append(timed(wake))
    gpu = host = None
    torch.cuda.empty_cache()
    return {"sleep_s": statistics.median(sleeps), "wake_s": statistics.median(wakes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 GiB, two repeats")
    parser.add_argument("--sizes", default="8,32")
    parser.add_argument("--repeats", type=int, default=5)
    add_out(parser)
    args = parser.parse_args()
    sizes = [1] if args.quick else [int(s) for s in args.sizes.split(",")]
    repeats = 2 if args.quick else args.repeats

    import torch

    torch.empty(1, device="cuda")
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for gib in sizes:
            with Server(directory, name=f"w{gib}") as server:
                w = weights(server.socket, gib, repeats)
            with Server(directory, name=f"kv{gib}") as server:
                k = kv_cache(server.socket, gib, repeats)
            o = offload(gib, max(2, repeats // 2))
            rows.append({"gib": gib, "weights": w, "kv_cache": k, "offload": o,
                         "x_weights_wake_vs_offload": o["wake_s"] / w["wake_s"],
                         "x_kv_wake_vs_offload": o["wake_s"] / k["wake_s"]})
    print_table(
        "sleep / wake (median), 1 GiB allocations",
        [(f"{r['gib']} GiB", f"{r['weights']['sleep_s'] * 1e3:.2f}", f"{r['weights']['wake_s'] * 1e3:.2f}",
          f"{r['weights']['floor_sleep_s'] * 1e3:.2f}", f"{r['weights']['floor_wake_s'] * 1e3:.2f}",
          f"{r['kv_cache']['sleep_s'] * 1e3:.2f}", f"{r['kv_cache']['freed_s'] * 1e3:.2f}",
          f"{r['kv_cache']['wake_s'] * 1e3:.2f}", f"{r['kv_cache']['floor_wake_s'] * 1e3:.2f}",
          f"{r['offload']['sleep_s'] * 1e3:.0f}", f"{r['offload']['wake_s'] * 1e3:.0f}",
          f"{r['x_weights_wake_vs_offload']:,.0f}x", f"{r['x_kv_wake_vs_offload']:,.0f}x")
         for r in rows],
        header=("size", "w sleep ms", "w wake ms", "w floor sleep", "w floor wake", "kv sleep ms", "kv freed ms",
                "kv wake ms", "kv floor wake", "offload sleep ms", "offload wake ms", "w wake vs offload",
                "kv wake vs offload"),
    )
    write_results(args.out, "sleep_wake", {"gpu": torch.cuda.get_device_name(0), "cpu": cpu_name(), "rows": rows})


if __name__ == "__main__":
    main()
