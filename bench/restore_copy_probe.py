"""Probe: where a restore's time goes, host tier (VMM host memory) -> GPU, phase by phase.

A restore (``gms/client/tiering.py``) imports and maps every allocation's
GPU memory and its host copy, then copies.  This probe times each part on
1 GiB allocations, made with the server backend's own allocation
properties (``cuMemCreate`` on the GPU and on its host NUMA node, exported
as fds), in one process:

* map      import + map + set-access, device memory and host memory, per GiB
* copy     host copy -> GPU, already mapped: one stream, one copy per GiB;
           split over 2 and 4 streams; one stream while the next GiB's GPU
           memory is mapped, and while the next GiB's host copy is mapped
           (as a restore overlaps them)
* floor    torch pinned host memory -> GPU, the same bytes (best of 3)

    python bench/restore_copy_probe.py [--gib 4]   # -> restore_copy_probe.json ($GMS_BENCH_OUT)
"""

from __future__ import annotations

import argparse
import os
import time

from _common import write_json
from cuda.bindings import driver as cu

from gms.cuda import vmm

GiB = 1 << 30
POSIX = vmm._POSIX_FD


def ck(out):
    err, *rest = out if isinstance(out, tuple) else (out,)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(cu.cuGetErrorName(err)[1])
    return rest[0] if len(rest) == 1 else rest


def access() -> list:
    d = cu.CUmemAccessDesc()
    d.location = vmm._location(0, host=False)
    d.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return [d]


def make_fds(host: bool, n: int) -> list[int]:
    """As the server does: create, export, release (the fd keeps the memory)."""
    fds = []
    for _ in range(n):
        h = ck(cu.cuMemCreate(GiB, vmm._allocation_prop(0, host), 0))  # as the server's backend
        fds.append(int(ck(cu.cuMemExportToShareableHandle(h, POSIX, 0))))
        ck(cu.cuMemRelease(h))
    return fds


def map_fd(fd: int, va: int) -> tuple[object, dict]:
    t0 = time.perf_counter()
    h = ck(cu.cuMemImportFromShareableHandle(os.dup(fd), POSIX))
    t1 = time.perf_counter()
    ck(cu.cuMemMap(va, GiB, 0, h, 0))
    t2 = time.perf_counter()
    ck(cu.cuMemSetAccess(va, GiB, access(), 1))
    t3 = time.perf_counter()
    return h, {"import_ms": (t1 - t0) * 1e3, "map_ms": (t2 - t1) * 1e3, "set_access_ms": (t3 - t2) * 1e3}


def unmap(va: int, h) -> None:
    ck(cu.cuMemUnmap(va, GiB))
    ck(cu.cuMemRelease(h))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=int, default=4)
    args = parser.parse_args()
    n = args.gib
    import torch

    torch.zeros(1, device="cuda")
    ck(cu.cuInit(0))
    ctx = ck(cu.cuDevicePrimaryCtxRetain(ck(cu.cuDeviceGet(0))))
    ck(cu.cuCtxSetCurrent(ctx))
    streams = [ck(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)) for _ in range(4)]
    host_fds, dev_fds = make_fds(True, n), make_fds(False, n)
    hbase = int(ck(cu.cuMemAddressReserve(n * GiB, 0, 0, 0)))
    dbase = int(ck(cu.cuMemAddressReserve(n * GiB, 0, 0, 0)))
    res: dict = {"gpu": torch.cuda.get_device_name(), "gib": n}

    # map: each GiB mapped and unmapped again, best of 3
    for kind, fds, base in (("host", host_fds, hbase), ("device", dev_fds, dbase)):
        best: dict = {}
        for _ in range(3):
            for i, fd in enumerate(fds):
                h, t = map_fd(fd, base + i * GiB)
                unmap(base + i * GiB, h)
                best = {k: min(v, best.get(k, v)) for k, v in t.items()}
        res[f"map_{kind}_per_gib"] = best

    def timed(fn) -> float:
        best = float("inf")
        for _ in range(3):
            ck(cu.cuCtxSynchronize())
            t0 = time.perf_counter()
            fn()
            ck(cu.cuCtxSynchronize())
            best = min(best, time.perf_counter() - t0)
        return n / best  # GiB/s

    handles = [map_fd(fd, hbase + i * GiB)[0] for i, fd in enumerate(host_fds)]
    handles += [map_fd(fd, dbase + i * GiB)[0] for i, fd in enumerate(dev_fds)]

    def copy(k: int, chunk: int = GiB) -> None:
        for j, off in enumerate(range(0, n * GiB, chunk)):
            ck(cu.cuMemcpyAsync(dbase + off, hbase + off, chunk, streams[j % k]))

    res["copy_1_stream_gibps"] = timed(lambda: copy(1))
    res["copy_2_streams_256mib_gibps"] = timed(lambda: copy(2, 256 << 20))
    res["copy_4_streams_256mib_gibps"] = timed(lambda: copy(4, 256 << 20))
    res["copy_back_1_stream_gibps"] = timed(lambda: [ck(cu.cuMemcpyAsync(
        hbase + i * GiB, dbase + i * GiB, GiB, streams[0])) for i in range(n)])
    for i in range(n):
        unmap(dbase + i * GiB, handles[n + i])

    def overlapped(fds: list[int], base: int) -> None:
        """Map GiB i of ``fds`` at ``base``, then copy GiB i: each mapping runs
        beside the copy before it, as in a restore."""
        mapped = []
        for i, fd in enumerate(fds):
            mapped.append(map_fd(fd, base + i * GiB)[0])
            ck(cu.cuMemcpyAsync(dbase + i * GiB, hbase + i * GiB, GiB, streams[0]))
        ck(cu.cuCtxSynchronize())
        for i, h in enumerate(mapped):
            unmap(base + i * GiB, h)

    # the host copies mapped, the GPU memory mapped during the copies
    res["map_device_and_copy_overlapped_gibps"] = timed(lambda: overlapped(dev_fds, dbase))
    for i in range(n):
        unmap(hbase + i * GiB, handles[i])
    # the GPU memory mapped, the host copies mapped during the copies (gms/client/tiering.py)
    dev = [map_fd(fd, dbase + i * GiB)[0] for i, fd in enumerate(dev_fds)]
    res["map_host_and_copy_overlapped_gibps"] = timed(lambda: overlapped(host_fds, hbase))
    for i, h in enumerate(dev):
        unmap(dbase + i * GiB, h)

    dst = torch.empty(n * GiB, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(n * GiB, dtype=torch.uint8, pin_memory=True)
    res["floor_torch_pinned_gibps"] = timed(lambda: dst.copy_(pinned, non_blocking=True))
    for r in sorted(res):
        print(f"{r}: {res[r]}")
    write_json("bench/results/restore_copy_probe.json", res)


if __name__ == "__main__":
    main()
