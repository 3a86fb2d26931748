"""A node full of small metadata entries: what a restart, a take-over and the daemon's memory cost.

    python bench/restart_scale.py [--entries 200000] [--value-bytes 16] [--repeats 3] [--out DIR]

One committed layout of ``--entries`` metadata entries (a tenant's default
metadata quota admits about 250,000 small ones), on the host backend under
``gms serve`` as a user starts it (keeper and spare on), and a reader holding
RO on it.  Then, ``--repeats`` times each:

* **SIGKILL** of the serving server: seconds until the reader's next
  ``metadata_get`` is answered (it rides through to the spare);
* **take-over** (``gms serve --take-over``): the longest gap between two
  answers of a reader asking in a loop (the pause, as a client sees it);
* **memory**: the daemon family's RSS (keeper, server, spare, copier, by
  ``/proc``) with the layout committed, against an empty node's, as a ratio
  to the bytes stored (keys and values).

Issue 59 asked for both ≤ 1 s on the 2-core host and the family within twice
what tenants store plus a fixed overhead.  Writes ``restart_scale.json``.
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

from _common import add_out, cpu_name, log, print_table, wait_for, wait_served, write_results

MiB = 1 << 20


def family(root: int) -> list[int]:
    """``root`` and every process under it (the keeper: its server, spare and copiers)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def rss(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as status:
                total += next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total


def serve(socket: str, log_path: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gms", "serve", "--backend", "host", "--socket", socket,
                             "--log-level", "info", *extra], stdout=open(log_path, "ab"), stderr=subprocess.STDOUT)


def state(socket: str):
    from gms import get_runtime_state

    return get_runtime_state(socket, timeout=5)


def settled(socket: str) -> None:
    """The keeper has everything, and a spare stands by (its line in the log)."""
    wait_for(lambda: state(socket).keeper == "attached", 60, "the keeper caught up")
    time.sleep(3.0)  # the spare starts 2 s after its server serves; the keeper's quiet-spell base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--entries", type=int, default=200_000)
    parser.add_argument("--value-bytes", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--serve-args", default="", help="more `gms serve` options (default: none, as users start it)")
    add_out(parser)
    args = parser.parse_args()
    from gms import GMSClientMemoryManager, RequestedLockType

    work = Path(tempfile.mkdtemp(prefix="gms-scale-"))
    socket = str(work / "gms.sock")
    server_log = work / "serve.log"
    extra = ["--max-metadata-bytes", "1GiB", *args.serve_args.split()]
    proc = serve(socket, server_log, *extra)
    wait_served(socket, proc, str(server_log))
    settled(socket)
    empty_rss = rss(family(proc.pid))

    writer = GMSClientMemoryManager(socket, layout="entries")
    writer.connect(RequestedLockType.RW)
    writer.create_mapping(size=2 * MiB, tag="entries")
    allocation = writer.mappings[0].allocation_id
    value = b"v" * args.value_bytes
    started = time.monotonic()
    for first in range(0, args.entries, 1000):
        writer.metadata_put_many(
            (f"key-{n:08d}", allocation, 0, value) for n in range(first, min(args.entries, first + 1000)))
    put_s = time.monotonic() - started
    writer.commit()
    writer.close()
    stored = sum(len(f"key-{n:08d}") + len(value) for n in range(args.entries))
    log(f"{args.entries} entries ({stored / MiB:.1f} MiB) put in {put_s:.1f} s")
    settled(socket)
    full_rss = rss(family(proc.pid))
    by_process = {f"{pid} " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:90].decode(): rss([pid]) >> 20
                  for pid in family(proc.pid)}
    log(f"RSS by process, MiB: {by_process}")

    reader = GMSClientMemoryManager(socket, layout="entries", reconnect_timeout_s=120.0)
    reader.connect(RequestedLockType.RO)
    kills, pauses = [], []
    for _ in range(args.repeats):
        os.kill(state(socket).pid, signal.SIGKILL)
        killed = time.monotonic()
        while True:
            try:
                if reader.metadata_get("key-00000001") is not None:
                    break
            except Exception:  # noqa: BLE001 - riding through: asked again until answered
                time.sleep(0.002)
        kills.append(time.monotonic() - killed)
        settled(socket)

    for n in range(args.repeats):
        old = state(socket).pid
        gaps: list[float] = []
        stop = threading.Event()

        def ask() -> None:
            last = time.monotonic()
            while not stop.is_set():
                try:
                    reader.metadata_get("key-00000002")
                except Exception:  # noqa: BLE001 - the gap is what is measured
                    pass
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        asker = threading.Thread(target=ask)
        asker.start()
        time.sleep(1.0)
        new = serve(socket, work / f"take-over-{n}.log", "--take-over", *extra)
        wait_for(lambda: state(socket).pid not in (old, 0), 120, "the new server serving")
        time.sleep(1.0)
        stop.set()
        asker.join()
        pauses.append(max(gaps))
        settled(socket)
        del new  # it serves under its own keeper now: stopped with `gms stop` below

    reader.close()
    subprocess.run([sys.executable, "-m", "gms", "stop", "--socket", socket], capture_output=True, timeout=60)
    results = {
        "host": {"cpu": cpu_name(), "cores": os.cpu_count()},
        "entries": args.entries, "stored_bytes": stored, "put_s": round(put_s, 2),
        "sigkill_to_served_s": [round(s, 3) for s in kills], "take_over_pause_s": [round(s, 3) for s in pauses],
        "family_rss_empty_bytes": empty_rss, "family_rss_full_bytes": full_rss,
        "growth_per_stored": round((full_rss - empty_rss) / stored, 2),
    }
    print_table(f"restart at {args.entries:,} entries ({cpu_name()}, {os.cpu_count()} cores)", [
        ("SIGKILL -> the reader served, s", ", ".join(f"{s:.2f}" for s in kills)),
        ("take-over: a reader's longest gap, s", ", ".join(f"{s:.2f}" for s in pauses)),
        ("stored (keys and values), MiB", f"{stored / MiB:.1f}"),
        ("daemon family RSS empty -> full, MiB", f"{empty_rss / MiB:.0f} -> {full_rss / MiB:.0f}"),
        ("growth / stored", f"{(full_rss - empty_rss) / stored:.2f}"),
    ])
    write_results(args.out, "restart_scale", results)
    shutil.rmtree(work, ignore_errors=True)  # (kept where it failed: its logs say why)


if __name__ == "__main__":
    main()
