"""``gms failover`` driven by a benchmark (bench/vllm.py, bench/sglang_gms.py).

Two local sets of one engine each on one gms server, the coordinator in a
subprocess, and the failover a user sees: the serving engine SIGKILLed (its
pid from ``/gms/health``), a client asking the shadow for one token
(``/v1/completions``, which vLLM and SGLang both answer) as a router that
follows the serving lock would, the clock from the signal to that token.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from gms.failover.probes import CANARY_PROMPT


def coordinator_toml(work: Path, sockets: list[str], commands: dict[str, tuple[int, list[str]]], *, engine: str,
                     interval: float, failures: int, canary_timeout: float) -> str:
    """The coordinator's configuration (docs/failover.md) for two local sets of one engine each,
    ``sockets`` the gms server of each rank's GPU."""
    lines = [f'lock = "file:{work / "serving.lock"}"', f'initial = "{next(iter(commands))}"',
             f"ranks = {json.dumps(sockets)}", f"interval_s = {interval}", f"failures = {failures}",
             f"canary_timeout_s = {canary_timeout}", "wake_timeout_s = 600.0", "ready_timeout_s = 900.0",
             f'events = "{work / "events.jsonl"}"', f'engine = "{engine}"']
    for name, (port, argv) in commands.items():
        # The coordinator fills {placeholders} with str.format: the braces of JSON are doubled.
        command = [a.replace("{", "{{").replace("}", "}}") for a in argv]
        lines += [f"\n[sets.{name}]", 'kind = "local"', f"ports = [{port}]", f"command = {json.dumps(command)}",
                  f'log_dir = "{work / "logs"}"']
    return "\n".join(lines) + "\n"


def parent_pid(pid: int) -> int | None:
    """``pid``'s parent (from /proc); None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _ancestors(pid: int) -> set[int]:
    """``pid``'s parent, its parent's parent, ... (from /proc)."""
    out: set[int] = set()
    while pid > 1 and (pid := parent_pid(pid)) is not None:
        out.add(pid)
    return out


def rank_pid(socket: str, launcher: int) -> int:
    """The process of ``launcher``'s engine that holds a session on ``socket`` (its
    rank on that GPU): the pids the server's history records for the sessions it
    opened (the kernel's word, SO_PEERCRED), the newest alive under ``launcher``."""
    from gms.client.probes import iter_event_history

    opened = [e.fields.get("pid", 0) for e in iter_event_history(socket) if e.kind == "SESSION_OPENED"]
    for pid in reversed(opened):
        if pid and os.path.exists(f"/proc/{pid}") and launcher in _ancestors(pid):
            return pid
    raise RuntimeError(f"no process of pid {launcher}'s engine holds a session on {socket}")


def engine_core_pid(rank: int, launcher: int) -> int:
    """The engine core of ``launcher``'s engine: the launcher's child on the way up
    from ``rank`` (a rank's process; at tensor parallel 1 the core is the rank)."""
    pid = rank
    while (parent := parent_pid(pid)) is not None and parent > 1 and parent != launcher:
        pid = parent
    if parent != launcher:
        raise RuntimeError(f"pid {rank} is not under pid {launcher}")
    return pid


class FirstToken(threading.Thread):
    """Asks ``url`` for one token until one comes back.  A request sent while
    the engine sleeps waits for its wake (vLLM's queue; SGLang's pause gate,
    gms/integrations/sglang/gate.py)."""

    def __init__(self, url: str, timeout: float = 600, request_timeout: float = 30.0) -> None:
        super().__init__(daemon=True)
        self.url, self.timeout, self.request_timeout = url, timeout, request_timeout
        self.at: float | None = None
        self.attempts = 0

    def run(self) -> None:
        body = {"prompt": CANARY_PROMPT, "max_tokens": 1, "ignore_eos": True, "temperature": 0.0}
        deadline = time.monotonic() + self.timeout
        with httpx.Client(timeout=self.request_timeout) as client:
            while time.monotonic() < deadline:
                self.attempts += 1
                try:
                    if client.post(f"{self.url}/v1/completions", json=body).status_code == 200:
                        self.at = time.time()
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.002)


def read_events(path: Path) -> list[dict]:
    """The coordinator's event lines so far."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_event(path: Path, coordinator: subprocess.Popen, match, timeout: float, after: int = 0) -> dict:
    """The first event after the first ``after`` that ``match``es; the coordinator must stay up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if coordinator.poll() is not None:
            raise RuntimeError(f"the coordinator exited ({coordinator.returncode})")
        for e in read_events(path)[after:]:
            if match(e):
                return e
        time.sleep(0.02)
    raise RuntimeError(f"timed out waiting for the coordinator (events in {path})")


def summary(values: list[float]) -> dict:
    if not values:
        return {}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


