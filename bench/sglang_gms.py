"""SGLang on gms against SGLang alone, on one GPU, in one run (docs/sglang.md).

    python bench/sglang_gms.py [--shape tiny|llama-2b] [--parts share,restart,failover]
                               [--out DIR]     # sglang_gms.json (docs/results/sglang_h100.json)

A gms server (CUDA), a Llama made here (bench/vllm_model.py), then:

1. **SGLang alone** (its own loader, its own memory saver, torch_memory_saver):
   ready time, weight load, greedy output (the reference), release and resume
   of every tag through its endpoints, output after the resume.
2. **Engine A**, ``--load-format gms --enable-memory-saver``: the first on the
   GPU, it loads from disk and publishes.
3. **Engine B**, the same with ``gms_read_only``: imports.  Its weight load,
   and the GPU memory it adds (NVML, the whole device), against SGLang alone's.
4. **Release and resume of B** (all tags: weights, KV cache, CUDA graphs):
   times of the HTTP calls, the memory they free and take back (NVML),
   ``/gms/health``, the server's view of B's layouts; output after the resume.
5. **restart** (A and B serving, requests back to back to both): the daemon
   taken over live (``gms serve --take-over``), then its server SIGKILLed
   (its keeper starts the next).  Every request's answer and latency, the
   layouts' hashes before and after, each engine's weight loads counted in
   its log; then B released and resumed on the server that came back.
6. **failover**: the coordinator (``gms failover``, ``engine = "sglang"``)
   over two sets of one engine; the serving engine SIGKILLed, the clock from
   the signal to the shadow's first token (bench/coordinated.py); the
   output of the set that serves after it.

Every output is compared with the reference; the JSON records each.  Timed
as a user sees them: an HTTP call from its send to its answer.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from _common import Server, add_out, gpu, log, print_table, versions, write_results
from coordinated import Coordinator
from failover import Nvml
from sglang_engines import SGLangEngine, generate, serve_argv, serve_env

ROOT = Path(__file__).resolve().parent.parent
PORTS = {"alone": 18300, "A": 18301, "B": 18302, "failover-A": 18311, "failover-B": 18312}
PARTS = ("share", "restart", "failover")
PROMPT = [5, 17, 99, 3, 250, 41, 7, 600, 12, 88, 301, 9]  # token ids every made-here vocabulary has
TOKENS = 24
LOAD_TOKENS = 8  # per request of the load kept on the engines through a restart


class Run:
    def __init__(self, args) -> None:
        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix="gms-sglang-", dir=args.work_root))
        self.nvml = Nvml()
        self.results: dict = {
            "gpu": gpu(), "shape": args.shape, "prompt": PROMPT, "completion_tokens": TOKENS, "outputs": {}, "engines": {},
            "versions": versions("sglang", "sglang-kernel", "torch", "gms", "transformers", "torch_memory_saver")}
        self.model = self._model()
        self.server = Server(str(self.work), "cuda", "gms", log=str(self.work / "gms-server.log"))
        self.socket = self.server.socket
        self.engines: dict[str, SGLangEngine] = {}

    def _model(self) -> str:
        folder = self.work / "model"
        out = subprocess.run([sys.executable, str(ROOT / "bench" / "vllm_model.py"), str(folder), "--shape",
                              self.args.shape], capture_output=True, text=True, check=True)
        self.results["model"] = json.loads(out.stdout.strip().splitlines()[-1])
        return str(folder)

    def start(self, name: str, **kw) -> SGLangEngine:
        argv = serve_argv(self.model, PORTS[name], **kw)
        engine = SGLangEngine(argv, serve_env(), self.work / f"{name}.log", PORTS[name])
        self.engines[name] = engine
        ready = engine.wait_ready()
        self.results["engines"][name] = {"argv": argv[2:], "ready_s": ready, **engine.load_line()}
        log(f"{name}: ready in {ready:.1f} s {engine.load_line()}")
        return engine

    def output(self, name: str, label: str) -> list[int]:
        got = self.engines[name].complete(PROMPT, TOKENS)
        self.results["outputs"][label] = got["token_ids"]
        return got["token_ids"]

    def layouts(self) -> list[dict]:
        from gms.client.probes import get_runtime_state

        state = get_runtime_state(self.socket)
        return [{"name": lay.name, "state": lay.state, "readers": lay.readers, "writer": lay.writer,
                 "bytes": lay.bytes, "gpu_bytes": lay.gpu_bytes, "hash": lay.memory_layout_hash}
                for lay in state.layouts]

    def used(self) -> int:
        return self.nvml.used(0)

    def run(self) -> dict:
        parts = self.args.parts
        if "share" in parts:
            self.share()
        if "restart" in parts:
            self.restart()
        for engine in self.engines.values():
            engine.stop()
        if "failover" in parts:
            self.failover()
        return self.results

    def share(self) -> None:
        r = self.results
        extra = {"gms_socket": self.socket}
        # 1. SGLang alone: its loader, its memory saver.
        before = self.used()
        alone = self.start("alone", load_format="auto")
        r["alone_added_bytes"] = self.used() - before
        reference = self.output("alone", "alone")
        r["alone_release"] = self._release_resume("alone", before_release=self.used())
        r["alone_after_resume_equal"] = self.output("alone", "alone_after_resume") == reference
        alone.stop()
        time.sleep(2)
        # 2. A publishes; 3. B imports.
        base = self.used()
        self.start("A", extra=extra)
        r["A_equal"] = self.output("A", "A") == reference
        before_b = self.used()
        self.start("B", extra={**extra, "gms_read_only": True})
        r["B_added_bytes"] = self.used() - before_b
        r["A_added_bytes"] = before_b - base
        r["B_equal"] = self.output("B", "B") == reference
        r["layouts_both_up"] = self.layouts()
        # 4. B releases and resumes everything.
        r["B_release"] = self._release_resume("B", before_release=self.used())
        r["B_after_resume_equal"] = self.output("B", "B_after_resume") == reference
        r["A_after_B_resume_equal"] = self.output("A", "A_after_B_resume") == reference

    def restart(self) -> None:
        """5. The daemon taken over, then SIGKILLed, under A and B serving."""
        from gms.client.probes import get_runtime_state

        reference = self.results["outputs"]["alone"]
        loads = {name: Load(self.engines[name].url, reference[:LOAD_TOKENS]) for name in ("A", "B")}
        for load in loads.values():
            load.start()
        time.sleep(3)
        out: dict = {"layouts_before": self.layouts()}
        old = get_runtime_state(self.socket).pid
        took_over = time.time()
        new = Server(str(self.work), "cuda", "gms", "--take-over", log=str(self.work / "gms-server-take-over.log"))
        self._serving_after(old)
        serving = time.time()
        self.server.proc.wait(120)
        out["take_over"] = {"launch_to_serving_s": serving - took_over, "old_exit": self.server.proc.returncode}
        self.server.stop()
        self.server = new
        time.sleep(3)
        out["layouts_after_take_over"] = self.layouts()
        old = get_runtime_state(self.socket).pid
        killed = time.time()
        os.kill(old, signal.SIGKILL)
        self._serving_after(old)
        back = time.time()
        out["sigkill"] = {"to_serving_s": back - killed}
        time.sleep(3)
        for load in loads.values():
            load.halt()
        out["layouts_after_sigkill"] = self.layouts()
        out["requests"] = {name: {"all": load.window(0, time.time()),
                                  "take_over": load.window(took_over, serving + 1),
                                  "sigkill": load.window(killed, back + 1)} for name, load in loads.items()}
        out["weight_loads"] = {name: self.engines[name].log().count("Load weight end") for name in ("A", "B")}
        out["gms_loads"] = {name: {how: self.engines[name].log().count(f"gms: weights {how}") for how in (
            "imported", "loaded from disk and published")} for name in ("A", "B")}
        log(f"take-over: serving in {out['take_over']['launch_to_serving_s']:.3f} s; SIGKILL: serving in "
            f"{out['sigkill']['to_serving_s']:.3f} s; requests failed: "
            f"{ {n: q['all']['failed'] for n, q in out['requests'].items()} }")
        # B released and resumed on the server that came back: its weights
        # reader finds the kept layout, its scratch is made anew there.
        out["B_release"] = self._release_resume("B", before_release=self.used())
        out["B_after_equal"] = self.output("B", "B_after_restarts") == reference
        out["A_after_equal"] = self.output("A", "A_after_restarts") == reference
        out["layouts_after_B_resume"] = self.layouts()
        self.results["restart"] = out

    def _serving_after(self, pid: int, timeout: float = 120) -> None:
        """Until a server other than ``pid`` answers on the socket."""
        from gms.client.probes import get_runtime_state
        from gms.errors import GMSError

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if get_runtime_state(self.socket, timeout=5).pid != pid:
                    return
            except GMSError:
                pass
            time.sleep(0.005)
        raise RuntimeError(f"no server but {pid} within {timeout} s")

    def failover(self) -> None:
        """6. The coordinator over two SGLang engines; the primary SIGKILLed."""
        args = self.args
        commands = {name: (PORTS[f"failover-{name}"], serve_argv(self.model, PORTS[f"failover-{name}"],
                                                                 extra={"gms_socket": self.socket}))
                    for name in ("A", "B")}
        coordinator = Coordinator(self.work / "failover", [self.socket], commands, serve_env(), engine="sglang",
                                  interval=args.interval, failures=args.failures, canary_timeout=args.canary_timeout)
        runs: list[dict] = []
        try:
            self.results["failover_bring_up_s"] = coordinator.wait_ready()
            log(f"failover: both sets ready in {self.results['failover_bring_up_s']:.1f} s")
            first = generate(coordinator.url("A"), PROMPT, TOKENS)["token_ids"]  # the primary's, before any kill
            self.results["outputs"]["failover_primary"] = first
            for n in range(args.repeats):
                runs.append(coordinator.fail_over())
                log(f"failover {n}: signal -> first token {runs[-1]['signal_to_first_token_s']:.3f} s")
            serving = runs[-1]["serving"]
            got = generate(coordinator.url(serving), PROMPT, TOKENS)["token_ids"]
            self.results["outputs"]["failover"] = got
            self.results["failover_output_equal"] = got == self.results["outputs"].get("alone", first)
        finally:
            coordinator.close(self.work / "failover-tail.log")
            self.results["failover"] = coordinator.results(runs)

    def _release_resume(self, name: str, before_release: int) -> dict:
        engine = self.engines[name]
        out: dict = {"release_s": engine.release()}
        out["freed_bytes"] = before_release - self.used()
        if name != "alone":
            out["health_released"] = engine.gms_health()
            out["layouts_released"] = self.layouts()
        out["resume_s"] = engine.resume()
        out["taken_back_bytes"] = self.used() - (before_release - out["freed_bytes"])
        if name != "alone":
            out["health_resumed"] = engine.gms_health()
        log(f"{name}: release {out['release_s']:.3f} s (freed {out['freed_bytes'] / 2**20:.0f} MiB), "
            f"resume {out['resume_s']:.3f} s")
        return out

    def close(self) -> None:
        for engine in self.engines.values():
            engine.stop()
        self.server.stop()
        for name, engine in self.engines.items():
            self.results["engines"].setdefault(name, {})["log_tail"] = engine.tail(40)


class Load(threading.Thread):
    """Greedy requests to one engine, back to back, until halted: each one's
    start, latency, whether it was answered and gave ``expect``."""

    def __init__(self, url: str, expect: list[int]) -> None:
        super().__init__(daemon=True)
        self.url, self.expect = url, expect
        self.rows: list[tuple[float, float, bool, bool]] = []
        self.errors: list[str] = []
        self._halt = threading.Event()

    def run(self) -> None:
        with httpx.Client() as client:
            while not self._halt.is_set():
                started = time.time()
                try:
                    got = generate(self.url, PROMPT, len(self.expect), timeout=60, client=client)["token_ids"]
                    self.rows.append((started, time.time() - started, True, got == self.expect))
                except httpx.HTTPError as exc:
                    self.rows.append((started, time.time() - started, False, False))
                    self.errors.append(f"{type(exc).__name__}: {exc}"[:200])

    def halt(self) -> None:
        self._halt.set()
        self.join(120)

    def window(self, start: float, end: float) -> dict:
        rows = [r for r in self.rows if start <= r[0] <= end]
        return {"n": len(rows), "failed": sum(1 for r in rows if not r[2]),
                "unequal": sum(1 for r in rows if r[2] and not r[3]),
                "max_latency_s": max((r[1] for r in rows), default=None),
                "median_latency_s": sorted(r[1] for r in rows)[len(rows) // 2] if rows else None,
                "errors": self.errors[:5]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="tiny", choices=("tiny", "llama-2b"))
    add_out(p)
    p.add_argument("--work-root", default=os.environ.get("TMPDIR", "/tmp"))
    p.add_argument("--parts", default=",".join(PARTS), help="of: " + ", ".join(PARTS) + " (restart needs share)")
    p.add_argument("--repeats", type=int, default=2, help="failovers (the failed set comes back as the shadow)")
    p.add_argument("--interval", type=float, default=0.1, help="the coordinator's probe interval, s")
    p.add_argument("--failures", type=int, default=3)
    p.add_argument("--canary-timeout", type=float, default=5.0)
    args = p.parse_args()
    args.parts = set(args.parts.split(","))
    if not args.parts <= set(PARTS) or ("restart" in args.parts and "share" not in args.parts):
        p.error(f"--parts: of {', '.join(PARTS)}; restart needs share")
    run = Run(args)
    try:
        results = run.run()
    finally:
        run.close()
        write_results(args.out, "sglang_gms", run.results)
    print_table("SGLang on gms (" + results["gpu"]["name"] + ")", rows(results))


def rows(r: dict) -> list[tuple]:
    MiB = 1 << 20
    out = []
    if "B_release" in r:
        out += [
            ("SGLang alone: weight load s", r["engines"]["alone"].get("sglang_load_s")),
            ("A (gms, publishes): weight load s", r["engines"]["A"].get("sglang_load_s")),
            ("B (gms, imports): weight load s", r["engines"]["B"].get("sglang_load_s")),
            ("GPU memory added, SGLang alone MiB", r["alone_added_bytes"] // MiB),
            ("GPU memory added, B MiB", r["B_added_bytes"] // MiB),
            ("release s / freed MiB, SGLang alone", (f"{r['alone_release']['release_s']:.3f} / "
             f"{r['alone_release']['freed_bytes'] // MiB}")),
            ("release s / freed MiB, B", f"{r['B_release']['release_s']:.3f} / {r['B_release']['freed_bytes'] // MiB}"),
            ("resume s, SGLang alone / B", f"{r['alone_release']['resume_s']:.3f} / {r['B_release']['resume_s']:.3f}"),
            ("outputs equal (A, B, B after resume, alone after resume)",
             (r["A_equal"], r["B_equal"], r["B_after_resume_equal"], r["alone_after_resume_equal"])),
        ]
    if "restart" in r:
        x = r["restart"]
        out += [
            ("take-over: launch to serving s", f"{x['take_over']['launch_to_serving_s']:.3f}"),
            ("SIGKILL: to serving s", f"{x['sigkill']['to_serving_s']:.3f}"),
            ("requests through both (n / failed / unequal)",
             " ".join(f"{n}: {q['all']['n']}/{q['all']['failed']}/{q['all']['unequal']}"
                      for n, q in x["requests"].items())),
            ("weight loads in the logs (A, B)", (x["weight_loads"]["A"], x["weight_loads"]["B"])),
            ("B after release and resume on the new server: equal", x["B_after_equal"]),
        ]
    f = r.get("failover")
    if f and f["signal_to_first_token_s"]:
        out += [("SIGKILL of the primary -> shadow's first token s (median)",
                 f"{f['signal_to_first_token_s']['median']:.3f}"),
                ("output after the failover equal", r.get("failover_output_equal"))]
    return out


if __name__ == "__main__":
    main()
