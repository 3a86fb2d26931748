"""The disk tier: a layout's snapshot saved after its commit, and restored after a reboot, against the disk's floors.

One layout of ``--size`` bytes (1 GiB allocations, random bytes), on one
``gms serve`` as users run it (keeper on), its disk tier in ``--dir``:

* **save**: ``commit(persist=True)`` returns at once (the save is off its
  path); timed from that call to ``SNAPSHOT_SAVED`` (the snapshot whole, fsynced
  and visible; seen by polling ``gms status`` every 5 ms).  Floor: the same
  number of bytes written to a new file in the same folder by ``dd`` with
  ``oflag=direct conv=fsync`` (32 MiB blocks), and by 4 threads of aligned
  ``O_DIRECT`` ``pwrite`` then ``fsync``; the faster of the two.
* **restore**: every gms process stopped (the keeper's SIGTERM), ``gms
  serve`` started again on the same folders (the layout comes back on the
  disk tier), then a reader's ``connect(RO)``: timed from that call to its
  return (the GPU copy whole, every extent's checksum checked).  Floor: the
  snapshot file read by ``dd iflag=direct`` (32 MiB blocks) and by 4 threads of
  aligned ``O_DIRECT`` ``pread`` into one buffer each; the faster of the two.

``O_DIRECT`` on both sides: neither gms nor the floor reads the page cache
(where the file system refuses it, tmpfs, both fall back to buffered I/O and
the figures say nothing of a disk).  The restored bytes are checked (the
first and last MiB of every allocation) outside the clock.  On the host
backend the "GPU" is memfd memory: the ratios are of the disk path alone.

    python bench/disk_tier.py --backend host --size 2GiB            # the 2-core host
    python bench/disk_tier.py --backend cuda --size 16GiB --dir /x    # on a GPU machine
    # --quick: 512 MiB; --repeats N (default 2): floors and gms alternate, best of N each
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from _common import Server, add_out, cpu_name, log, print_table, versions, wait_for, write_results  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
BLOCK = 32 * MiB


def parse_size(text: str) -> int:
    from gms.units import parse_bytes

    return parse_bytes(text)


def disk_of(path: str) -> str:
    """The device and file system under ``path``, as df names them."""
    out = subprocess.run(["df", "--output=source,fstype,size", path], capture_output=True, text=True).stdout
    return " ".join(out.strip().splitlines()[-1].split()) if out else "?"


# -- the floors -------------------------------------------------------------------------------


def _threads(fn, count: int) -> None:
    errors = []

    def run(k: int) -> None:
        try:
            fn(k)
        except BaseException as exc:  # noqa: BLE001 - raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _aligned_buffer(size: int):
    import mmap

    return mmap.mmap(-1, size)  # page aligned: what O_DIRECT asks


def _direct_flags() -> int:
    return getattr(os, "O_DIRECT", 0)


def floor_write(folder: str, size: int, threads: int = 4) -> float:
    """Seconds to write ``size`` bytes to a new file and fsync it: the faster of dd and threads."""
    path = os.path.join(folder, "floor-write.bin")
    best = float("inf")
    if shutil.which("dd"):
        started = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", f"of={path}", f"bs={BLOCK}", f"count={size // BLOCK}",
                        "oflag=direct", "conv=fsync"], check=True, capture_output=True)
        best = time.perf_counter() - started
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _direct_flags(), 0o600)
    buffers = [_aligned_buffer(BLOCK) for _ in range(threads)]
    for b in buffers:
        b.write(os.urandom(MiB) * (BLOCK // MiB))
    started = time.perf_counter()
    blocks = size // BLOCK

    def write(k: int) -> None:
        for n in range(k, blocks, threads):
            os.pwrite(fd, buffers[k], n * BLOCK)

    _threads(write, threads)
    os.fsync(fd)
    best = min(best, time.perf_counter() - started)
    os.close(fd)
    os.unlink(path)
    return best


def floor_read(path: str, threads: int = 4) -> float:
    """Seconds to read the file whole: the faster of dd and threads, both O_DIRECT."""
    size = os.path.getsize(path)
    best = float("inf")
    if shutil.which("dd"):
        started = time.perf_counter()
        subprocess.run(["dd", f"if={path}", "of=/dev/null", f"bs={BLOCK}", "iflag=direct"],
                       check=True, capture_output=True)
        best = time.perf_counter() - started
    fd = os.open(path, os.O_RDONLY | _direct_flags())
    buffers = [_aligned_buffer(BLOCK) for _ in range(threads)]
    blocks = -(-size // BLOCK)
    started = time.perf_counter()

    def read(k: int) -> None:
        for n in range(k, blocks, threads):
            try:
                os.preadv(fd, [buffers[k]], n * BLOCK)
            except OSError:  # the unaligned tail of the file: buffered
                with open(path, "rb") as f:
                    f.seek(n * BLOCK)
                    f.read(BLOCK)

    _threads(read, threads)
    best = min(best, time.perf_counter() - started)
    os.close(fd)
    return best


# -- gms ---------------------------------------------------------------------------------------


def publish(socket: str, size: int) -> tuple[float, list[tuple[bytes, bytes]]]:
    """Commit a layout of ``size`` random bytes to persist; (when the call returned, per
    allocation its first and last MiB)."""
    from gms import GMSClientMemoryManager, RequestedLockType

    writer = GMSClientMemoryManager(socket, layout="bench")
    writer.connect(RequestedLockType.RW)
    ends = []
    chunk = min(GiB, size)
    pattern = os.urandom(64 * MiB)
    for n in range(size // chunk):
        va = writer.create_mapping(size=chunk, tag="weights")
        for offset in range(0, chunk, len(pattern)):
            piece = bytes([n + 1]) + pattern[1 : min(len(pattern), chunk - offset)]
            writer.write(va + offset, piece)
        ends.append((writer.read(va, MiB), writer.read(va + chunk - MiB, MiB)))
        writer.metadata_put(f"tensor.{n}", writer.mappings[-1].allocation_id, 0, b"bf16")
    writer.commit(persist=True)
    returned = time.perf_counter()
    writer.close()
    return returned, ends


def wait_saved(socket: str, timeout: float = 600) -> float:
    from gms import get_runtime_state

    wait_for(lambda: get_runtime_state(socket).layout("bench").disk_bytes, timeout,
             "the snapshot to be saved (see the server log)", poll=0.005)
    return time.perf_counter()


def restore(socket: str, ends) -> float:
    from gms import GMSClientMemoryManager, RequestedLockType

    reader = GMSClientMemoryManager(socket, layout="bench")
    started = time.perf_counter()
    reader.connect(RequestedLockType.RO)
    took = time.perf_counter() - started
    handles = reader.list_handles()
    vas = reader.create_mappings([h.allocation_id for h in handles])
    for (first, last), va, h in zip(ends, vas, handles):
        if reader.read(va, MiB) != first or reader.read(va + h.size - MiB, MiB) != last:
            raise RuntimeError("the restored bytes are not the published ones")
    reader.close()
    return took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="host", choices=("host", "cuda"))
    parser.add_argument("--size", type=parse_size, default=2 * GiB)
    parser.add_argument("--dir", default=None, help="where the disk tier and the floors' files go (a real disk)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    add_out(parser)
    args = parser.parse_args()
    size = 512 * MiB if args.quick else args.size
    size -= size % BLOCK
    base = tempfile.mkdtemp(prefix="gms-disk-bench-", dir=args.dir)
    disk = os.path.join(base, "disk")
    extra = ["--host-capacity", str(size + 2 * GiB)] if args.backend == "host" else []
    rows, results = [], []
    try:
        for attempt in range(args.repeats):
            write_floor = floor_write(base, size)
            server = Server(base, args.backend, "bench", "--disk-dir", disk, *extra,
                            log=os.path.join(base, f"server-{attempt}.log"))
            returned, ends = publish(server.socket, size)
            save = wait_saved(server.socket) - returned
            server.stop()
            snapshot = max(Path(disk).glob("*.gsnap"), key=lambda p: p.stat().st_mtime)
            read_floor = floor_read(str(snapshot))
            server = Server(base, args.backend, "bench", "--disk-dir", disk, *extra,
                            log=os.path.join(base, f"server-{attempt}-again.log"))
            took = restore(server.socket, ends)
            server.stop()
            snapshot.unlink()
            results.append({"save_s": save, "write_floor_s": write_floor, "restore_s": took,
                            "read_floor_s": read_floor})
            log(f"run {attempt}: save {save:.2f} s (floor {write_floor:.2f}), restore {took:.2f} s "
                f"(floor {read_floor:.2f})")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    best = {k: min(r[k] for r in results) for k in results[0]}
    gib = size / GiB
    for what, ours, floor in (("save", "save_s", "write_floor_s"), ("restore", "restore_s", "read_floor_s")):
        rows.append((what, f"{best[ours]:.2f} s", f"{gib / best[ours]:.2f} GiB/s", f"{best[floor]:.2f} s",
                     f"{gib / best[floor]:.2f} GiB/s", f"{best[ours] / best[floor]:.2f}x"))
    title = f"disk tier, {gib:.1f} GiB layout, {args.backend} backend, {cpu_name()}, disk {disk_of(args.dir or tempfile.gettempdir())}"
    print_table(title, rows, ("", "gms", "gms rate", "floor", "floor rate", "gms / floor"))
    hardware = {"cpu": cpu_name(), "disk": disk_of(args.dir or tempfile.gettempdir()), "cores": os.cpu_count()}
    if args.backend == "cuda":
        from _common import gpu

        hardware["gpu"] = gpu()
    write_results(args.out, f"disk_tier_{args.backend}", {
        "size_bytes": size, "backend": args.backend, "hardware": hardware, "runs": results, "best": best,
        "versions": versions("gms"),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
