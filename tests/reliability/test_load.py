"""Load and churn against one real server, and its event log under that load.

* 256 clients (8 processes of 32 threads) connect, handshake, read metadata,
  export every allocation and disconnect, over and over;
* one reader exports allocations one at a time, 100,000 times (long mode);
* one writer allocates and frees, 10,000 times (long mode);
* the event log, with ``--event-log-retain`` small enough to be cut many
  times: it stays within its bound, the retained history is contiguous and
  the server's RSS stays flat; and a retained log (the server's own
  ``EventLog`` with its snapshot, driven in-process by the same kind of churn)
  replays to exactly the live state.

Every figure is recorded: errors (must be 0), ms p50/p99/max, server RSS and
fds before and after (fds, handles and sessions must come back to baseline).
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from gms import GMSClientMemoryManager
from gms.cuda.host import HostBackend
from gms.fsm import RequestedLockType, check_invariants
from gms.server.assembly import open_core
from gms.store import EventLog
from gms.system.peer import Peer
from gms.wire import messages as m

from ..helpers import ServerProcess
from .common import baseline, read_line, record, rss_bytes, scale, settle, spawn, summary_ms
from .test_crash import commit_pattern

RETAIN = scale(2048, 50_000)
CHUNK = 4096  # the server's EventLog chunk size: between RETAIN and RETAIN + CHUNK entries are kept
CLIENTS, PROCESSES = 256, 8
CHURN_S = scale(4, 60)
EXPORTS = scale(5_000, 100_000)
CYCLES = scale(1_000, 10_000)
MiB = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("load"), "--event-log-retain", str(RETAIN))
    commit_pattern(server, "churn", "churn")
    yield server
    server.kill()


class RssSampler:
    """The server's RSS every 100 ms while a load runs."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.samples.append(rss_bytes(self.pid))

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def mib(n: int) -> float:
    return round(n / MiB, 1)


def log_figures(server) -> dict:
    """The retained log: within its bound, and contiguous from first_seq."""
    state = server.state()
    first, last = state.first_event_seq, state.last_event_seq
    kept = last - first + 1
    assert kept <= RETAIN + CHUNK, f"{kept} events kept with --event-log-retain {RETAIN}"
    if last > RETAIN + CHUNK:
        assert first > 1 and kept >= RETAIN, (first, last)
    seqs = [e.seq for e in server.events(first - 1) if e.seq <= last]
    assert seqs == list(range(first, last + 1)), "the retained history has gaps"
    return {"log_first_seq": first, "log_last_seq": last, "log_kept": kept}


def figures_row(base: dict, after: dict, sampler: RssSampler) -> dict:
    return {
        "rss_before_mib": mib(base["rss"]), "rss_after_mib": mib(after["rss"]),
        "rss_max_mib": mib(max(sampler.samples or [after["rss"]])),
        "fds_before": base["fds"], "fds_after": after["fds"],
        "handles_before": base["handles"], "handles_after": after["handles"],
    }


