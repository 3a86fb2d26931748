"""Tenants cannot hurt each other or the daemon (issue 21): each attack of the
issue, by a real uid over the real socket, while a victim tenant reads.

For every attack the victim (another tenant's uid) reads a committed layout
in a loop, first quietly and then during the attack (handshake RO, list,
export every allocation, read a key, close), root probes the server (what
``gms status`` asks), and the server's RSS is sampled; the attacker's own
figures say what it got.  Recorded: the victim's p50/p99 quiet and under
attack, the probes' worst time, RSS against the bound the server was
configured with, and the attacker's refusals.  Asserted: the victim never
fails and its p99 stays within a generous multiple of the quiet one (the
figures say how close to 2x it really is; this is a shared 2-core box), every
probe answers within a second, RSS stays within the configured bounds, and
the attacker gets the typed refusal that names the limit.

Every attack runs twice: against the daemon as ``gms serve`` starts it (a
keeper holding the node, which sees every event and every value), and
against a server alone (``--no-keeper``).  RSS is the daemon's: the keeper,
the server and its copier together.

Needs root (it runs processes as other uids); CI runs the suite as root.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import threading
import time
import urllib.request

import pytest

from gms.client import admin
from gms.client.probes import get_event_history, get_runtime_state
from gms.wire import messages as m

from ..helpers import (
    MiB,
    RawConn,
    ServerProcess,
    build_layout,
    connect_as,
    state_or_none,
    wait_until,
)
from .common import daemon_rss, is_root, open_dir, record, scale, summary_ms
from .tenants import (
    AsUid,
    allocation_flood,
    connection_flood,
    cpu_hog,
    layout_flood,
    metadata_churn,
    metadata_fill,
    metadata_flood,
    partial_frames,
    reader_loop,
    trickled_scans,
    unread_scans,
)

pytestmark = pytest.mark.skipif(not is_root(), reason="needs root to run tenants as other uids")

VICTIM, ATTACKER, HOG, STRANGER = 26001, 26002, 26003, 26999
QUIET_S = scale(1.5, 20.0)  # as long as the attack: a p99 of as many reads
ATTACK_S = scale(3.0, 20.0)
METADATA_QUOTA = 4 * MiB
MAX_LAYOUTS = 8
EVENT_LOG_BYTES = 8 * MiB
PER_UID = 32
SLACK = 48 * MiB  # the interpreter's own churn: what RSS may move by with nothing to hold
POLICY = f"""
[[tenant]]
name = "victim"
uids = [{VICTIM}]
write = ["v-*", "shared"]
quota = "64MiB"

[[tenant]]
name = "attacker"
uids = [{ATTACKER}]
write = ["x-*"]
read = ["shared"]
quota = "64MiB"
metadata_quota = "{METADATA_QUOTA}"
max_layouts = {MAX_LAYOUTS}

