"""The coordinator's pure parts: judging probes, its configuration, pods as the
Kubernetes API describes them (no API server runs here: these are the
documented Pod fields, camelCase as the API returns them), and the lock spec."""

from __future__ import annotations

import pytest

pytest.importorskip("httpx")

from gms.failover import config as cfg
from gms.failover.coordinator import Failover, make_lock
from gms.failover.health import Probe, Watch, gms_reports, observe
from gms.failover.lock import FileServingLock
from gms.failover.sets import pod_running, pods_by_rank


def _bench(*names: str) -> list:
    """Modules of bench/, imported with that folder first on the path (then the path as it was)."""
    import importlib
    import sys
    from pathlib import Path

    bench = str(Path(__file__).resolve().parent.parent / "bench")
    sys.path.insert(0, bench)
    try:
        return [importlib.import_module(name) for name in names]
    finally:
        sys.path[:] = [p for p in sys.path if p != bench]


def probe(ok: bool, started: float = 0.0) -> Probe:
    return Probe("http://x", ok, "serving" if ok else None, "", started, 0.01)


def test_a_set_fails_after_enough_bad_rounds_in_a_row_and_one_bad_rank_spoils_a_round():
    watch, failed = observe(Watch(), [probe(True), probe(False, 5.0)], failures=2)
    assert (watch.streak, watch.first_bad, failed) == (1, 5.0, False)
    watch, failed = observe(watch, [probe(True), probe(False, 6.0)], failures=2)
    assert (watch.streak, watch.first_bad, failed) == (2, 5.0, True)  # detection counts from the first
    watch, failed = observe(Watch(1, 3.0), [probe(True), probe(True)], failures=2)
    assert (watch, failed) == (Watch(), False)  # a good round forgives


def test_what_ranks_say_of_their_gms_connections_makes_an_event_when_it_changes():
    def said(url, notes):
        return Probe(url, True, "serving", "", 0.0, 0.01, notes)

    restart = {"weights": "rode through", "kv_cache": "rebuilt"}
    seen, news = gms_reports({}, [said("a", {}), said("b", restart)])
    assert [p.url for p in news] == ["b"]  # silence is no news
    seen, news = gms_reports(seen, [said("a", {}), said("b", restart)])
    assert news == []  # said once is enough
    seen, news = gms_reports(seen, [said("a", {}), said("b", {})])
    assert news == [] and seen["b"] == {}  # back to nothing to say (a wake): no line
    _, news = gms_reports(seen, [said("b", {"weights": "stale: gone"})])
    assert [p.gms for p in news] == [{"weights": "stale: gone"}]


def test_failover_phases_add_up():
    f = Failover("A", "B", "test", first_bad=1.0, decided=2.0,
                 marks={"revoke": 2.5, "lock": 2.6, "wake": 4.0, "first_token": 4.5})
    phases = f.phases()
    assert phases == pytest.approx({"detect_s": 1.0, "revoke_s": 0.5, "lock_s": 0.1, "wake_s": 1.4,
                                    "first_token_s": 0.5, "total_s": 2.5})


def test_configuration_is_checked():
    base = {"ranks": ["/s0", "/s1"], "sets": {
        "A": {"kind": "local", "ports": [1, 2], "command": ["x"]},
        "B": {"kind": "kubernetes", "namespace": "llm", "selector": "set=B"}}}
    c = cfg.parse(base)
    assert (c.initial, c.world_size, c.lock) == ("A", 2, "file:/gms-serving.lock")
    assert isinstance(c.set("B"), cfg.KubernetesSetConfig) and c.set("B").rank_label == "gms.failover/rank"
    assert c.health_path == "/health"
    assert cfg.parse({**base, "health_path": "/gms/health"}).health_path == "/gms/health"  # vLLM engines
    sglang = cfg.parse({**base, "engine": "sglang"})
    assert (sglang.health_path, sglang.sleep_path, sglang.wake_path) == (
        "/gms/health", "/release_memory_occupation", "/resume_memory_occupation")
    assert cfg.parse({**base, "engine": "vllm", "wake_path": "/mine"}).wake_path == "/mine"
    assert (c.sleep_path, c.wake_path) == ("/sleep", "/wake_up")
    one_engine = cfg.parse({**base, "sets": {
        "A": {"kind": "local", "ports": [1], "command": ["x"]},  # one engine over both ranks (TP=2)
        "B": {"kind": "kubernetes", "namespace": "llm", "selector": "set=B", "engines": 1}}})
    assert one_engine.set("A").ports == (1,) and one_engine.set("B").engines == 1 and one_engine.world_size == 2
    assert c.set("B").engines == 2  # a pod per rank unless told
    for broken in ({**base, "ranks": []}, {**base, "initial": "C"}, {**base, "health_path": "gms/health"},
                   {**base, "engine": "trtllm"}, {**base, "engine": "sglang", "revoke": "engines"},
                   {**base, "sleep_path": 3},
                   {**base, "sets": {"A": base["sets"]["A"]}},
                   {**base, "sets": {**base["sets"], "A": {"kind": "local", "ports": [1, 2, 3], "command": ["x"]}}},
                   {**base, "sets": {**base["sets"], "B": {**base["sets"]["B"], "engines": 3}}},
                   {**base, "sets": {**base["sets"], "B": {"kind": "kubernetes"}}},
                   {**base, "sets": {**base["sets"], "B": {"kind": "slurm"}}},
                   {**base, "failures": 0}):
        with pytest.raises(cfg.ConfigError):
            cfg.parse(broken)


