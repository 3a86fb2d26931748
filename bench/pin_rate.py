"""How fast the host can pin: the host tier's ``cuMemCreate`` of 64 MiB chunks on the
GPU's NUMA node (as the server's pool makes them), from 1, 2, 4 and 8 threads at once.

The rate a build must stay under for ``--host-pool auto`` to have its publish's chunks
pinned by its commit (docs/performance.md, section 7).  CUDA only.

    python bench/pin_rate.py [--gib 6] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_name, write_json

CHUNK = 64 << 20


def pin(tier, threads: int, total: int) -> dict:
    per = total // CHUNK // threads
    made: list[list] = [[] for _ in range(threads)]

    def work(i: int) -> None:
        for _ in range(per):
            made[i].append(tier.create(CHUNK))

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    t0 = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    seconds = time.perf_counter() - t0
    gib = sum(map(len, made)) * CHUNK / 2**30
    for held in (h for m in made for h in m):
        tier.release(held)
    return {"threads": threads, "gib": gib, "s": round(seconds, 3), "gib_per_s": round(gib / seconds, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=6.0, help="pinned per setting")
    parser.add_argument("--json", default="bench/results/pin_rate.json")
    args = parser.parse_args()
    from gms.cuda.vmm import VmmHostTier

    tier = VmmHostTier(0)
    total = int(args.gib * 2**30)
    pin(tier, 1, total)  # warm-up
    runs = []
    for threads in (1, 2, 4, 8, 1):
        runs.append(pin(tier, threads, total))
        print(runs[-1], flush=True)
    write_json(args.json, {"cpu": cpu_name(), "cores": os.cpu_count(), "chunk_bytes": CHUNK, "runs": runs})


if __name__ == "__main__":
    main()
