"""The example engine and the failover coordinator, end to end on CPU (host backend).

* A standalone engine (its own gms servers): completions against a plain
  transformers decode, sleep and wake at the same addresses, the canary.
* A cluster: gms servers, a primary and a shadow engine set, and the
  coordinator (``gms failover``), all real processes; SIGKILL the serving
  engine, then hang (SIGSTOP) the next one, then stop the next one's model
  while its HTTP server answers on (its progress stands still).

One tiny model; every process is started once, all at the same time (engine
start-up is mostly importing torch and transformers: on 2 cores, starting
them together saves most of it), and shared by the tests (each failover test
acts on whichever set serves now).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("hypercorn")
httpx = pytest.importorskip("httpx")


from .engine_helpers import (  # noqa: E402
    ENGINE,
    PROMPT,
    EngineProcess,
    RankServers,
    complete,
    free_port,
    read_json_lines,
    reference,
    tiny_model,
    wait_http,
)
from .helpers import LayoutCopy, RawConn, build_layout, wait_until  # noqa: E402


class Cluster:
    def __init__(self, folder, model, tmp_path_factory) -> None:
        self.folder = folder
        self.model, self.prompt = model, PROMPT
        self.servers = RankServers(folder, "rank0")
        self.ports = {"A": free_port(), "B": free_port()}
        self.events_path = folder / "events.jsonl"
        command = [sys.executable, ENGINE, "--model", str(self.model), "--gms-socket", "{socket}",
                   "--port", "{port}", "--rank", "{rank}", "--world-size", "{world_size}", "--max-seq-len", "64",
                   "--stall-file", str(folder / "stall-{set}")]
        config = {
            "lock": f"file:{folder / 'serving.lock'}", "initial": "A", "ranks": [self.servers.socket],
            "interval_s": 0.2, "failures": 2, "canary_timeout_s": 1.0, "wake_timeout_s": 60.0,
            "ready_timeout_s": 120.0, "events": str(self.events_path),
            "sets": {name: {"kind": "local", "ports": [port], "command": command, "log_dir": str(folder / "logs"),
                            "env": {"ENGINE_LOG_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"}}
                     for name, port in self.ports.items()},
        }
        (folder / "failover.toml").write_text(_toml(config))
        self.log = open(folder / "coordinator.log", "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "gms", "failover", "--config", str(folder / "failover.toml")],
                                     stdout=subprocess.DEVNULL, stderr=self.log)

    def wait_ready(self, tmp_path_factory) -> None:
        self.reference = reference(tmp_path_factory)  # while the engines start
        for name in ("A", "B"):
            self.wait_event(lambda e, n=name: e["event"] == "ready" and e["set"] == n, 120, f"set {name} ready")

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def events(self) -> list[dict]:
        return read_json_lines(self.events_path)

    def wait_event(self, match, timeout: float, what: str, after: int = 0) -> dict:
        def found():
            assert self.proc.poll() is None, f"coordinator exited:\n{self.coordinator_log()}"
            return next((e for e in self.events()[after:] if match(e)), None)
        return wait_until(found, timeout=timeout, interval=0.05, what=f"{what}\n{self.coordinator_log()}")

    def serving(self) -> tuple[str, str]:
        """(serving set, standby set) as the coordinator last said."""
        serving = "A"
        for e in self.events():
            if e["event"] == "failover":
                serving = e["serving"]
        return serving, "B" if serving == "A" else "A"

    def state(self, name: str) -> dict:
        return httpx.get(f"{self.url(name)}/state", timeout=5).json()

    def coordinator_log(self) -> str:
        self.log.flush()
        return (self.folder / "coordinator.log").read_text(errors="replace")[-4000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.servers.stop()
        self.log.close()


def _toml(value, prefix: str = "") -> str:
    """Just enough TOML for the config above."""
    lines, tables = [], []
    for key, item in value.items():
        if isinstance(item, dict) and key == "sets":
            for name, table in item.items():
                tables.append(f"\n[sets.{name}]")
                for k, v in table.items():
                    tables.append(f"{k} = {_toml_value(v)}")
        else:
            lines.append(f"{key} = {_toml_value(item)}")
    return "\n".join(lines + tables) + "\n"


def _toml_value(v) -> str:
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    return json.dumps(v)  # strings, numbers and lists of them read the same in TOML


class World:
    """Every process of this module, started together."""

    def __init__(self, tmp_path_factory) -> None:
        self.servers = self.process = self.cluster = None
        try:
            model = tiny_model(tmp_path_factory)
            folder = self.folder = tmp_path_factory.mktemp("engine")
            self.servers = RankServers(folder, "rank0")
            self.process = EngineProcess(model, self.servers.socket, folder / "engine.log", "primary")
            self.cluster = Cluster(tmp_path_factory.mktemp("failover"), model, tmp_path_factory)
            self.cluster.wait_ready(tmp_path_factory)
            self.process.wait_ready()
        except BaseException:
            self.close()  # nothing left running when start-up fails
            raise
        self.engine = (self.process, self.servers, PROMPT, self.cluster.reference)

    def restart_servers(self) -> RankServers:
        """SIGKILL the standalone engine's gms server; a new, empty one on its socket."""
        self.servers.stop()
        self.servers = RankServers(self.folder, "rank0")
        self.engine = (self.process, self.servers, *self.engine[2:])
        return self.servers

    def close(self) -> None:
        for part, stop in ((self.process, "kill"), (self.servers, "stop"), (self.cluster, "close")):
            if part is not None:
                getattr(part, stop)()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    w = World(tmp_path_factory)
    try:
        yield w
    finally:
        w.close()