def test_256_clients_churn(server):
    base = baseline(server)
    workers = [spawn("churn_worker.py", server.socket, "churn", CLIENTS // PROCESSES, CHURN_S)
               for _ in range(PROCESSES)]
    try:
        time.sleep(0.5)  # let every worker import
        with RssSampler(server.pid) as sampler:
            for worker in workers:
                worker.stdin.write("go\n")
                worker.stdin.flush()
            results = [json.loads(read_line(worker, timeout=CHURN_S + 300)) for worker in workers]
        for worker in workers:
            worker.wait(30)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    after = settle(server, base, timeout=30)
    durations = [d for r in results for d in r["durations"]]
    errors = sum(r["errors"] for r in results)
    record("load", f"{CLIENTS} clients churning for {CHURN_S} s", errors=errors, cycles=len(durations),
           cycles_per_s=round(len(durations) / CHURN_S), **summary_ms(durations),
           **figures_row(base, after, sampler), **log_figures(server))
    assert errors == 0, [e for r in results for e in r["first_errors"]]
    assert len(durations) >= CLIENTS, "every client got through at least once"


def test_exports_by_one_reader(server):
    base = baseline(server)
    with RssSampler(server.pid) as sampler, GMSClientMemoryManager(server.socket, layout="churn") as reader:
        reader.connect("RO")
        ids = [h.allocation_id for h in reader.list_handles()]
        durations = []
        for n in range(EXPORTS):
            started = time.perf_counter()
            fd = reader.export_handle(ids[n % len(ids)])
            durations.append(time.perf_counter() - started)
            os.close(fd)
    after = settle(server, base, timeout=30)
    record("load", f"{EXPORTS} exports by one reader", errors=0, **summary_ms(durations),
           **figures_row(base, after, sampler))


def test_allocate_free_cycles_by_one_writer(server):
    base = baseline(server)
    with RssSampler(server.pid) as sampler, GMSClientMemoryManager(server.socket, layout="cycles") as writer:
        writer.connect("RW")
        durations = []
        for _ in range(CYCLES):
            started = time.perf_counter()
            allocation_id, _ = writer.allocate_handle(2 * MiB, "w")
            assert writer.free_handle(allocation_id)
            durations.append(time.perf_counter() - started)
    after = settle(server, base, timeout=30)
    record("load", f"{CYCLES} allocate/free cycles by one writer", errors=0, **summary_ms(durations),
           **figures_row(base, after, sampler), **log_figures(server))


def test_the_event_log_stays_within_its_retention(server):
    """Append well past the bound; the kept count, the history and the RSS stay bounded."""
    with GMSClientMemoryManager(server.socket, layout="log") as writer:
        writer.connect("RW")
        rss = []
        target = server.state().last_event_seq + 3 * (RETAIN + CHUNK)
        while server.state().last_event_seq < target:
            for _ in range(500):
                writer.free_handle(writer.allocate_handle(2 * MiB, "w")[0])
            rss.append(rss_bytes(server.pid))
    figures = log_figures(server)
    assert figures["log_first_seq"] > 1
    # Flat once the log is at its bound: the last third grows by little.
    third = rss[len(rss) * 2 // 3:]
    growth = max(third) - min(third)
    record("load", f"event log, --event-log-retain {RETAIN}", errors=0, **figures,
           rss_mib_first=mib(rss[0]), rss_mib_last=mib(rss[-1]), rss_growth_last_third_mib=mib(growth))
    assert growth < 32 * MiB, f"RSS still grows by {growth / MiB:.0f} MiB at the log's bound"


async def test_a_retained_log_replays_to_the_live_state():
    """The server's own EventLog under churn, cut by retention many times:
    replaying what it keeps over its snapshot equals its live state (a client
    cannot check this: the snapshot never leaves the server)."""
    retain, chunk = 500, 64
    core = await open_core(HostBackend(), log=EventLog(retain=retain, chunk_size=chunk))
    peer = Peer(os.getpid(), os.getuid(), os.getgid())
    granted = []
    checks = 0
    for n in range(scale(3_000, 30_000)):
        conn = core.new_conn()
        layout = f"l{n % 3}"
        lock = RequestedLockType.RW if n % 10 == 0 else RequestedLockType.RW_OR_RO
        core.handshake(conn, m.HandshakeRequest(lock.value, 0, layout), peer, granted.append)
        if core.state.layout(layout).writer == conn:
            allocation = await core.placement.allocate(conn, 2 * MiB, "w")
            core.requests.metadata_put(conn, m.MetadataPutRequest("k", allocation.allocation_id, 0, b"v"))
            if n % 4:
                core.requests.commit(conn, m.CommitRequest())
        elif conn in core.state.layout(layout).readers:
            core.requests.list_allocations(conn, m.ListAllocationsRequest())
        core.disconnect(conn)
        if n % 97 == 0:
            assert core.log.replay() == core.state
            check_invariants(core.state)
            assert len(core.log) <= retain + chunk
            checks += 1
    assert core.log.first_seq > 1
    assert core.log.replay() == core.state
    record("load", "retained log replays to the live state (in-process)", errors=0,
           events=core.log.last_seq, kept=len(core.log), replays_checked=checks + 1)
    await core.aclose()
