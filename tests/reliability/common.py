"""Shared by the reliability suite: its two sizes, servers, figures, checks.

``GMS_RELIABILITY=long`` selects the long mode (release checks, minutes);
anything else the CI slice (seconds).  Figures each test measures go to
:func:`record`; ``GMS_RELIABILITY_OUT`` names a folder where they are
written as JSON at the end of the session (``bench/soak.py`` reads them).
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gms.fsm import EMPTY_NODE, InvariantViolation, check_invariants, fold

from ..helpers import ServerProcess, wait_until

LONG = os.environ.get("GMS_RELIABILITY", "ci") == "long"
MODE = "long" if LONG else "ci"
# The seed's bound is 50 ms from a client's death to the next grant.  Tests
# assert it with a margin (a loaded, shared 2-core box stalls for tens of ms);
# the real figures are recorded and reported.
GRANT_TARGET_MS = 50.0
GRANT_BOUND_MS = float(os.environ.get("GMS_GRANT_BOUND_MS", "500"))
HERE = Path(__file__).resolve().parent

_records: list[dict] = []


def scale(ci, long):
    return long if LONG else ci


def record(area: str, name: str, **figures) -> None:
    """One row of the report: ``area`` is its table, ``name`` its row."""
    _records.append({"area": area, "name": name, "mode": MODE, **figures})


def take_records() -> list[dict]:
    """The rows recorded in this process since the last call (a test's, handed to
    its report: the suite may run in several processes, pytest-xdist)."""
    rows = _records[:]
    _records.clear()
    return rows


# -- figures --------------------------------------------------------------------------


def summary_ms(samples_s: list[float]) -> dict:
    """count, p50, p99 and max of durations given in seconds, in ms."""
    if not samples_s:
        return {"count": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    ordered = sorted(samples_s)
    n = len(ordered)
    return {
        "count": n,
        "p50_ms": round(statistics.median(ordered) * 1000, 3),
        "p99_ms": round(ordered[min(n - 1, int(n * 0.99))] * 1000, 3),
        "max_ms": round(ordered[-1] * 1000, 3),
    }


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def daemon_rss(server: ServerProcess) -> int:
    """What the daemon holds: the process started (the keeper, or the server alone)
    and everything under it (the server, its copier)."""
    from ..helpers import descendants

    total = 0
    for pid in [server.pid, *descendants(server.pid)]:
        try:
            total += rss_bytes(pid)
        except (OSError, RuntimeError):  # gone meanwhile
            pass
    return total


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def fd_targets(pid: int) -> list[str]:
    """What a process's fds are (for a failure message)."""
    out = []
    for fd in sorted(os.listdir(f"/proc/{pid}/fd"), key=int):
        try:
            out.append(f"{fd}:{os.readlink(f'/proc/{pid}/fd/{fd}')}")
        except OSError:
            pass
    return out


def server_figures(server: ServerProcess) -> dict:
    """What must come back to baseline: fds, memory handles, sessions (and RSS, reported)."""
    state = server.state()  # also lets the host backend forget memory nobody maps any more
    return {
        "fds": fd_count(server.pid),
        "handles": state.server_handle_count,
        "host_handles": state.host_handle_count,
        "sessions": state.sessions,
        "rss": rss_bytes(server.pid),
    }


def baseline(server: ServerProcess, sessions: int = 0) -> dict:
    """The figures once ``sessions`` sessions are left and the fd count holds
    still (the server closes a connection's socket just after its last answer,
    so a count taken at once can include one about to go)."""
    settle(server, {"sessions": sessions})
    counts: list[int] = []
    deadline = time.monotonic() + 10
    while True:
        figures = server_figures(server)
        counts = [*counts[-2:], figures["fds"]]
        if len(counts) == 3 and len(set(counts)) == 1 and figures["sessions"] == sessions:
            return figures
        if time.monotonic() > deadline:
            raise AssertionError(f"server fds never held still: {counts}")
        time.sleep(0.02)


def settle(server: ServerProcess, expected: dict, timeout: float = 10.0) -> dict:
    """Wait until fds, handles and sessions equal ``expected``'s; returns the figures."""
    keys = ("fds", "handles", "host_handles", "sessions")
    last = {}

    def matches() -> bool:
        nonlocal last
        last = server_figures(server)
        return all(last[k] == expected[k] for k in keys if k in expected)

    try:
        wait_until(matches, timeout=timeout, interval=0.02, what="server figures back to baseline")
    except AssertionError:
        wanted = {k: expected[k] for k in keys if k in expected}
        raise AssertionError(
            f"server figures {last} never matched {wanted}; fds: {fd_targets(server.pid)}"
        ) from None
    return last