[[tenant]]
name = "hog"
uids = [{HOG}]
write = ["y-*"]
"""
ARGS = (
    "--socket-mode", "666", "--host-capacity", "4GiB", "--max-metadata-bytes", "32MiB",
    "--event-log-bytes", str(EVENT_LOG_BYTES), "--handshake-timeout", "1", "--max-connections-per-uid",
    str(PER_UID), "--log-level", "info",
)


# The daemon as `gms serve` runs it (a keeper beside the server) always; the server
# alone (--no-keeper) too in the long mode (GMS_RELIABILITY=long): the same server
# code, without the keeper's copy of every event.
@pytest.fixture(params=scale(["keeper"], ["keeper", "no-keeper"]))
def start(request):
    started: list[tuple[ServerProcess, object]] = []
    keeper = request.param == "keeper"

    def start(*extra: str, preexec_fn=None, policy: str = POLICY) -> ServerProcess:
        folder = open_dir()
        (folder / "policy.toml").write_text(policy)
        # under the keeper, its spare started soon (not 2 s after): the suite waits for it
        soon = ("--spare-after", "0.2") if keeper else ()
        server = ServerProcess(
            folder, *ARGS, *soon, "--policy", str(folder / "policy.toml"), *extra, preexec_fn=preexec_fn,
            keeper=keeper,
        )
        started.append((server, folder))
        publish_victim(server)
        if keeper:  # the daemon as it runs by default: its spare standing by (gms.keeper.spare)
            server.wait_for_spare()
        return server

    yield start
    for server, folder in started:
        server.kill()
        shutil.rmtree(folder, ignore_errors=True)


def publish_victim(server: ServerProcess) -> None:
    for layout in ("v-model", "shared"):
        conn = connect_as(server.socket, VICTIM)
        assert conn.handshake("RW", layout=layout).success
        build_layout(conn, sizes=(2 * MiB, 2 * MiB))
        assert conn.call(m.CommitRequest()).success
        conn.close()


class Watch:
    """Root's probes (what ``gms status`` asks) and the server's RSS, every 50 ms."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.probes: list[float] = []
        self.rss: list[int] = []
        self.failures: list[str] = []
        self.metadata: dict[str, int] = {}  # the most each tenant kept
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.rss.append(daemon_rss(self.server))
            started = time.perf_counter()
            try:
                state = get_runtime_state(self.server.socket, timeout=5)
            except Exception as exc:  # noqa: BLE001 - a failed probe fails the test
                self.failures.append(repr(exc))
                continue
            finally:
                self.probes.append(time.perf_counter() - started)
            for row in state.tenants:
                self.metadata[row.name] = max(self.metadata.get(row.name, 0), row.metadata_bytes)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def attack(server: ServerProcess, attacker_uid: int, workload, *args) -> tuple[dict, dict, dict, Watch]:
    """The victim quiet, then the victim and the attacker at once; returns
    (quiet, under attack, the attacker's result, the watch)."""
    quiet = AsUid(VICTIM, reader_loop, server.socket, "v-model", QUIET_S)
    quiet.go()
    quiet = quiet.result()
    victim = AsUid(VICTIM, reader_loop, server.socket, "v-model", ATTACK_S)
    attacker = AsUid(attacker_uid, workload, server.socket, *args)
    with Watch(server) as watch:  # a thread: started after the forks
        attacker.go()
        victim.go()
        hit = victim.result(ATTACK_S + 60)
        got = attacker.result(ATTACK_S + 60)
    got["cpu_s"] = attacker.cpu_s
    return quiet, hit, got, watch


def victim_figures(quiet: dict, hit: dict, got: dict, watch: Watch, base_rss: int, bound_rss: int) -> dict:
    """Assert what the issue asks of a victim under attack; return the figures."""
    assert quiet["error_count"] == 0, quiet["errors"]
    assert hit["error_count"] == 0, hit["errors"]
    assert hit["latencies"], "the victim read nothing under attack"
    calm, loud = summary_ms(quiet["latencies"]), summary_ms(hit["latencies"])
    ratio = loud["p99_ms"] / calm["p99_ms"]
    # The figure is 2x; a shared 2-core box gives its CPU to the attacker
    # too, so the assertion is generous and the ratio is recorded.
    assert loud["p99_ms"] <= 10 * calm["p99_ms"] + 50, (calm, loud)
    assert not watch.failures, watch.failures[:3]
    assert max(watch.probes) < 1.0, f"a status probe took {max(watch.probes):.3f} s"
    assert max(watch.rss) <= bound_rss, f"RSS {max(watch.rss) >> 20} MiB past its bound {bound_rss >> 20} MiB"
    return {
        "setup": "keeper" if watch.server.keeper else "no-keeper",
        "victim_quiet_p50_ms": calm["p50_ms"], "victim_quiet_p99_ms": calm["p99_ms"],
        "victim_attack_p50_ms": loud["p50_ms"], "victim_attack_p99_ms": loud["p99_ms"],
        "p99_ratio": round(ratio, 2), "victim_reads": loud["count"], "victim_errors": 0,
        "status_probes": len(watch.probes), "status_max_ms": round(max(watch.probes) * 1000, 1),
        "rss_before_mib": round(base_rss / MiB, 1), "rss_max_mib": round(max(watch.rss) / MiB, 1),
        "rss_bound_mib": round(bound_rss / MiB, 1), "attacker_cpu_s": got["cpu_s"],
    }


# -- the attacks ----------------------------------------------------------------------------


