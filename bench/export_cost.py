"""What making and exporting a VMM allocation costs the driver, and what makes an export slow.

In a bare process (no server), 2 MiB allocations, one CUDA call at a time:
``cuMemCreate``, ``cuMemExportToShareableHandle`` (a POSIX fd), the fd's
close and ``cuMemRelease``, per case:

* each allocation closed and released right after its export (a server that
  frees what it just made), with no context, with the primary context
  current, and at 64 MiB;
* every allocation kept (no close between exports);
* after each export: the fd dup'd and the dup closed; or the dup sent to
  another process over a Unix socket (as the server hands its keeper each
  allocation's fd) and closed.

    python bench/export_cost.py [--json PATH]

GPU only.  The fifteenth session's run on an H200 (as a probe with these
cases, before it was kept here): docs/results/export_cost_h200.txt.
"""

from __future__ import annotations

import argparse
import array
import multiprocessing as mp
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import cpu_name, percentile, write_json  # noqa: E402


def _median(samples: list[float]) -> float:
    return round(percentile(samples[len(samples) // 10:], 0.5), 1)  # the first tenth warms up


def _timed(fn, *args):
    started = time.perf_counter_ns()
    out = fn(*args)
    return out, (time.perf_counter_ns() - started) / 1e3


def _keeper(sock: socket.socket) -> None:
    """Another process that keeps every fd it is sent, as the keeper does."""
    while True:
        data, _, _, _ = sock.recvmsg(16, socket.CMSG_SPACE(64 * 4))  # the fds stay open here
        if not data:
            return


def one_case(label: str, *, n: int = 600, size: int = 2 << 20, after=None, keep: bool = False) -> dict:
    from cuda.bindings import driver as cu

    from gms.cuda import vmm

    backend = vmm.VmmBackend(0)
    create, export, close, release, kept = [], [], [], [], []
    for _ in range(n):
        (_, handle), t = _timed(cu.cuMemCreate, size, backend._prop, 0)
        create.append(t)
        (_, fd), t = _timed(cu.cuMemExportToShareableHandle, handle, vmm._POSIX_FD, 0)
        export.append(t)
        fd = int(fd)
        if keep or after is not None:
            if after is not None:
                _, t = _timed(after, fd)
                close.append(t)
            kept.append((handle, fd))
            continue
        _, t = _timed(os.close, fd)
        close.append(t)
        _, t = _timed(cu.cuMemRelease, handle)
        release.append(t)
    for handle, fd in kept:
        os.close(fd)
        cu.cuMemRelease(handle)
    row = {"case": label, "size": size, "create_us": _median(create), "export_us": _median(export),
           "close_or_after_us": _median(close) if close else None, "release_us": _median(release) if release else None}
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="bench/results/export_cost.json")
    args = parser.parse_args()
    from cuda.bindings import driver as cu

    rows = [one_case("closed and released after each export, no context"),
            one_case("every allocation kept, no context", keep=True),
            one_case("closed and released after each export, 64 MiB", n=200, size=64 << 20)]
    _, device = cu.cuDeviceGet(0)
    _, context = cu.cuDevicePrimaryCtxRetain(device)
    cu.cuCtxSetCurrent(context)
    rows.append(one_case("closed and released after each export, primary context current"))
    cu.cuCtxSetCurrent(cu.CUcontext(0))
    rows.append(one_case("a dup closed after each export", after=lambda fd: os.close(os.dup(fd))))
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    keeper = mp.get_context("spawn").Process(target=_keeper, args=(theirs,))
    keeper.start()

    def hand_on(fd: int) -> None:
        dup = os.dup(fd)
        ours.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [dup]))])
        os.close(dup)

    rows.append(one_case("a dup sent to another process, then closed", after=hand_on))
    ours.close()
    keeper.join()
    write_json(args.json, {"cpu": cpu_name(), "rows": rows})


if __name__ == "__main__":
    main()
