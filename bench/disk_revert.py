"""The revert window: a rebuild of a persisted layout whose writer is SIGKILLed, until a
reader has the last whole snapshot back (issue 60).

One ``gms serve`` as users run it (keeper on, host backend unless ``--backend cuda``),
one layout of ``--size`` bytes committed with ``persist`` and saved.  Then, each round:

* a writer process connects RW to the layout (the rebuild: the layout is cleared, its
  snapshot kept), allocates and writes 64 MiB, and stops there;
* a reader connects RO to the layout and waits (the layout has no commit);
* the writer is SIGKILLed.  The server sees its connection close (``RW_ABORT``), reads
  the kept snapshot's manifest and brings the layout back on the disk tier
  (``LAYOUT_RECOVERED``); the waiting reader restores it from disk and is granted.

Timed from the SIGKILL to the reader's ``connect`` returning, with the layout's hash
checked to be the saved one.  Beside it, in the same run: a reader's restore of the
same layout on a server just started (the disk tier's restore alone, as
bench/disk_tier.py times it), so the window's own part is the difference.

    python bench/disk_revert.py [--size 1GiB] [--rounds 3] [--dir /var/tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from _common import Server, add_out, cpu_name, log, print_table, versions, wait_for, write_results  # noqa: E402
from disk_tier import parse_size, publish, restore, wait_saved  # noqa: E402

MiB = 1 << 20

WRITER = """
import sys
from gms import GMSClientMemoryManager, RequestedLockType
w = GMSClientMemoryManager(sys.argv[1], layout="bench")
w.connect(RequestedLockType.RW)
va = w.create_mapping(size=64 << 20, tag="weights")
w.write(va, b"\\x01" * (64 << 20))
print("building", flush=True)
sys.stdin.read()
"""


def revert_once(socket: str, layout_hash: str) -> float:
    """Seconds from the rebuilding writer's SIGKILL to a waiting reader granted the saved layout."""
    from gms import GMSClientMemoryManager, RequestedLockType, get_runtime_state

    writer = subprocess.Popen([sys.executable, "-c", WRITER, socket], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        if writer.stdout.readline().strip() != "building":
            raise RuntimeError("the writer did not start its rebuild")
        reader = GMSClientMemoryManager(socket, layout="bench")
        granted: list[float] = []
        failed: list[BaseException] = []

        def connect() -> None:
            try:
                reader.connect(RequestedLockType.RO)
                granted.append(time.perf_counter())
            except BaseException as exc:  # noqa: BLE001 - said below
                failed.append(exc)

        thread = threading.Thread(target=connect)
        thread.start()
        wait_for(lambda: get_runtime_state(socket).layout("bench").state == "RW", 10, "the rebuild")
        time.sleep(0.2)  # the reader's handshake queued behind the writer
        killed = time.perf_counter()
        writer.send_signal(signal.SIGKILL)
        thread.join(600)
        if failed or not granted:
            raise RuntimeError(f"the reader was not granted: {failed}")
        if reader.get_memory_layout_hash() != layout_hash:
            raise RuntimeError("the reader got another layout than the saved one")
        reader.close()
        return granted[0] - killed
    finally:
        writer.kill()
        writer.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="host", choices=("host", "cuda"))
    parser.add_argument("--size", type=parse_size, default=1 << 30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the disk tier goes (a real disk)")
    add_out(parser)
    args = parser.parse_args()
    from gms import GMSClientMemoryManager, RequestedLockType

    base = tempfile.mkdtemp(prefix="gms-disk-revert-", dir=args.dir)
    disk = os.path.join(base, "disk")
    extra = ["--host-capacity", str(args.size + (2 << 30))] if args.backend == "host" else []
    windows, restores = [], []
    try:
        server = Server(base, args.backend, "bench", "--disk-dir", disk, *extra, log=os.path.join(base, "server.log"))
        _, ends = publish(server.socket, args.size)
        wait_saved(server.socket)
        probe = GMSClientMemoryManager(server.socket, layout="bench")
        probe.connect(RequestedLockType.RO)
        layout_hash = probe.get_memory_layout_hash()
        probe.close()
        for round_ in range(args.rounds):
            windows.append(revert_once(server.socket, layout_hash))
            log(f"round {round_}: SIGKILL of the rebuilding writer -> reader granted in {windows[-1]:.3f} s")
        server.stop()
        for round_ in range(args.rounds):  # the disk tier's restore alone, on a server just started
            server = Server(base, args.backend, "bench", "--disk-dir", disk, *extra,
                            log=os.path.join(base, f"server-{round_}.log"))
            restores.append(restore(server.socket, ends))
            server.stop()
            log(f"round {round_}: restore on a server just started {restores[-1]:.3f} s")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    best_window, best_restore = min(windows), min(restores)
    rows = [
        ("SIGKILL of the rebuilding writer -> the waiting reader granted", f"{best_window:.3f} s"),
        ("a reader's restore on a server just started", f"{best_restore:.3f} s"),
        ("the revert's own part (the difference)", f"{best_window - best_restore:.3f} s"),
    ]
    title = f"revert window, {args.size / (1 << 30):.2f} GiB layout, {args.backend} backend, {cpu_name()}, " \
            f"{os.cpu_count()} cores"
    print_table(title, rows, ("", "best of " + str(args.rounds)))
    hardware = {"cpu": cpu_name(), "cores": os.cpu_count()}
    if args.backend == "cuda":
        from _common import gpu

        hardware["gpu"] = gpu()
    write_results(args.out, f"disk_revert_{args.backend}", {
        "size_bytes": args.size, "backend": args.backend, "hardware": hardware, "windows_s": windows,
        "restores_s": restores, "versions": versions("gms"),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