@pytest.fixture
def cluster(world):
    return world.cluster


# -- the engine ------------------------------------------------------------------


def health(url: str) -> httpx.Response:
    return httpx.get(f"{url}/health", timeout=10)


def test_engine_completions_equal_a_plain_transformers_greedy_decode(world):
    e, _, prompt, reference = world.engine
    r = complete(e.url, prompt, 6, ignore_eos=True)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["token_ids"] == reference
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 6, "total_tokens": len(prompt) + 6}
    # a shorter request after a longer one: the static cache forgets the last sequence
    assert complete(e.url, prompt, 2, ignore_eos=True).json()["choices"][0]["token_ids"] == reference[:2]
    # text in, text out (the checkpoint has a tokenizer)
    text = complete(e.url, "the shadow engine", 3, ignore_eos=True).json()["choices"][0]
    assert len(text["token_ids"]) == 3 and isinstance(text["text"], str)


def test_engine_refuses_requests_it_cannot_serve(world):
    e, _, prompt, _ = world.engine
    assert complete(e.url, prompt, 64).status_code == 400  # past --max-seq-len 64
    assert complete(e.url, [10**6], 1).status_code == 400  # not a token id of this vocabulary
    assert complete(e.url, prompt, 1, temperature=0.7).status_code == 400  # greedy only
    assert httpx.post(f"{e.url}/v1/completions", content=b"{", timeout=5).status_code == 400


def test_engine_sleep_releases_gms_memory_and_wake_restores_the_same_addresses(world):
    e, servers, prompt, reference = world.engine
    assert health(e.url).json()["status"] == "serving"
    before = httpx.get(f"{e.url}/state", timeout=5).json()
    assert before["phase"] == "serving" and before["loaded_from_disk"]
    assert servers.state("kv_cache").writer and servers.state("kv_cache").allocation_count > 0
    readers = servers.state("weights").readers

    assert httpx.post(f"{e.url}/sleep", timeout=10).json()["is_sleeping"] is True
    assert httpx.get(f"{e.url}/is_sleeping", timeout=5).json() == {"is_sleeping": True}
    assert health(e.url).status_code == 200 and health(e.url).json() == {"status": "asleep"}
    assert complete(e.url, prompt, 1).status_code == 503
    kv = servers.state("kv_cache")
    assert not kv.writer and kv.allocation_count == 0  # the KV layout went with the lock
    assert servers.state("weights").readers == readers - 1
    assert servers.state("weights").committed  # the weights stay published

    woke = httpx.post(f"{e.url}/wake_up", timeout=30).json()
    assert woke["is_sleeping"] is False
    after = httpx.get(f"{e.url}/state", timeout=5).json()
    assert after["weights_addresses"] == before["weights_addresses"]
    assert after["kv_addresses"] == before["kv_addresses"]
    assert health(e.url).json()["status"] == "serving"
    assert complete(e.url, prompt, 6, ignore_eos=True).json()["choices"][0]["token_ids"] == reference
    assert httpx.post(f"{e.url}/wake_up", timeout=30).status_code == 200  # already awake: a no-op