# -- the log: refold what the server recorded -------------------------------------------


_folded: dict[int, tuple[int, object]] = {}  # server pid -> (last seq folded, state)


def refold(server: ServerProcess):
    """Fold the server's history (from seq 1) with the pure core, checking every
    invariant after every event, and compare the result with what the server
    reports now.  Call when no client is active.  Folds only what is new since
    the last call for the same server.  Returns the folded state."""
    seq, state = _folded.get(server.pid, (0, EMPTY_NODE))
    if seq == 0:
        assert server.history(0, 1).first_seq == 1, "refold needs the whole log (raise --event-log-retain)"
    events = server.events(seq)
    assert [e.seq for e in events] == list(range(seq + 1, seq + len(events) + 1)), "the history has gaps"
    for entry in events:
        state = fold(state, entry.to_event())  # raises InvariantViolation on an impossible event
        try:
            check_invariants(state)
        except InvariantViolation as exc:
            raise AssertionError(f"after event {entry.seq} ({entry.kind}): {exc}") from None
    if events:
        seq = events[-1].seq
    _folded[server.pid] = (seq, state)
    live = server.state()
    assert live.last_event_seq == seq, "clients were active during the refold"
    for name, layout in state.layouts.items():
        row = live.layout(name)
        ours = (layout.lock_state.value, layout.layout_hash or "", len(layout.allocations),
                len(layout.metadata), len(layout.readers), layout.writer is not None, layout.tier.value)
        theirs = (row.state, row.memory_layout_hash, row.allocation_count, row.metadata_count,
                  row.readers, row.writer, row.tier)
        assert ours == theirs, (name, ours, theirs)
    assert {r.name for r in live.layouts} == set(state.layouts), "layouts differ"
    assert live.sessions == len(state.sessions)
    return state


# -- processes and identities ------------------------------------------------------------


def spawn(script: str, *args: str, **kwargs) -> subprocess.Popen:
    """A Python script of this folder in a new process, lines on stdout."""
    return subprocess.Popen(
        [sys.executable, str(HERE / script), *map(str, args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def read_line(proc: subprocess.Popen, timeout: float = 30.0) -> str:
    import select

    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
            raise AssertionError(f"no line from pid {proc.pid} in {timeout}s")
        line = proc.stdout.readline()
        if line:
            return line
        proc.wait(5)
        raise AssertionError(f"pid {proc.pid} exited {proc.returncode}: {proc.stderr.read()[-3000:]}")


def is_root() -> bool:
    return os.geteuid() == 0


def unused_uid(start: int = 4242) -> int:
    """A uid no account has (the tests connect as it)."""
    uid = start
    while True:
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid
        uid += 1


def connect_as(path: str, uid: int) -> socket.socket:
    """A connection whose peer credentials are ``uid``'s (root only): a forked
    child drops to ``uid``, connects, and hands the socket back.  Raises the
    child's OSError when it cannot connect."""
    here, there = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the child: system calls only, then _exit
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(path)
                socket.send_fds(there, [b"ok"], [sock.fileno()])
            except OSError as exc:
                there.send(b"E%d" % exc.errno)
        finally:
            os._exit(0)
    there.close()
    try:
        message, fds, _, _ = socket.recv_fds(here, 16, 1)
    finally:
        here.close()
        os.waitpid(pid, 0)
    if fds:
        return socket.socket(fileno=fds[0])
    code = int(message[1:]) if message.startswith(b"E") else 0
    raise OSError(code, os.strerror(code) if code else "the child could not connect")


def open_dir() -> Path:
    """A 0755 folder under /tmp: other uids can reach a socket in it
    (pytest's tmp folders are 0700).  Remove it with :func:`stop`."""
    path = Path(tempfile.mkdtemp(prefix="gms-rel-", dir="/tmp"))
    path.chmod(0o755)
    return path


def stop(server: ServerProcess) -> None:
    """Kill a server started in an :func:`open_dir` folder, and remove the folder."""
    server.kill()
    shutil.rmtree(Path(server.socket).parent, ignore_errors=True)