def test_a_neighbour_that_only_computes_sets_the_floor(start):
    """Not an attack on gms: a process of another uid that keeps one core busy
    and sends nothing.  What it does to the victim is what sharing the box
    costs, whatever the daemon does: each attack's ratio is read against it."""
    server = start()
    base = daemon_rss(server)
    quiet, hit, got, watch = attack(server, ATTACKER, cpu_hog, ATTACK_S)
    figures = victim_figures(quiet, hit, got, watch, base, base + SLACK)
    # It ran (how much CPU a loaded host grants it is the host's, not gms's: issue 63
    # saw 0.41 s of 3 at load 4.6-7.9, and the victim's figures are what is recorded).
    assert got["spins"] > 0, got
    record("isolation", "control: a neighbour computing, no requests", **figures)


def test_a_metadata_flood_is_held_to_the_tenants_metadata_quota(start):
    """The issue: 2,000 values of 1 MiB took the server from 35 MB to 2.08 GB."""
    server = start()
    base = daemon_rss(server)
    quiet, hit, got, watch = attack(server, ATTACKER, metadata_flood, ATTACK_S, MiB)
    bound = base + METADATA_QUOTA + EVENT_LOG_BYTES * 17 // 16 + SLACK
    figures = victim_figures(quiet, hit, got, watch, base, bound)
    first = got["first_refusal"]
    assert (first["code"], first["limit"], first["scope"], first["quota"]) == (
        "LIMIT_EXCEEDED", "metadata_quota", "tenant", METADATA_QUOTA,
    ), first
    assert first["used"] + first["asked"] > METADATA_QUOTA and first["asked"] >= MiB
    state = server.state()
    assert 3 * MiB < watch.metadata["attacker"] <= METADATA_QUOTA, watch.metadata
    assert state.event_log_bytes <= EVENT_LOG_BYTES * 17 // 16 + 2 * MiB, state.event_log_bytes
    assert state.first_event_seq > 1, "the log was cut by bytes"
    assert server.layout("v-model").committed
    record("isolation", "metadata RAM flood", attacker_puts=got["puts"], attacker_refusals=got["refusals"],
           refusal=f"{first['code']} {first['limit']} used {first['used']} asked {first['asked']} "
                   f"of {first['quota']}", attacker_metadata_max_mib=round(watch.metadata["attacker"] / MiB, 2),
           event_log_mib=round(state.event_log_bytes / MiB, 2), **figures)


def test_a_connection_flood_by_a_stranger_is_capped_and_admins_still_get_in(start):
    """The issue: ~21,000 idle connections from a uid with no tenant filled the fd table."""
    server = start()
    base = daemon_rss(server)
    base_fds = server.open_fds()
    quiet, hit, got, watch = attack(server, STRANGER, connection_flood, ATTACK_S)
    # Each connection the cap lets in: a socket, a task, a read buffer and at most a 64 KiB frame.
    bound = base + PER_UID * 160 * 1024 + SLACK
    figures = victim_figures(quiet, hit, got, watch, base, bound)
    first = got["first_refusal"]
    assert (first["code"], first["limit"], first["scope"], first["quota"]) == (
        "LIMIT_EXCEEDED", "max_connections_per_uid", "uid", PER_UID,
    ), first
    assert got["refused"] > 0 and got["closed_idle"] > 0, got
    # Admins are never held to the cap: root opens more than a stranger may.
    admins = [RawConn(server.socket) for _ in range(PER_UID + 8)]
    assert admins[-1].call(m.GetRuntimeStateRequest()).sessions >= 0
    for conn in admins:
        conn.close()
    wait_until(lambda: server.open_fds() <= base_fds + 2, what="the flood's fds closed")
    lines = server.log.count("refused a connection from uid")
    summaries = len(re.findall(r"more like this in the last", server.log))
    assert lines <= 4 * (ATTACK_S / 10 + 1), f"{lines} refusal lines for {got['refused']} refusals"
    record("isolation", "connection flood by a non-tenant uid", attacker_connected=got["connected"],
           attacker_refused=got["refused"], attacker_closed_idle=got["closed_idle"],
           refusal=f"{first['code']} {first['limit']} used {first['used']} of {first['quota']}",
           refusal_log_lines=lines, summary_lines=summaries, **figures)