def test_engine_serves_through_a_gms_server_restart_and_takes_its_locks_back(world):
    """SIGKILL the engine's gms server and start another on its socket: the engine
    serves on from the memory it mapped; its canary takes the locks back: the
    weights ride through when the new server holds the same layout (as a
    restarted server's keeper will bring it back; the test publishes a copy),
    the KV cache is rebuilt; a server without the weights leaves them stale."""
    e, servers, prompt, reference = world.engine
    weights = LayoutCopy(servers.socket)
    for outcome in ("rode through", "stale"):
        servers = world.restart_servers()
        assert complete(e.url, prompt, 6, ignore_eos=True).json()["choices"][0]["token_ids"] == reference
        if outcome == "rode through":
            weights.publish(servers.socket)
        body = health(e.url)
        assert body.status_code == 200, body.text
        notes = body.json()["gms"]
        assert notes["weights"].startswith(outcome) and notes["kv_cache"] == "rebuilt", notes
        assert servers.state("kv_cache").writer and servers.state("kv_cache").allocation_count > 0
        assert servers.state("weights").readers == (1 if outcome == "rode through" else 0)
        assert complete(e.url, prompt, 6, ignore_eos=True).json()["choices"][0]["token_ids"] == reference
        if outcome == "rode through":  # and sleeps and wakes on the new server, at the same addresses
            before = httpx.get(f"{e.url}/state", timeout=5).json()
            assert httpx.post(f"{e.url}/sleep", timeout=10).status_code == 200
            assert httpx.post(f"{e.url}/wake_up", timeout=30).status_code == 200
            after = httpx.get(f"{e.url}/state", timeout=5).json()
            assert (after["weights_addresses"], after["kv_addresses"]) == (before["weights_addresses"],
                                                                         before["kv_addresses"])
            assert "gms" not in health(e.url).json(), "a wake starts a clean slate"
    # Asleep on stale weights: not a standby a wake could use as it is.
    assert httpx.post(f"{e.url}/sleep", timeout=10).status_code == 200
    asleep = health(e.url)
    assert (asleep.status_code, asleep.json()["status"]) == (503, "asleep") and "gone" in asleep.json()["error"]
    weights.publish(servers.socket)  # the layout back: a healthy standby again, and awake for the tests after
    assert health(e.url).json() == {"status": "asleep"}
    assert httpx.post(f"{e.url}/wake_up", timeout=30).status_code == 200
    assert complete(e.url, prompt, 6, ignore_eos=True).json()["choices"][0]["token_ids"] == reference


# -- failover --------------------------------------------------------------------



def test_a_waking_engine_revokes_a_hung_primarys_kv_lock_on_its_own_node(world):
    """``revoke = "engines"``: for a coordinator that cannot reach the GPU's socket."""
    e, servers, prompt, reference = world.engine
    assert httpx.post(f"{e.url}/sleep", timeout=10).json()["is_sleeping"] is True
    hung = RawConn(servers.socket)  # a primary that holds the KV lock and answers nothing
    assert hung.handshake("RW", layout="kv_cache").success
    build_layout(hung, sizes=(2 << 20,), tag="kv_cache")
    woke = httpx.post(f"{e.url}/wake_up", json={"revoke_kv": True}, timeout=30).json()
    assert (woke["is_sleeping"], woke["revoked"]) == (False, 1)
    assert hung.closed_by_peer(), "the hung primary lost its lock and its connection"
    assert complete(e.url, prompt, 6, ignore_eos=True).json()["choices"][0]["token_ids"] == reference
    assert [e.kind for e in servers.events() if e.kind == "LAYOUT_REVOKED"] == ["LAYOUT_REVOKED"]


def test_primary_serves_and_shadow_sleeps(cluster):
    serving, standby = cluster.serving()
    response = complete(cluster.url(serving), cluster.prompt, 6, ignore_eos=True)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == cluster.reference
    assert httpx.get(f"{cluster.url(standby)}/health", timeout=5).json() == {"status": "asleep"}
    assert complete(cluster.url(standby), cluster.prompt, 1).status_code == 503
    shadow, primary = cluster.state(standby), cluster.state(serving)
    assert shadow["mode"] == "shadow" and shadow["kv_addresses"] == [] and shadow["phase"] == "asleep"
    assert primary["mode"] == "primary" and primary["kv_addresses"]
    assert shadow["loaded_from_disk"] != primary["loaded_from_disk"]  # one loaded, the other imported