def pod(rank, phase="Running", ip="10.0.0.1", created="2026-01-01T00:00:00Z", deleting=False, terminated=False,
        uid="u"):
    meta = {"name": f"p{rank}-{uid}", "uid": uid, "creationTimestamp": created,
            "labels": {"gms.failover/rank": str(rank)}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:01:00Z"
    state = {"terminated": {"exitCode": 137}} if terminated else {"running": {}}
    return {"metadata": meta, "status": {"phase": phase, "podIP": ip, "containerStatuses": [{"state": state}]}}


def test_pods_are_live_only_when_running_addressed_and_not_going():
    assert pod_running(pod(0))
    assert not pod_running(pod(0, phase="Pending"))
    assert not pod_running(pod(0, ip=None))
    assert not pod_running(pod(0, deleting=True))
    assert not pod_running(pod(0, terminated=True))


def test_one_pod_per_rank_prefers_a_live_one():
    old_dead = pod(0, deleting=True, created="2026-01-01T00:00:00Z", uid="old")
    new_live = pod(0, created="2026-01-01T00:02:00Z", uid="new")
    pending = pod(1, phase="Pending", uid="p")
    stray = pod(7, uid="s")  # outside the world
    unlabeled = {"metadata": {"labels": {}}, "status": {}}
    chosen = pods_by_rank([new_live, old_dead, pending, stray, unlabeled], "gms.failover/rank", 2)
    assert chosen[0]["metadata"]["uid"] == "new" and chosen[1]["metadata"]["uid"] == "p"
    assert set(chosen) == {0, 1}


def test_lock_specs(tmp_path):
    lock = make_lock(f"file:{tmp_path / 'l'}")
    assert isinstance(lock, FileServingLock)
    for bad in ("", "file:", "lease:nonamespace", "zookeeper:/x"):
        with pytest.raises(ValueError):
            make_lock(bad)


def test_a_rank_with_work_pending_and_no_step_done_for_stall_s_has_stalled():
    from gms.failover.health import Probe, Progress, pace

    def probe(steps, pending, url="u0"):
        return Probe(url, True, "serving", "", 0.0, 0.01, {}, Progress(steps, pending))

    seen, stalled = pace({}, [probe(10, 0)], now=0.0, stall_s=1.0)
    seen, stalled = pace(seen, [probe(10, 2)], now=0.5, stall_s=1.0)  # work arrived, steps not yet
    assert stalled == []
    seen, stalled = pace(seen, [probe(10, 2)], now=0.9, stall_s=1.0)
    assert stalled == []
    seen, stalled = pace(seen, [probe(10, 2)], now=1.0, stall_s=1.0)  # 1 s since the last change
    assert [(p.url, since) for p, since in stalled] == [("u0", 0.0)]
    # saturated: slow to answer, but its steps go on: never stalled
    seen = {}
    for t in range(20):
        seen, stalled = pace(seen, [probe(100 + t, 8)], now=t * 0.5, stall_s=1.0)
        assert stalled == []
    # idle: nothing pending, nothing expected
    seen = {}
    for t in range(5):
        seen, stalled = pace(seen, [probe(7, 0)], now=t * 1.0, stall_s=1.0)
        assert stalled == []
    # an engine that does not report progress is left to its canaries
    quiet = Probe("u1", True, "serving", "", 0.0, 0.01)
    seen, stalled = pace({"u1": None}, [quiet], now=9.0, stall_s=1.0)
    assert stalled == [] and "u1" not in seen


def test_progress_is_read_only_from_well_formed_answers():
    from gms.failover.health import Progress

    assert Progress.parse({"steps": 3, "pending": 1}) == Progress(3, 1)
    for bad in (None, [], {"steps": 3}, {"steps": -1, "pending": 0}, {"steps": True, "pending": 0},
                {"steps": "3", "pending": 0}):
        assert Progress.parse(bad) is None
    assert cfg.parse({"ranks": ["/s"], "sets": {"A": {"kind": "local", "ports": [1], "command": ["x"]},
                                                "B": {"kind": "local", "ports": [2], "command": ["x"]}},
                      "stall_s": 0.5}).stall_s == 0.5


CHILD = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    """Running, not a zombie nobody reaped (a container's init may not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def test_a_set_kills_an_engine_s_whole_process_group_after_its_leader_died(tmp_path):
    """An engine over several ranks is a tree (vLLM: API server, engine core,
    workers); a SIGKILLed leader leaves the rest running on the GPU.  The set
    starts each engine in its own group and kills the group: one engine here,
    with one port, over two ranks."""
    import os
    import signal
    import sys

    import trio

    from gms.failover.sets import LocalProcessSet

    pidfile = tmp_path / "child.pid"
    config = cfg.LocalSetConfig("A", (sys.executable, "-c", CHILD, str(pidfile) + ".{rank}of{world_size}"), (8100,))
    exits = []
    async with trio.open_nursery() as nursery:
        engines = LocalProcessSet(config, ("/s0", "/s1"), nursery, lambda name, rank, code: exits.append((rank, code)))
        await engines.start("primary")
        assert len(engines.pids()) == 1 and engines.urls() == ["http://127.0.0.1:8100"]
        path = tmp_path / "child.pid.0of2"
        with trio.fail_after(30):
            while not path.exists() or not path.read_text():
                await trio.sleep(0.02)
        child = int(path.read_text())
        os.kill(engines.pids()[0], signal.SIGKILL)  # the API server dies alone
        with trio.fail_after(30):
            while not exits:
                await trio.sleep(0.02)
        assert exits == [(0, -signal.SIGKILL)] and engines.dead() == [0] and _alive(child)
        await engines.kill()
        with trio.fail_after(30):
            while _alive(child):
                await trio.sleep(0.02)
        await engines.kill()  # the group is gone: nothing is signalled
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(("engine", "launcher", "paths"), [
    ("vllm", "vllm_engines", ("/gms/health", "/sleep", "/wake_up")),
    ("sglang", "sglang_engines", ("/gms/health", "/release_memory_occupation", "/resume_memory_occupation")),
])
def test_the_benchmarks_drive_the_coordinator_with_each_engine_s_command_lines(tmp_path, engine, launcher, paths):
    """bench/coordinated.py's file parses with the engine's paths, and each set's command
    (its JSON loader config included: braces doubled) comes back as the engine's argv."""
    import tomllib

    coordinated, engines = _bench("coordinated", launcher)
    coordinator_toml, serve_argv = coordinated.coordinator_toml, engines.serve_argv
    socket = str(tmp_path / "gms.sock")
    argv = serve_argv("/models/m", 18311, extra={"gms_socket": socket})
    text = coordinator_toml(tmp_path, [socket], {"A": (18311, argv), "B": (18312, argv)}, engine=engine,
                            interval=0.1, failures=3, canary_timeout=5.0)
    parsed = cfg.parse(tomllib.loads(text))
    assert (parsed.health_path, parsed.sleep_path, parsed.wake_path) == paths
    assert parsed.ranks == (socket,) and parsed.initial == "A"
    fields = {"rank": 0, "world_size": 1, "port": 18311, "socket": socket, "set": "A"}
    assert [part.format(**fields) for part in parsed.set("A").command] == argv  # as LocalProcessSet fills it

    # tensor parallel: a rank per GPU's server, the engines' argv asking for it
    sockets = [str(tmp_path / "gpu0.sock"), str(tmp_path / "gpu1.sock")]
    argv = serve_argv("/models/m", 18311, tp=2) if engine == "vllm" else argv
    text = coordinator_toml(tmp_path, sockets, {"A": (18311, argv), "B": (18312, argv)}, engine=engine,
                            interval=0.1, failures=3, canary_timeout=5.0)
    assert cfg.parse(tomllib.loads(text)).ranks == tuple(sockets)
    if engine == "vllm":
        assert argv[argv.index("--tensor-parallel-size") + 1] == "2"


def test_the_benchmark_finds_the_engine_process_of_one_rank_by_its_session_and_its_engine_core(tmp_path):
    """A crash of one tensor-parallel rank is a SIGKILL of that rank's process: the
    bench finds it as the process under the engine's launcher that holds a session
    on that GPU's server (its pid as the kernel told the server), not another
    engine's process on the same server; a hung engine is a SIGSTOP of its core, the
    launcher's child above the rank (launcher -> core -> rank, as vLLM at TP > 1)."""
    import os
    import signal
    import subprocess
    import sys

    from .helpers import ServerProcess

    (coordinated,) = _bench("coordinated")
    engine_core_pid, rank_pid, parent = coordinated.engine_core_pid, coordinated.rank_pid, coordinated.parent_pid
    server = ServerProcess(tmp_path)
    holder = (
        "import sys, time; from gms import GMSClientMemoryManager as M; "
        "m = M(sys.argv[1], layout=sys.argv[2]); m.connect('RW'); print('held', flush=True); time.sleep(60)"
    )
    spawner = (  # starts argv[1:] and waits for it: the launcher, and the engine core under it
        "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', *sys.argv[1:]], stdout=sys.stdout);"
        " p.wait()"
    )
    other = subprocess.Popen([sys.executable, "-c", holder, server.socket, "other"], stdout=subprocess.PIPE, text=True)
    launcher = subprocess.Popen([sys.executable, "-c", spawner, spawner, holder, server.socket, "rank1"],
                                stdout=subprocess.PIPE, text=True)
    rank = 0
    try:
        assert other.stdout.readline().strip() == "held" and launcher.stdout.readline().strip() == "held"
        rank = rank_pid(server.socket, launcher.pid)
        assert rank not in (launcher.pid, other.pid)
        core = engine_core_pid(rank, launcher.pid)
        assert core not in (rank, launcher.pid) and parent(rank) == core and parent(core) == launcher.pid
        assert engine_core_pid(core, launcher.pid) == core  # at TP=1 the rank is the core
        with pytest.raises(RuntimeError):
            engine_core_pid(other.pid, launcher.pid)
        with pytest.raises(RuntimeError):
            rank_pid(server.socket, 1 << 22)  # no engine of that pid holds a session here
    finally:
        if rank:
            os.kill(rank, signal.SIGKILL)
        for proc in (other, launcher):
            proc.kill()
            proc.wait()
        server.kill()


ENGINE_FAILING_ONCE = """
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

port, marker = int(sys.argv[1]), sys.argv[2]
if not os.path.exists(marker):  # the first start dies, as vLLM's does when its rendezvous port is taken
    open(marker, "w").close()
    sys.exit(3)
state = {"status": "serving" if os.environ.get("GMS_MODE") == "primary" else "asleep"}

class Handler(BaseHTTPRequestHandler):
    def _answer(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._answer(state)

    def do_POST(self):
        state["status"] = "asleep" if self.path.startswith("/sleep") else "serving"
        self._answer({})

    def log_message(self, *args):
        pass

HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


async def test_a_set_whose_engine_dies_while_starting_is_started_again(tmp_path):
    """Two engines starting side by side can fail for a reason of the moment (vLLM's
    rendezvous port drawn by both: EADDRINUSE, seen on two H200s): the coordinator
    kills the set and starts it again rather than exiting, and says how many tries
    its ``ready`` took."""
    import json
    import sys

    import trio

    from gms.failover.coordinator import run

    from .engine_helpers import free_port

    script = tmp_path / "engine.py"
    script.write_text(ENGINE_FAILING_ONCE)
    events = tmp_path / "events.jsonl"
    command = [sys.executable, str(script), "{port}", str(tmp_path / "started-{set}")]
    config = cfg.parse({
        "lock": f"file:{tmp_path / 'serving.lock'}", "initial": "A", "ranks": [str(tmp_path / "gms.sock")],
        "interval_s": 0.05, "canary_timeout_s": 2.0, "ready_timeout_s": 60.0, "events": str(events),
        "sets": {name: {"kind": "local", "ports": [free_port()], "command": command, "log_dir": str(tmp_path)}
                 for name in ("A", "B")}})

    def ready() -> dict:
        lines = events.read_text().splitlines() if events.exists() else []
        return {e["set"]: e for e in map(json.loads, lines) if e["event"] == "ready"}

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, config)
        with trio.fail_after(60):
            while len(ready()) < 2:
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    assert {name: (e["role"], e["attempts"]) for name, e in ready().items()} == {
        "A": ("serving", 2), "B": ("standby", 2)}
