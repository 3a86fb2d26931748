"""Many real client processes at once, for the lock-fairness tests.

    python fleet.py SOCKET LAYOUT N MODE SEED

Imports gms once, forks N children and waits for a line on stdin; then every
child asks for RW_OR_RO on LAYOUT at the same moment.  A child granted RW
builds a layout filled with the seeded pattern and commits it, except in
MODE ``hold-first``, where the first writer (the one that takes the single
token) holds RW until it is killed.  A child granted RO checks every byte of
the layout.  Each child reports one JSON line per event on stdout (short
lines, written whole: lines of different children never mix).
"""

from __future__ import annotations

import json
import os
import sys
import time

from gms import GMSClientMemoryManager

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from victim import build, verify  # noqa: E402


def report(**fields) -> None:
    os.write(1, (json.dumps(fields) + "\n").encode())


def child(socket_path: str, layout: str, mode: str, seed: str, go: int, token: int) -> None:
    os.read(go, 1)  # all start together
    mgr = GMSClientMemoryManager(socket_path, layout=layout)
    asked = time.monotonic()
    mgr.connect("RW_OR_RO", timeout_ms=120_000)
    granted = mgr.granted_lock_type.value
    report(pid=os.getpid(), granted=granted, waited_ms=round((time.monotonic() - asked) * 1000, 3))
    if granted == "RW":
        holder = False
        if mode == "hold-first":
            try:
                holder = os.read(token, 1) == b"x"
            except BlockingIOError:
                pass
        build(mgr, seed)
        if holder:
            report(pid=os.getpid(), holding=True)
            time.sleep(3600)  # until killed
        mgr.commit()
        report(pid=os.getpid(), committed=True)
    else:
        report(pid=os.getpid(), checked=verify(mgr))
    mgr.close()


def main() -> None:
    socket_path, layout, n, mode, seed = sys.argv[1:]
    go_r, go_w = os.pipe()
    token_r, token_w = os.pipe()
    os.set_blocking(token_r, False)
    os.write(token_w, b"x")
    children = []
    for _ in range(int(n)):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                child(socket_path, layout, mode, seed, go_r, token_r)
            except BaseException as exc:  # noqa: BLE001 - reported, then the child exits
                report(pid=os.getpid(), error=repr(exc)[:500])
                code = 1
            finally:
                os._exit(code)
        children.append(pid)
    report(forked=len(children))
    sys.stdin.readline()
    os.write(go_w, b"g" * len(children))
    codes = [os.waitpid(pid, 0)[1] for pid in children]
    report(done=True, failed=sum(1 for c in codes if os.waitstatus_to_exitcode(c) not in (0, -9)))


if __name__ == "__main__":
    main()