def test_a_gms_server_restart_is_no_failover(cluster):
    """The rank's server is replaced by one already holding the same weights (as a
    keeper brings a restarted server back; here a copy is published on a server
    started beside it, whose socket is then moved into place): the serving engine
    rides through, reports it, and nothing fails over."""
    serving, standby = cluster.serving()
    before = len(cluster.events())
    old = cluster.servers
    new = RankServers(cluster.folder, "next")
    LayoutCopy(old.socket).publish(new.socket)
    old.stop()
    os.rename(new.socket, old.socket)
    new.socket = old.socket
    cluster.servers = new
    url = cluster.url(serving)
    event = cluster.wait_event(lambda e: e["event"] == "gms" and e["url"] == url, 20, "the gms report", before)
    assert event["gms"] == {"weights": "rode through", "kv_cache": "rebuilt"}, event
    response = complete(url, cluster.prompt, 6, ignore_eos=True)
    assert response.status_code == 200 and response.json()["choices"][0]["token_ids"] == cluster.reference
    assert httpx.get(f"{cluster.url(standby)}/health", timeout=5).json() == {"status": "asleep"}
    assert new.state("weights").readers == 1 and new.state("kv_cache").writer
    assert not [e for e in cluster.events()[before:] if e["event"] in ("failover", "standby_failed")]


def test_sigkill_of_the_serving_engine_fails_over_to_the_shadow(cluster):
    serving, standby = cluster.serving()
    before = len(cluster.events())
    pid = cluster.state(serving)["pid"]
    os.kill(pid, signal.SIGKILL)
    # A client polling the shadow gets its completion once the coordinator woke it.
    response = wait_http(lambda: (r := complete(cluster.url(standby), cluster.prompt, 6, ignore_eos=True, timeout=10))
                         .status_code == 200 and r, timeout=30, what="a completion from the shadow")
    assert response.json()["choices"][0]["token_ids"] == cluster.reference
    event = cluster.wait_event(lambda e: e["event"] == "failover", 10, "failover event", before)
    assert (event["failed"], event["serving"], event["ok"]) == (serving, standby, True)
    assert "exited" in event["reason"]
    for phase in ("detect_s", "revoke_s", "lock_s", "wake_s", "first_token_s"):
        assert event[phase] >= 0
    # The killed set comes back, as the shadow.
    cluster.wait_event(lambda e: e["event"] == "restarted" and e["set"] == serving, 90, "restart", before)
    state = cluster.state(serving)
    assert (state["mode"], state["phase"]) == ("shadow", "asleep") and state["pid"] != pid
    assert httpx.get(f"{cluster.url(serving)}/health", timeout=5).json() == {"status": "asleep"}


def test_a_hung_serving_engine_is_detected_by_its_canary_and_revoked(cluster):
    serving, standby = cluster.serving()
    before = len(cluster.events())
    pid = cluster.state(serving)["pid"]
    os.kill(pid, signal.SIGSTOP)  # alive, holding its KV lock, answering nothing
    try:
        event = cluster.wait_event(lambda e: e["event"] == "failover", 30, "failover event", before)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert (event["failed"], event["serving"], event["ok"]) == (serving, standby, True)
    assert "canary" in event["reason"]
    revoked = list(event["revoked"].values())
    assert revoked == [1]  # the hung engine's KV session, dropped by its server
    response = complete(cluster.url(standby), cluster.prompt, 6, ignore_eos=True)
    assert response.status_code == 200 and response.json()["choices"][0]["token_ids"] == cluster.reference
    wait_until(lambda: not _alive(pid), timeout=10, what="the hung engine killed")  # not left behind


def test_a_model_that_stops_while_its_http_server_answers_is_failed_over_on_its_progress(cluster):
    """A hung kernel, not a dead process: the engine answers its health checks at
    once, with work pending and its steps standing still.  Its canaries never
    fail twice in a row (a busy engine answers with its progress instead), so
    only the progress can tell."""
    serving, standby = cluster.serving()
    wait_until(lambda: _phase(cluster, standby) == "asleep", timeout=120, what=f"set {standby} back as the shadow")
    before = len(cluster.events())
    stall = cluster.folder / f"stall-{serving}"
    stall.touch()
    try:
        event = cluster.wait_event(lambda e: e["event"] == "failover", 30, "failover event", before)
    finally:
        stall.unlink(missing_ok=True)
    assert (event["failed"], event["serving"], event["ok"]) == (serving, standby, True)
    assert "made no progress" in event["reason"] and "requests pending" in event["reason"]
    response = complete(cluster.url(standby), cluster.prompt, 6, ignore_eos=True)
    assert response.status_code == 200 and response.json()["choices"][0]["token_ids"] == cluster.reference
    body = httpx.get(f"{cluster.url(standby)}/health", timeout=10).json()
    assert body["status"] == "serving" and body["progress"]["steps"] > 0


def _phase(cluster, name: str) -> str | None:
    try:
        return cluster.state(name)["phase"]
    except httpx.HTTPError:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
