import os, sys, time, tempfile
sys.path.insert(0, "bench")
from _common import Server
from cuda.bindings import driver as cu
from gms import GMSClientMemoryManager
from gms.cuda import vmm
MiB, GiB = 1 << 20, 1 << 30
with tempfile.TemporaryDirectory() as d:
    for count, size in ((512, 2 * MiB), (32, GiB)):
        with Server(d, name=f"p{count}") as server:
            w = GMSClientMemoryManager(server.socket); w.connect("RW")
            for _ in range(count): w.allocate_handle(size, "weights")
            w.commit(); w.close()
            r = GMSClientMemoryManager(server.socket); r.connect("RO")
            m = r._mapper
            t0 = time.perf_counter(); ids = [h.allocation_id for h in r.list_handles()]
            t1 = time.perf_counter(); exported = r.export_handles(ids)
            t2 = time.perf_counter(); total = sum(i.aligned_size for i, _ in exported); base = m.reserve(total)
            t3 = time.perf_counter()
            hs = []; va = base
            for info, fd in exported:
                _, h = cu.cuMemImportFromShareableHandle(fd, vmm._POSIX_FD); os.close(fd)
                cu.cuMemMap(va, info.aligned_size, 0, h, 0); hs.append((va, info.aligned_size, h)); va += info.aligned_size
            t4 = time.perf_counter()
            cu.cuMemSetAccess(base, total, m._access[False], 1)
            t5 = time.perf_counter()
            print(f"{count} x {size>>20} MiB: list {1e3*(t1-t0):.2f} export {1e3*(t2-t1):.2f} reserve {1e3*(t3-t2):.2f} import+map {1e3*(t4-t3):.2f} setaccess(one) {1e3*(t5-t4):.2f} ms", flush=True)
            for v, s_, h in hs:
                cu.cuMemUnmap(v, s_); cu.cuMemRelease(h)
            t6 = time.perf_counter()
            # per-allocation set access for comparison
            va = base
            exported = r.export_handles(ids)
            hs = []
            for info, fd in exported:
                _, h = cu.cuMemImportFromShareableHandle(fd, vmm._POSIX_FD); os.close(fd)
                cu.cuMemMap(va, info.aligned_size, 0, h, 0); hs.append((va, info.aligned_size, h)); va += info.aligned_size
            t7 = time.perf_counter()
            for v, s_, h in hs: cu.cuMemSetAccess(v, s_, m._access[False], 1)
            t8 = time.perf_counter()
            print(f"   import+map again {1e3*(t7-t6):.2f} setaccess(each) {1e3*(t8-t7):.2f} ms", flush=True)
            for v, s_, h in hs:
                cu.cuMemUnmap(v, s_); cu.cuMemRelease(h)
            m.free(base, total)
            t9 = time.perf_counter(); vas = r.create_mappings(ids); t10 = time.perf_counter()
            print(f"   create_mappings {1e3*(t10-t9):.2f} ms", flush=True)
            r.close()
