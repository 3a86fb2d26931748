"""Room in the process's file-descriptor table, made before it is needed.

The kernel grows a process's fd table when a new fd does not fit, and in a
multi-threaded process (any process with torch or CUDA loaded) growing waits
for an RCU grace period: 9 to 18 ms on the H100 VM of docs/performance.md.
Receiving a batch of exported allocations mid-import would pay that, so the
client makes room once, when its manager is created.
"""

from __future__ import annotations

import fcntl
import os
import resource


def _table() -> tuple[int, int] | None:
    """(slots in the fd table, fds open), or None where /proc cannot say."""
    try:
        with open("/proc/self/status", "rb") as status:
            size = next(int(line.split()[1]) for line in status if line.startswith(b"FDSize:"))
        return size, len(os.listdir("/proc/self/fd"))
    except (OSError, StopIteration, ValueError):
        return None


def reserve_fd_slots(count: int) -> None:
    """Grow the fd table now so that ``count`` more fds fit without growing it."""
    table = _table()
    if table is None:
        return
    size, used = table
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = used + count + 1 if soft == resource.RLIM_INFINITY else soft
    needed = min(used + count, limit - 1)
    if needed < size:
        return
    try:  # threads may take the last fds meanwhile: room is an optimisation
        probe = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        try:
            # The lowest free fd >= needed: the table grows to hold it; nothing is clobbered.
            os.close(fcntl.fcntl(probe, fcntl.F_DUPFD_CLOEXEC, needed))
        finally:
            os.close(probe)
    except OSError:
        pass


# A take-over's new server receives every fd the old one hands over (memory,
# the listener, the clients' sockets) and gives its keeper a copy of each, a
# frame at a time (SCM_MAX_FD, 253: each frame's copies are closed once sent,
# gms.server.restart.mirror); and it opens a few of its own besides (its keeper
# link, the copier's, a metrics port, admins' connections).
HANDOVER_SLACK = 253 + 512


def handover_need(handed: int) -> int:
    """Fds a new server needs open at once to take ``handed`` fds over.  Pure."""
    return handed + HANDOVER_SLACK


def fd_room() -> int | None:
    """How many more fds this process may open (``gms serve`` raised its soft limit
    to the hard one at start); None where that is unbounded or /proc cannot say."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    table = _table()
    if soft == resource.RLIM_INFINITY or table is None:
        return None
    return soft - table[1]