class Coordinator:
    """``gms failover`` over two local sets, ``commands``: name -> (port, argv)."""

    def __init__(self, work: Path, sockets: list[str], commands: dict[str, tuple[int, list[str]]], env: dict,
                 *, engine: str, interval: float, failures: int, canary_timeout: float) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.work, self.events = work, work / "events.jsonl"
        self.ports = {name: port for name, (port, _) in commands.items()}
        self.settings = {"engine": engine, "interval_s": interval, "failures": failures,
                         "canary_timeout_s": canary_timeout}
        config = work / "failover.toml"
        self.sockets = sockets
        config.write_text(coordinator_toml(work, sockets, commands, engine=engine, interval=interval,
                                           failures=failures, canary_timeout=canary_timeout))
        self._log = open(work / "coordinator.log", "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([sys.executable, "-m", "gms", "failover", "--config", str(config)],
                                     env=env, stdout=subprocess.DEVNULL, stderr=self._log)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def read_events(self) -> list[dict]:
        return read_events(self.events)

    def wait_event(self, match, timeout: float, after: int = 0) -> dict:
        return wait_event(self.events, self.proc, match, timeout, after)

    def wait_ready(self, timeout: float = 900) -> float:
        """Both sets up (the primary serving, the shadow asleep); seconds taken."""
        started = time.monotonic()
        for name in self.ports:
            self.wait_event(lambda e, n=name: e["event"] == "ready" and e["set"] == n, timeout)
        return time.monotonic() - started

    def _serving(self, events: list[dict]) -> str:
        """The set serving after ``events``: the last failover's, or the first set."""
        failovers = [e for e in events if e["event"] == "failover"]
        return failovers[-1]["serving"] if failovers else next(iter(self.ports))

    def fail_over(self, rank: int | None = None, hang: bool = False) -> dict:
        """SIGKILL the serving engine (``rank``: only its process on that rank's GPU,
        as a crash of one tensor-parallel worker), or (``hang``) SIGSTOP its process
        on rank ``rank`` (by default its engine core), alive and answering nothing;
        time the shadow's first token from the signal.  The failed set comes back as
        the shadow meanwhile (the coordinator kills a stopped one's group); the next
        failover waits for it."""
        done = self.read_events()
        failovers = [i for i, e in enumerate(done) if e["event"] == "failover"]
        serving = self._serving(done)
        standby = next(name for name in self.ports if name != serving)
        if failovers:  # the set that failed last must be back as the shadow
            self.wait_event(lambda e: e["event"] == "restarted" and e["set"] == standby, 900, failovers[-1])
        before = len(self.read_events())
        launcher = httpx.get(f"{self.url(serving)}/gms/health", timeout=30).json()["pid"]
        pid = launcher
        if rank is not None:
            pid = rank_pid(self.sockets[rank], launcher)
        elif hang:
            pid = engine_core_pid(rank_pid(self.sockets[0], launcher), launcher)
        poller = FirstToken(self.url(standby))
        poller.start()
        killed_at = time.time()
        os.kill(pid, signal.SIGSTOP if hang else signal.SIGKILL)
        poller.join(600)
        event = self.wait_event(lambda e: e["event"] == "failover", 600, before)
        if poller.at is None:
            raise RuntimeError("no token from the shadow")
        return {"failed": serving, "serving": standby, "ok": event["ok"], "fault": "hang" if hang else "kill",
                "signalled": "rank" if rank is not None else "engine core" if hang else "launcher", "rank": rank,
                "signal_to_first_token_s": poller.at - killed_at,
                "signal_to_decision_s": event["decided_at"] - killed_at,
                "coordinator": {k: event.get(k) for k in ("detect_s", "revoke_s", "lock_s", "wake_s",
                                                          "first_token_s", "total_s")},
                "reason": event.get("reason"), "client_attempts": poller.attempts}

    def saturate(self, seconds: float, clients: int = 16, max_tokens: int = 256,
                 prompt_tokens: int = 1024, busy_cpus: int = 0) -> dict:
        """The serving engine kept busy for ``seconds`` (``clients`` threads, each
        sending long prompts for long answers back to back: its batch full, every
        step slow) while ``busy_cpus`` processes spin on the host (the engine's and
        the coordinator's threads wait for a core): no failover may come of it.
        Returns the requests answered and failed and the coordinator's events meanwhile."""
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy_cpus)]
        try:
            return self._saturate(seconds, clients, max_tokens, prompt_tokens) | {"busy_cpus": busy_cpus}
        finally:
            for spinner in spinners:
                spinner.kill()
                spinner.wait()

    def _saturate(self, seconds: float, clients: int, max_tokens: int, prompt_tokens: int) -> dict:
        done = self.read_events()
        serving, before = self._serving(done), len(done)
        stop = time.monotonic() + seconds
        counts = {"answered": 0, "failed": 0}
        lock = threading.Lock()
        body = {"prompt": [1 + i % 250 for i in range(prompt_tokens)], "max_tokens": max_tokens,
                "ignore_eos": True, "temperature": 0.0}

        def client() -> None:
            with httpx.Client(timeout=600) as http:
                while time.monotonic() < stop:
                    try:
                        ok = http.post(f"{self.url(serving)}/v1/completions", json=body).status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    with lock:
                        counts["answered" if ok else "failed"] += 1

        threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        events = self.read_events()[before:]
        return {"seconds": seconds, "clients": clients, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
                "serving": serving, **counts, "failovers": sum(e["event"] == "failover" for e in events),
                "events": sorted({e["event"] for e in events})}

    def results(self, runs: list[dict]) -> dict:
        """The failovers' figures; a failed set's restart as the shadow from the
        coordinator's events (the last may still be under way)."""
        restarts = [e["seconds"] for e in self.read_events() if e["event"] == "restarted"]
        return {"coordinator": self.settings, "runs": runs,
                "signal_to_first_token_s": summary([r["signal_to_first_token_s"] for r in runs]),
                "restart_as_shadow_s": summary(restarts)}

    def close(self, tail: Path) -> None:
        """Stop the coordinator (it stops its sets); the logs' tails go to ``tail``."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()
        with open(tail, "a") as f:
            for path in sorted((self.work / "logs").glob("*.log")) + [self.work / "coordinator.log"]:
                text = path.read_text(errors="replace").splitlines()
                f.write(f"===== {path.name}\n" + "\n".join(text[-150:]) + "\n")
