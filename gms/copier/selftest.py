"""``python -m gms.copier --selftest --backend cuda``: the engine's every call, once, in one process.

The first thing to run on a GPU host after changing the copier: it makes a
device allocation and a chunk of host memory the way the server makes them
(``gms.cuda.open_backend`` / ``open_host_tier``), maps both the way the copier
does, copies a pattern device -> chunk -> (cleared) device, checks every
byte, and prints the bandwidth of each direction.  Exit 0 and one ``OK`` line,
or a traceback (or exit 70 from a CUDA failure, the copier's rule).
"""

from __future__ import annotations

import os
import time

from ..cuda import open_backend, open_host_tier
from .engines import open_engine

SIZE = 256 << 20


def selftest(backend: str, device: int, size: int = SIZE) -> int:
    gpu, host = open_backend(backend, device), open_host_tier(backend, device)
    engine = open_engine(backend, device)
    made = [(gpu, gpu.create(size, "selftest-device")), (host, host.create(size, "selftest-chunk"))]
    try:
        chunk = engine.map_chunk(os.dup(made[1][1].fd), size)
        memory = engine.map_device(os.dup(made[0][1].fd), size, writable=True)
        try:
            mapper = engine.mapper
            pattern = bytes(range(256)) * (1 << 12)  # 1 MiB
            for offset in range(0, size, len(pattern)):
                mapper.write(memory.va + offset, pattern)
            rates = {}
            for to_host in (True, False):
                if not to_host:
                    mapper.write(memory.va, bytes(size))  # the device copy is cleared first
                t0 = time.perf_counter()
                if to_host:
                    engine.copy(chunk.va, memory.va, size, True)
                else:
                    engine.copy(memory.va, chunk.va, size, False)
                engine.wait(to_host)
                rates["d2h" if to_host else "h2d"] = size / (time.perf_counter() - t0) / (1 << 30)
                where = chunk if to_host else memory
                for offset in (0, size // 2, size - len(pattern)):
                    if mapper.read(where.va + offset, len(pattern)) != pattern:
                        raise AssertionError(f"{'device -> host' if to_host else 'host -> device'}: bytes differ")
        finally:
            engine.unmap(memory)
            engine.unmap(chunk)
    finally:
        for backend_, held in made:
            backend_.release(held)
    print(
        f"copier selftest OK: {engine.name}; {size >> 20} MiB device -> host {rates['d2h']:.1f} GiB/s, "
        f"host -> device {rates['h2d']:.1f} GiB/s (one copy each, cold: not a floor)",
        flush=True,
    )
    return 0