def test_half_sent_big_frames_are_read_a_few_at_a_time(start):
    """Not in the issue, found building it: after a handshake a connection may
    send a frame up to --max-frame-bytes (16 MiB), and the server holds what it
    has read of it.  32 sessions each sending 16 MiB less 4 KiB and never the
    rest would make the server hold 512 MiB no quota counts; only two of a
    uid's connections read past 128 KiB at once (gms.server.edge.inflight)."""
    server = start()
    base = daemon_rss(server)
    quiet, hit, got, watch = attack(server, ATTACKER, partial_frames, ATTACK_S, PER_UID, 16 * MiB)
    assert got["sessions"] == PER_UID, got
    bound = base + 2 * 2 * 16 * MiB + PER_UID * 160 * 1024 + SLACK
    figures = victim_figures(quiet, hit, got, watch, base, bound)
    record("isolation", "half-sent big frames from every connection of a uid", attacker_sessions=got["sessions"],
           attacker_sent_mib=got["sent_mib"], would_hold_mib=PER_UID * 16, **figures)


def lower_fd_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


def test_a_writers_fd_flood_is_refused_at_once_and_readers_keep_reading(start):
    """The issue: ~20,000 allocations of 2 MiB, then the next one waited forever
    as if out of memory.  The server here runs with 1024 fds (as a small limit
    makes the flood short): memory may take three quarters of 1024 less the
    reserve, and the rest stays for readers' exports and admins."""
    server = start(preexec_fn=lower_fd_limit)
    base = daemon_rss(server)
    since = server.state().last_event_seq
    quiet, hit, got, watch = attack(server, HOG, allocation_flood, "y-fds", ATTACK_S)
    bound = base + 2 * EVENT_LOG_BYTES + SLACK
    figures = victim_figures(quiet, hit, got, watch, base, bound)
    refusal = got["refusal"]
    assert (refusal["code"], refusal["limit"], refusal["scope"]) == ("RESOURCE_EXHAUSTED", "fds", "node"), refusal
    assert got["again"]["code"] == "RESOURCE_EXHAUSTED"
    reserve = min(256, max(16, 1024 // 8))
    assert got["made"] <= (1024 - reserve) * 3 // 4 and got["made"] > 500, got["made"]
    assert got["refusal_s"] < 1.0, "refused at once, not waited out"
    kinds = [e.kind for e in server.events(since)]
    assert "ALLOCATION_OOM_WAIT" not in kinds, "never an out-of-memory wait"
    wait_until(lambda: server.state().server_handle_count == 4, what="the hog's memory released")
    record("isolation", "one writer's fd flood via tiny allocations", server_fd_limit=1024,
           attacker_allocations=got["made"], refusal=f"{refusal['code']} {refusal['limit']} used {refusal['used']} "
           f"asked {refusal['asked']} of {refusal['quota']}", refusal_ms=round(got["refusal_s"] * 1000, 2),
           oom_waits=0, **figures)


def test_a_layout_table_flood_is_held_to_the_tenants_max_layouts(start):
    """The issue: one tenant committed 4,096 empty layouts in 1.6 s; everyone else
    then got LIMIT_EXCEEDED for any new layout.  Also: each layout's Prometheus
    series goes with the layout."""
    server = start("--metrics-port", "0")
    port = wait_until(lambda: metrics_port(server), what="the metrics port")
    base = daemon_rss(server)
    quiet, hit, got, watch = attack(server, ATTACKER, layout_flood, ATTACK_S)
    figures = victim_figures(quiet, hit, got, watch, base, base + SLACK)
    first = got["first_refusal"]
    assert got["committed"] == MAX_LAYOUTS, got
    assert (first["code"], first["limit"], first["scope"], first["used"], first["asked"], first["quota"]) == (
        "LIMIT_EXCEEDED", "max_layouts", "tenant", MAX_LAYOUTS, 1, MAX_LAYOUTS,
    ), first
    # Another tenant still makes new layouts.
    conn = connect_as(server.socket, VICTIM)
    assert conn.handshake("RW", layout="v-new").success
    conn.close()
    assert series(port, "x-") == MAX_LAYOUTS, "a load series per committed layout"
    for n in range(MAX_LAYOUTS):
        assert admin.evict(server.socket, f"x-{n}").tier == "none"  # unpinned: dropped
    assert series(port, "x-") == 0, "the layouts went, and their series with them"
    assert series(port, "v-") == 1 and series(port, "shared") == 1, "the victim's are untouched"
    assert server.state().tenant("attacker").layouts == 0
    again = AsUid(ATTACKER, layout_flood, server.socket, 0)
    again.go()
    assert again.result()["committed"] == 1, "room again once its layouts went"
    record("isolation", "layout-table flood", attacker_committed=got["committed"],
           attacker_refused=got["refused"], refusal=f"{first['code']} {first['limit']} used {first['used']} "
           f"of {first['quota']}", x_series_after_eviction=0, **figures)


def test_a_tenant_churning_big_values_costs_the_daemon_twice_what_it_stores(start):
    """Issue 32: 1 MiB values replaced again and again within the tenant's quota.
    With the keeper a neighbour's p99 was 150 ms (3 ms without) and 63 MiB of
    values grew the daemon by 165-435 MiB: the keeper re-sent the whole state
    as its base, and its sends blocked the loop.  Now the keeper's base is
    replaced a part at a time (what changed), its events since are bounded, a
    request that adds much waits for the keeper, others never; so the daemon
    holds the state twice (the server's, the keeper's) plus fixed bounds."""
    from gms.keeper.store import HISTORY_BYTES
    from gms.server.restart.mirror import BACKLOG_BYTES, MIN_TAIL_BYTES, TAIL_BOUND_BYTES

    keys = 48
    server = start("--max-metadata-bytes", "128MiB", policy=POLICY.replace(
        f'metadata_quota = "{METADATA_QUOTA}"', 'metadata_quota = "64MiB"'))
    base = daemon_rss(server)
    quiet, hit, got, watch = attack(server, ATTACKER, metadata_churn, ATTACK_S, MiB, keys)
    stored = max(watch.metadata.get("attacker", 0), keys * MiB)
    # The keeper also keeps the events its bases left behind, for the history
    # across a restart (issue 59): bounded by HISTORY_BYTES.
    fixed = (EVENT_LOG_BYTES * 17 // 16 + TAIL_BOUND_BYTES + BACKLOG_BYTES + MIN_TAIL_BYTES + HISTORY_BYTES
             + 64 * MiB + SLACK)
    figures = victim_figures(quiet, hit, got, watch, base, base + 2 * stored + fixed)
    assert got["refusals"] == 0 and got["puts"] > 2 * keys, got
    record("isolation", "metadata churn within the quota (1 MiB values)", attacker_puts=got["puts"],
           stored_mib=round(stored / MiB, 1), rss_growth_mib=round((max(watch.rss) - base) / MiB, 1),
           growth_per_stored=round((max(watch.rss) - base) / stored, 2), **figures)


@pytest.mark.parametrize("reads", ["nothing", "a trickle"])
def test_unread_answers_cannot_hold_a_take_over_nor_pause_the_server(start, reads):
    """Issue 32: a tenant that pipelined two big metadata scans and read none of the
    answers froze every session for ~30 s at a take-over's quiet point (a send
    never parks), and the take-over failed after 31.7 s.  Issue 48: one that read
    them as a trickle (40 KiB every 0.1 s) did the same, the "moved no byte" rule
    blind to it.  Now an answer still being sent 0.5 s after the pause loses its
    client (quiesce.STUCK_S), however it reads: the take-over waits no longer."""
    from gms.server.service.quiesce import STUCK_S

    server = start()
    writer = connect_as(server.socket, VICTIM)
    assert writer.handshake("RW", layout="shared").success
    (allocation,) = build_layout(writer, sizes=(2 * MiB,))
    for n in range(14):
        assert writer.call(m.MetadataPutRequest(f"big{n}", allocation.allocation_id, 0, bytes([n]) * MiB)).success
    assert writer.call(m.CommitRequest()).success
    writer.close()
    scans = unread_scans if reads == "nothing" else trickled_scans
    attacker = AsUid(ATTACKER, scans, server.socket, 6.0, "shared", 2)
    victim = AsUid(VICTIM, reader_loop, server.socket, "v-model", 5.0)
    attacker.go()
    victim.go()
    time.sleep(1.0)
    old_pid = server.state().pid
    started = time.monotonic()
    new = ServerProcess(server.tmp_path, "--take-over", "--handover-timeout", "30", socket_path=server.socket,
                        keeper=server.keeper)
    wait_until(lambda: new.state().pid != old_pid, timeout=40, what="the new server serving")
    took = time.monotonic() - started
    try:
        hit = victim.result(60)
        attacker.result(60)
        assert hit["error_count"] == 0, hit["errors"]
        slowest = max(hit["latencies"])
        # (was: every session paused until the attacker left, or the take-over gave up)
        assert took < 10 and slowest < 3, (took, slowest)
        assert f"within {STUCK_S:g} s of a take-over's pause" in server.log, "the old server dropped that client"
        record("isolation", f"big answers read as {reads} at a take-over",
               setup="keeper" if server.keeper else "no-keeper", take_over_s=round(took, 2),
               victim_slowest_ms=round(slowest * 1000, 1), victim_reads=len(hit["latencies"]))
    finally:
        new.kill()


# What a tenant at its default metadata quota may add to a restart and to a take-over's
# pause (docs/reliability.md): about 250,000 small entries, measured at 1.7 s and 1.9 s
# on the 2-core host; asserted with room for a loaded CI box.
STORED_BOUND_S = 8.0


def test_what_a_tenant_may_store_bounds_a_restart_and_a_take_over(start):
    """Issue 48: 2 million 6-byte entries (12 MB: 18% of the default metadata quota,
    when an entry was charged its bytes alone) grew the daemon to 1.3 GiB, and a
    SIGKILL then served again after 29.8 s, a take-over paused every tenant 37.2 s.
    Now an entry is charged its own cost too (Limits.metadata_entry_bytes): a tenant
    at the default 64 MiB quota stores about 250,000 (the CI run: a quarter of the
    quota), and a restart and a take-over's pause stay within STORED_BOUND_S."""
    from gms.fsm import Limits

    quota = scale(16 * MiB, Limits().tenant_metadata_quota)
    policy = POLICY.replace(f'metadata_quota = "{METADATA_QUOTA}"', f"metadata_quota = {quota}")
    server = start("--max-metadata-bytes", "1GiB", policy=policy)
    filler = AsUid(ATTACKER, metadata_fill, server.socket, "x-entries")
    filler.go()
    got = filler.result(600)
    first = got["first_refusal"]
    assert (first["limit"], first["scope"]) == ("metadata_quota", "tenant"), first
    per_entry = Limits().metadata_entry_bytes
    assert got["entries"] * per_entry < quota < got["entries"] * (per_entry + 16), got["entries"]
    wait_until(lambda: server.state().keeper != "behind", timeout=60, what="the keeper caught up")

    old = server.state().pid
    killed_at = time.monotonic()
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: (s := state_or_none(server.socket)) and s.pid != old, timeout=120, interval=0.005,
               what="the next server")
    restart_s = time.monotonic() - killed_at
    assert server.layout("x-entries").committed

    victim = AsUid(VICTIM, reader_loop, server.socket, "v-model", 6.0)
    victim.go()
    time.sleep(1.0)
    old = server.state().pid
    new = ServerProcess(server.tmp_path, "--take-over", "--handover-timeout", "60", socket_path=server.socket,
                        keeper=server.keeper)
    try:
        wait_until(lambda: new.state().pid != old, timeout=120, what="the new server serving")
        hit = victim.result(120)
        assert hit["error_count"] == 0, hit["errors"]
        pause_s = max(hit["latencies"])
        assert restart_s < STORED_BOUND_S and pause_s < STORED_BOUND_S, (restart_s, pause_s)
        record("isolation", "a tenant's metadata at its quota: restart and take-over", entries=got["entries"],
               quota_mib=quota // MiB, restart_s=round(restart_s, 2), take_over_pause_s=round(pause_s, 2))
    finally:
        new.kill()


def metrics_port(server: ServerProcess) -> int | None:
    found = re.search(r"metrics on http://[^:]+:(\d+)/metrics", server.log)
    return int(found.group(1)) if found else None


def series(port: int, prefix: str) -> int:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return len(re.findall(rf'^gms_layout_transitions_total{{[^}}]*layout="{re.escape(prefix)}', text, re.M))


# -- a tenant's history is its own ---------------------------------------------------------


def history_as(server: ServerProcess, uid: int) -> list[dict]:
    conn = connect_as(server.socket, uid)
    try:
        page = conn.call(m.GetEventHistoryRequest(0, 10_000))
    finally:
        conn.close()
    assert isinstance(page, m.GetEventHistoryResponse), page
    return page.events


def test_a_tenants_history_shows_only_what_it_may_read(start):
    server = start()
    stranger = connect_as(server.socket, STRANGER)
    assert stranger.handshake("RO", layout="v-model").code == "PERMISSION_DENIED"
    stranger.close()
    victim = connect_as(server.socket, VICTIM)
    assert victim.handshake("RW", layout="x-not-yours").code == "PERMISSION_DENIED"
    victim.close()
    everything = [e.kind for e in get_event_history(server.socket, 0, 10_000).events]
    assert everything.count("SESSION_REFUSED") == 2
    mine = history_as(server, ATTACKER)
    kinds = [e["kind"] for e in mine]
    assert "SESSION_REFUSED" not in kinds, "other peers' refusals"
    assert not [e for e in mine if e["layout"].startswith("v-")], "layouts it may not read"
    (started,) = [e for e in mine if e["kind"] == "SERVER_STARTED"]
    assert set(started["quotas"]) == {"attacker"} and set(started["tenant_limits"]) == {"attacker"}
    shared = [e for e in mine if e["layout"] == "shared" and e["kind"] == "SESSION_OPENED"]
    assert shared and all(e["uid"] is None and e["pid"] is None for e in shared), "another tenant's identity"
    # Its own refusal it does see.
    own = connect_as(server.socket, ATTACKER)
    assert own.handshake("RW", layout="v-model").code == "PERMISSION_DENIED"
    own.close()
    refused = [e for e in history_as(server, ATTACKER) if e["kind"] == "SESSION_REFUSED"]
    assert [e["uid"] for e in refused] == [ATTACKER]
    record("isolation", "history filtered for a tenant", events_admin=len(everything), events_tenant=len(mine),
           foreign_refusals_shown=0, foreign_quotas_shown=0)


# -- refusals answered late to a uid that keeps asking ------------------------------------


def test_a_tenant_refused_again_and_again_is_answered_later_and_later(start):
    """gms/server/edge/tarpit.py: past its first refusals in a second, each of the
    attacker's refused handshakes is answered DELAY_S late (the layout-table
    flood's figures before and after: docs/reliability.md); the refusal is the same."""
    from gms.server.edge.tarpit import DELAY_S, FREE_PER_S

    server = start()
    for n in range(MAX_LAYOUTS):
        conn = connect_as(server.socket, ATTACKER)
        assert conn.handshake("RW", layout=f"x-{n}").success
        assert conn.call(m.CommitRequest("unpinned")).success
        conn.close()
    sent, took, codes = [], [], set()
    for n in range(FREE_PER_S + 24):
        conn = connect_as(server.socket, ATTACKER)
        started = time.monotonic()
        conn.send(m.HandshakeRequest("RW", 5000, f"x-new-{n}"))
        answer, _ = conn.recv(30)
        sent.append(started)
        took.append(time.monotonic() - started)
        codes.add((answer.code, answer.limit))
        conn.close()
    assert codes == {("LIMIT_EXCEEDED", "max_layouts")}
    # The tarpit's seconds, as it counts them: past FREE_PER_S refusals in one,
    # each waits (those near a second's end are left out: the two clocks differ).
    must_wait, window, count = [], sent[0], 0
    for n, at in enumerate(sent):
        if at - window >= 1.0:
            window, count = at, 0
        count += 1
        if count > FREE_PER_S and at - window < 0.9:
            must_wait.append(n)
    assert must_wait, "the refusals came faster than FREE_PER_S a second"
    assert all(took[n] >= DELAY_S for n in must_wait), [round(took[n], 4) for n in must_wait]
