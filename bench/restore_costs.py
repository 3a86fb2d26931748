"""Where a host-backend restore's time goes, apart from the disk: a file read with
O_DIRECT into fresh memfd memory (what the copier does) against the same read into
memory already faulted in, with and without a crc32 of every extent.

    python bench/restore_costs.py [--size 2GiB] [--dir /var/tmp] [--threads 4]

A restore on the host backend reads each 32 MiB extent into the layout's memfd
memory (new pages: the kernel allocates and zeroes each as the read pins it) and
checks its crc32 (``gms.checksum``: zlib-ng's, the standard library's beside it
below); the disk tier's floor (bench/disk_tier.py) reads into one reused
buffer and checks nothing.  The rows separate the two costs on this host.
"""

from __future__ import annotations

import argparse
import mmap
import os
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

from _common import add_out, cpu_name, log, print_table, write_results

from gms.checksum import IMPLEMENTATION, crc32

EXTENT = 32 << 20


def read_into(path: str, size: int, threads: int, fresh: bool, crc: bool) -> float:
    """Seconds to read ``path`` (O_DIRECT, ``threads`` extents at a time) into a memfd mapping."""
    fd = os.memfd_create("gms-restore-costs")
    os.ftruncate(fd, size)
    memory = mmap.mmap(fd, size)
    view = memoryview(memory)
    if not fresh:
        os.posix_fallocate(fd, 0, size)  # every page allocated (and zeroed) before the clock
    file = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))

    def one(k: int) -> None:
        at = k * EXTENT
        extent = view[at:at + EXTENT]
        got = 0
        while got < EXTENT:
            got += os.preadv(file, [extent[got:]], at + got)
        if crc:
            crc32(extent)
        extent.release()

    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(size // EXTENT)))
    took = time.perf_counter() - started
    os.close(file)
    view.release()
    memory.close()
    os.close(fd)
    return took


def main() -> int:
    from gms.units import parse_bytes

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_bytes, default=2 << 30)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    add_out(parser)
    args = parser.parse_args()
    size = args.size - args.size % EXTENT
    folder = tempfile.mkdtemp(prefix="gms-restore-costs-", dir=args.dir)
    path = os.path.join(folder, "extents.bin")
    try:
        with open(path, "wb") as f:
            for _ in range(size // EXTENT):
                f.write(os.urandom(EXTENT))
            os.fsync(f.fileno())
        rows, results = [], {}
        for fresh, crc in ((False, False), (False, True), (True, False), (True, True)):
            name = f"{'fresh' if fresh else 'faulted-in'} memory, {'crc32' if crc else 'no checksum'}"
            best = min(read_into(path, size, args.threads, fresh, crc) for _ in range(args.repeats))
            results[name] = best
            rows.append((name, f"{best:.2f} s", f"{size / (1 << 30) / best:.2f} GiB/s"))
            log(f"{name}: {best:.2f} s")
        for what, fn in ((f"gms's ({IMPLEMENTATION})", crc32), ("the standard library's (zlib)", zlib.crc32)):
            block = os.urandom(EXTENT)
            fn(block)
            started = time.perf_counter()
            fn(block)
            crc_one = (time.perf_counter() - started) * (size // EXTENT)
            rows.append((f"crc32 alone, one thread, {what} (from one extent)", f"{crc_one:.2f} s", ""))
            results[f"crc32_one_thread_s {what}"] = crc_one
    finally:
        if os.path.exists(path):
            os.unlink(path)
        os.rmdir(folder)
    print_table(f"restore costs, {size / (1 << 30):.1f} GiB, {args.threads} threads, {cpu_name()}, "
                f"{os.cpu_count()} cores", rows, ("read into", "best", "rate"))
    write_results(args.out, "restore_costs", {"size_bytes": size, "threads": args.threads, "cpu": cpu_name(),
                                              "cores": os.cpu_count(), "best_s": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
