"""Probe: can the server own pinned host memory through VMM (cuMemCreate HOST_NUMA),
export it as an fd, and can a client map it and copy to the GPU at PCIe speed?"""
import ctypes, mmap, os, socket, sys, time, array, json
from cuda.bindings import driver as cu

SIZE = int(os.environ.get("PROBE_GIB", "8")) << 30
POSIX = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
res = {}

def ck(name, out):
    r, *v = out if isinstance(out, tuple) else (out,)
    if r != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{name}: {cu.cuGetErrorName(r)[1]}")
    return v[0] if len(v) == 1 else (tuple(v) if v else None)

def prop(kind):
    p = cu.CUmemAllocationProp()
    p.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    if kind == "device":
        p.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    else:
        p.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
    p.location.id = 0
    p.requestedHandleTypes = POSIX
    return p

def server(sock):
    # no context at all
    ck("cuInit", cu.cuInit(0))
    out = {}
    fds = []
    for kind in ("host", "device"):
        p = prop(kind)
        g = ck("gran", cu.cuMemGetAllocationGranularity(p, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        t = time.perf_counter()
        try:
            h = ck("cuMemCreate", cu.cuMemCreate(SIZE, p, 0))
            fd = ck("export", cu.cuMemExportToShareableHandle(h, POSIX, 0))
            out[kind] = {"granularity": int(g), "create_s": time.perf_counter() - t}
            fds.append(int(fd))
        except Exception as e:
            out[kind] = {"error": str(e)}
    msg = json.dumps(out).encode()
    socket.send_fds(sock, [msg], fds)
    sock.recv(1)

def main():
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        a.close(); server(b); os._exit(0)
    b.close()
    msg, fds, _, _ = socket.recv_fds(a, 1 << 16, 4)
    res["server"] = json.loads(msg)
    print(res["server"], flush=True)
    import torch
    torch.cuda.init(); torch.zeros(1, device="cuda")
    ck("cuInit", cu.cuInit(0))
    dev = ck("dev", cu.cuDeviceGet(0))
    ctx = ck("ctx", cu.cuDevicePrimaryCtxRetain(dev)); ck("set", cu.cuCtxSetCurrent(ctx))
    vas = {}
    for kind, fd in zip(("host", "device"), fds):
        t = time.perf_counter()
        h = ck("import", cu.cuMemImportFromShareableHandle(fd, POSIX))
        va = ck("reserve", cu.cuMemAddressReserve(SIZE, 0, 0, 0))
        ck("map", cu.cuMemMap(va, SIZE, 0, h, 0))
        descs = []
        d = cu.CUmemAccessDesc(); d.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE; d.location.id = 0
        d.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE; descs.append(d)
        ck("setaccess dev", cu.cuMemSetAccess(va, SIZE, descs, 1))
        res[f"{kind}_import_map_s"] = time.perf_counter() - t
        if kind == "host":
            hd = cu.CUmemAccessDesc(); hd.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA; hd.location.id = 0
            hd.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            try:
                ck("setaccess host", cu.cuMemSetAccess(va, SIZE, [hd], 1)); res["host_cpu_access"] = "ok"
            except Exception as e:
                res["host_cpu_access"] = str(e)
        vas[kind] = int(va)
    print(res, flush=True)
    # CPU write into the host VA?
    if res.get("host_cpu_access") == "ok":
        try:
            t = time.perf_counter(); ctypes.memset(vas["host"], 7, 64 << 20); res["cpu_memset_64MiB_s"] = time.perf_counter() - t
            res["cpu_read"] = ctypes.string_at(vas["host"], 4).hex()
        except Exception as e:
            res["cpu_write_err"] = str(e)
    stream = torch.cuda.current_stream().cuda_stream
    def bw(dst, src, n=SIZE, reps=3):
        best = 1e9
        for _ in range(reps):
            torch.cuda.synchronize(); t = time.perf_counter()
            ck("cpy", cu.cuMemcpyAsync(dst, src, n, stream)); torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        return n / best / 1e9
    res["vmmhost_to_dev_GBps"] = bw(vas["device"], vas["host"])
    res["dev_to_vmmhost_GBps"] = bw(vas["host"], vas["device"])
    # baselines: torch pinned, memfd registered, memfd pageable
    dst = torch.empty(SIZE, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(SIZE, dtype=torch.uint8, pin_memory=True)
    res["torch_pinned_to_dev_GBps"] = bw(dst.data_ptr(), pinned.data_ptr())
    del pinned
    mfd = os.memfd_create("probe"); os.ftruncate(mfd, SIZE)
    m = mmap.mmap(mfd, SIZE)
    buf = (ctypes.c_char * SIZE).from_buffer(m); addr = ctypes.addressof(buf)
    t = time.perf_counter(); ctypes.memset(addr, 1, SIZE); res["memfd_first_touch_s"] = time.perf_counter() - t
    res["memfd_pageable_to_dev_GBps"] = bw(dst.data_ptr(), addr, reps=2)
    from cuda.bindings import runtime as rt
    t = time.perf_counter(); r = rt.cudaHostRegister(addr, SIZE, 0); res["register_s"] = time.perf_counter() - t; res["register"] = str(r[0])
    res["memfd_registered_to_dev_GBps"] = bw(dst.data_ptr(), addr)
    rt.cudaHostUnregister(addr)
    # multithreaded CPU copy memfd->vmm host (if cpu access)
    if res.get("host_cpu_access") == "ok":
        import threading
        def par_copy(nthreads):
            chunk = SIZE // nthreads
            ths = [threading.Thread(target=ctypes.memmove, args=(vas["host"] + i*chunk, addr + i*chunk, chunk)) for i in range(nthreads)]
            t = time.perf_counter(); [x.start() for x in ths]; [x.join() for x in ths]
            return SIZE / (time.perf_counter() - t) / 1e9
        for n in (1, 4, 8):
            res[f"cpu_copy_memfd_to_vmmhost_{n}t_GBps"] = par_copy(n)
    print(json.dumps(res, indent=1), flush=True)
    out = os.environ.get("OUT")
    if out:
        open(os.path.join(out, "host_tier_probe.json"), "w").write(json.dumps(res, indent=1))
    a.send(b"x")
    os.waitpid(pid, 0)

main()
