"""Churning clients for the load test: THREADS clients in this process, each
connecting, handshaking RO, reading metadata, exporting every allocation and
disconnecting, over and over, for SECONDS.

    python churn_worker.py SOCKET LAYOUT THREADS SECONDS

Waits for a line on stdin before starting; prints one JSON line at the end:
cycles, errors (the first few, as text) and every cycle's duration.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from gms import GMSClientMemoryManager


def main() -> None:
    socket_path, layout, threads, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    durations: list[list[float]] = [[] for _ in range(threads)]
    errors: list[str] = []
    sys.stdin.readline()
    deadline = time.monotonic() + seconds

    def client(n: int) -> None:
        mine = durations[n]
        while time.monotonic() < deadline:
            started = time.perf_counter()
            try:
                with GMSClientMemoryManager(socket_path, layout=layout) as mgr:
                    mgr.connect("RO", timeout_ms=60_000)
                    keys = mgr.metadata_list()
                    for key in keys[:2]:
                        assert mgr.metadata_get(key) is not None
                    handles = mgr.list_handles()
                    for _, fd in mgr.export_handles([h.allocation_id for h in handles]):
                        os.close(fd)
            except Exception as exc:  # noqa: BLE001 - every failure is counted and shown
                errors.append(repr(exc)[:300])
                continue
            mine.append(time.perf_counter() - started)

    workers = [threading.Thread(target=client, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    flat = [d for mine in durations for d in mine]
    print(json.dumps({"cycles": len(flat), "errors": len(errors), "first_errors": errors[:5], "durations": flat}))


if __name__ == "__main__":
    main()
