"""gms against vLLM's own weight daemon, side by side: vLLM alone, ``vllm preload`` + ipc_cache, gms.

    python3 bench/vllm_daemons.py [--model DIR] [--shape llama-2b] [--setups alone,ipc_cache,gms] [--eager]

vLLM 0.33 ships a weight daemon: ``vllm preload`` holds a model's weights
in GPU memory and serves them to engines started with ``--load-format
ipc_cache`` over legacy CUDA IPC (zero-copy by default).  This script runs
the three ways a user can start engines on one GPU, one after another on the
same model, and asks each the same questions:

* **alone**: every engine reads the checkpoint (``--load-format safetensors``);
* **ipc_cache**: ``vllm preload`` first (its ``/health`` says when it serves),
  then engines with ``--load-format ipc_cache`` (vLLM's defaults: zero-copy,
  falling back to the disk when the daemon cannot serve);
* **gms**: ``gms serve`` as a user starts it (keeper and spare on), then
  engines with ``--load-format gms`` (the first publishes, the rest import).

For each setup, in this order:

1. engine 1, then engine 2: spawn to ready (``/v1/models`` answers), the
   weight-load figure the engine logs, how its weights came (disk, the
   daemon, gms), the GPU memory it added (NVML), its greedy output;
2. engines 3 and 4 started together: GPU memory with 1, 2 and 4 engines
   (over the GPU's use before the setup began: its daemon included);
3. engines 2-4 stopped; ``/sleep`` and ``/wake_up`` on engine 1 (alone with
   ``--enable-sleep-mode``; ipc_cache and gms as started: what each answers);
4. the daemon SIGKILLed under engine 1 (the ``vllm preload`` group; the gms
   *server*, whose keeper starts the next one): does engine 1 still answer,
   the same tokens; the daemon back (preload started again; gms: its
   keeper's), seconds until it serves; an engine started then: how its
   weights came, and the GPU memory it added (a second copy?);
5. engine 1 SIGKILLed and started again: spawn to ready, weight load;
6. another checkpoint with the same shapes (same tensor names, dtypes and
   sizes, other values: ``vllm_model.py --seed 1``) in another folder, an
   engine on it: are its tokens that checkpoint's own (alone's answer: alone
   reads it from disk, so alone runs first)?

Every engine has the same fixed KV cache (``--kv-cache-memory-bytes``) and
the run shares one compile cache, so start times differ by the weights'
path.  ``--eager`` (no torch.compile, no CUDA graphs) shortens every start
alike; the GPU tests run with graphs (tests/test_vllm_gpu.py).  Needs vLLM
0.33 or later (``vllm preload``); never imports it itself.  Writes
``vllm_daemons_<gpu>.json`` under ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from _common import add_out, gpu, log, print_table, versions, wait_for, write_results
from failover import Nvml
from llama_checkpoint import warm
from vllm_engines import SERVE, Engine, GiB, serve_argv, serve_env

ROOT = Path(__file__).resolve().parent.parent
PORTS = {"alone": 18400, "ipc_cache": 18420, "gms": 18440}  # each setup's engines count up from its port
PROMPT = "The weights stay in the daemon while engines come and go, and"
TOKENS = 24
SETUPS = ("alone", "ipc_cache", "gms")
# How an engine's weights came, from its log: vLLM's own lines and the gms loader's.
HOW = (
    (re.compile(r"Mapped \d+ tensors from the weight cache daemon"), "daemon (ipc)"),
    (re.compile(r"Weight cache unusable .*falling back to disk loading"), "disk (daemon unusable)"),
    (re.compile(r"gms: weights imported"), "gms (imported)"),
    (re.compile(r"gms: weights loaded from disk and published"), "disk (published to gms)"),
)


def preload_argv(model: str, socket_dir: str, health_port: int, *, max_model_len: int, eager: bool) -> list[str]:
    """``vllm preload`` for one GPU, as vLLM's docs start it, with a health port to wait on."""
    argv = [*SERVE[:-1], "preload", "--model", model, "--served-model-name", "model",
            "--max-model-len", str(max_model_len), "--weight-cache-socket-dir", socket_dir,
            "--weight-cache-health-port", str(health_port), "--weight-cache-health-host", "127.0.0.1"]
    return [*argv, "--enforce-eager"] if eager else argv


class Setup:
    """One way of running engines: its daemon (none for alone), engines and figures.
    (bench/sglang_daemons.py asks SGLang the same questions: what differs is a class attribute
    or a method there.)"""

    PORTS = PORTS
    HOW = HOW
    PROMPT = PROMPT

    def __init__(self, bench: Bench, name: str) -> None:
        self.bench, self.name = bench, name
        self.work = bench.work / name
        self.work.mkdir()
        self.health_port = self.PORTS[name] + 19
        self.ports = itertools.count(self.PORTS[name] + 1)  # never one a stopped engine had (TIME_WAIT)
        self.engines: dict[str, Engine] = {}
        self.daemon: subprocess.Popen | None = None
        self.socket = str(self.work / "gms.sock")
        self.sockets = self.work / "ipc"
        self.results: dict = bench.results.setdefault(name, {})  # in the bench's JSON as it is measured

    # -- the daemon ------------------------------------------------------------------------

    def start_daemon(self) -> float:
        """Start this setup's weight daemon; seconds until it serves (0 for alone)."""
        started = time.perf_counter()
        daemon_log = open(self.work / "daemon.log", "ab")  # noqa: SIM115 - the daemon's; closed with the setup
        if self.name == "gms":
            self.daemon = subprocess.Popen([sys.executable, "-m", "gms", "serve", "--backend", "cuda", "--socket",
                                            self.socket, "--state-dir", str(self.work / "gms-state"),
                                            "--log-level", "warning"],
                                           stdout=daemon_log, stderr=subprocess.STDOUT, start_new_session=True)
            wait_for(self._gms_serves, 120, "gms serve")
        elif self.name == "ipc_cache":
            self.sockets.mkdir(exist_ok=True)
            argv = preload_argv(self.bench.model, str(self.sockets), self.health_port,
                                max_model_len=self.bench.args.max_model_len, eager=self.bench.args.eager)
            self.daemon = subprocess.Popen(argv, env=serve_env(self.bench.cache), stdout=daemon_log,
                                           stderr=subprocess.STDOUT, start_new_session=True)
            wait_for(self._preload_serves, self.bench.args.ready_timeout, "vllm preload's /health")
        daemon_log.close()  # the child holds its own copy
        return time.perf_counter() - started

    def _gms_serves(self) -> bool:
        from gms import get_runtime_state
        from gms.errors import GMSError

        if self.daemon.poll() is not None:
            raise RuntimeError(f"gms serve exited: see {self.work / 'daemon.log'}")
        try:
            get_runtime_state(self.socket, timeout=1)
            return True
        except GMSError:
            return False

    def _preload_serves(self) -> bool:
        if self.daemon.poll() is not None:
            raise RuntimeError(f"vllm preload exited with {self.daemon.returncode}: see {self.work / 'daemon.log'}")
        try:
            return httpx.get(f"http://127.0.0.1:{self.health_port}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def kill_daemon(self) -> float:
        """SIGKILL the daemon under serving engines; seconds until it serves again.

        gms: the server process alone (``gms status`` names it); its keeper starts
        the next one.  ipc_cache: the whole ``vllm preload`` group, started again
        as a user would (nothing restarts it)."""
        killed = time.perf_counter()
        if self.name == "gms":
            from gms import get_runtime_state

            server = get_runtime_state(self.socket).pid
            killed = time.perf_counter()
            os.kill(server, signal.SIGKILL)
            wait_for(lambda: self._gms_serves() and get_runtime_state(self.socket).pid != server, 60,
                     "the keeper's next server")
            return time.perf_counter() - killed
        os.killpg(self.daemon.pid, signal.SIGKILL)
        self.daemon.wait()
        self.start_daemon()
        return time.perf_counter() - killed

    def stop_daemon(self) -> None:
        if self.daemon is None or self.daemon.poll() is not None:
            return
        os.killpg(self.daemon.pid, signal.SIGTERM)
        try:
            self.daemon.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.daemon.pid, signal.SIGKILL)
            self.daemon.wait()

    # -- engines ---------------------------------------------------------------------------

    def argv(self, model: str | None = None, sleep_mode: bool = False) -> list[str]:
        args = self.bench.args
        model = model or self.bench.model
        port = next(self.ports)
        options = {"kv_bytes": self.bench.kv_bytes, "gpu_utilization": args.gpu_utilization,
                   "max_model_len": args.max_model_len, "max_num_seqs": 4, "eager": args.eager}
        if self.name == "alone":
            return serve_argv(model, port, load_format="safetensors", sleep_mode=sleep_mode, **options)
        if self.name == "ipc_cache":
            return serve_argv(model, port, load_format="ipc_cache", extra={"socket_dir": str(self.sockets)},
                              **options)
        return serve_argv(model, port, extra={"gms_socket": self.socket}, **options)

    def spawn(self, key: str, **kw) -> Engine:
        argv = self.argv(**kw)
        port = int(argv[argv.index("--port") + 1])
        engine = self.engine(argv, self.work / f"{key}.log", port)
        self.engines[key] = engine
        return engine

    def engine(self, argv: list[str], log_path: Path, port: int) -> Engine:
        return Engine(argv, serve_env(self.bench.cache), log_path, port)

    def start(self, key: str, **kw) -> dict:
        """Start engine ``key`` alone on what the GPU holds now: its figures and first answer."""
        before = self.bench.used()
        engine = self.spawn(key, **kw)
        ready_s = engine.wait_ready(self.bench.args.ready_timeout)
        first = engine.complete(self.PROMPT, TOKENS)
        text = engine.log()
        how = next((what for pattern, what in self.HOW if pattern.search(text)), "disk")
        out = {"spawn_to_ready_s": ready_s, "weights_from": how, "tokens": first["token_ids"],
               "gpu_memory_added_bytes": self.bench.used() - before, **engine.load_line()}
        log(f"{self.name}/{key}: ready in {ready_s:.1f} s, weights from {how}, load {out.get(self.bench.LOAD_KEY)} s, "
            f"+{out['gpu_memory_added_bytes'] / GiB:.2f} GiB")
        return out

    def stop(self, key: str) -> None:
        engine = self.engines.pop(key)
        engine.stop()
        with open(self.bench.work / "engines-tail.log", "a") as f:
            f.write(f"===== {self.name}/{key}: {' '.join(engine.argv)}\n{engine.tail(120)}\n")

    # -- the questions ------------------------------------------------------------------------

    def run(self) -> dict:
        """Every row, each written to the JSON as soon as it is measured (a lease may end mid-run)."""
        r, save = self.results, self.bench.save
        idle = self.bench.used()
        r["daemon_start_s"] = self.start_daemon()
        r["daemon_bytes"] = self.bench.used() - idle
        log(f"{self.name}: daemon serving in {r['daemon_start_s'] or 0:.1f} s, holding {r['daemon_bytes'] / GiB:.2f} GiB")
        r["e1"] = self.start("e1", sleep_mode=self.name == "alone")
        r["memory_1_2_4"] = [self.bench.used() - idle]
        save()
        r["e2"] = self.start("e2")
        r["memory_1_2_4"].append(self.bench.used() - idle)
        save()
        for key in ("e3", "e4"):
            self.spawn(key)
        for key in ("e3", "e4"):
            self.engines[key].wait_ready(self.bench.args.ready_timeout)
        r["memory_1_2_4"].append(self.bench.used() - idle)
        log(f"{self.name}: GPU memory with 1, 2 and 4 engines (the daemon's included): "
            + ", ".join(f"{b / GiB:.2f}" for b in r["memory_1_2_4"]) + " GiB")
        save()
        for key in ("e2", "e3", "e4"):
            self.stop(key)
        r["sleep"] = self.sleep_wake("e1", r["e1"]["tokens"])
        save()
        if self.name != "alone":
            r["daemon_killed"] = self.daemon_killed("e1", r["e1"]["tokens"])
            save()
        r["engine_restarted"] = self.engine_restarted("e1")
        save()
        r["other_checkpoint"] = self.start("other", model=self.bench.other)
        save()
        return r

    def sleep_wake(self, key: str, reference: list[int]) -> dict:
        engine = self.engines[key]
        before = self.bench.used()
        try:
            sleep_s = engine.sleep()
            asleep = self.bench.settled()  # (gms frees a dropped layout's memory just after the answer)
            wake_s = engine.wake()
        except httpx.HTTPError as e:
            return {"supported": False, "answer": _answer(e)}
        after = engine.complete(self.PROMPT, TOKENS)["token_ids"]
        out = {"supported": True, "sleep_s": sleep_s, "wake_s": wake_s, "released_bytes": before - asleep,
               "tokens_equal_after_wake": after == reference}
        log(f"{self.name}/{key}: sleep {sleep_s * 1e3:.0f} ms, wake {wake_s * 1e3:.0f} ms, "
            f"released {out['released_bytes'] / GiB:.2f} GiB, equal after: {out['tokens_equal_after_wake']}")
        return out

    def daemon_killed(self, key: str, reference: list[int]) -> dict:
        engine = self.engines[key]
        used = self.bench.used()
        back_s = self.kill_daemon()
        try:
            answer = engine.complete(self.PROMPT, TOKENS)["token_ids"]
            out = {"engine_answers": True, "tokens_equal": answer == reference}
        except httpx.HTTPError as e:
            out = {"engine_answers": False, "error": _answer(e)}
        out["daemon_back_s"] = back_s
        out["daemon_back_bytes"] = self.bench.used() - used  # a daemon that reloaded: a second copy
        out["next_engine"] = self.start("after-kill")
        self.stop("after-kill")
        log(f"{self.name}: daemon killed: engine answers {out['engine_answers']}, back in {back_s:.2f} s "
            f"(+{out['daemon_back_bytes'] / GiB:.2f} GiB), next engine's weights from "
            f"{out['next_engine']['weights_from']}")
        return out

    def engine_restarted(self, key: str) -> dict:
        os.killpg(self.engines[key].proc.pid, signal.SIGKILL)
        self.stop(key)
        self.bench.wait_memory_back()
        return self.start(key + "-again")

    def close(self) -> None:
        for key in list(self.engines):
            self.stop(key)
        self.stop_daemon()


def _answer(e: httpx.HTTPError) -> str:
    response = getattr(e, "response", None)
    return f"{response.status_code} {response.text[:200]}" if response is not None else str(e)[:200]


class Bench:
    SETUP = Setup
    PREFIX = "vllm_daemons"  # the results' file name, before the GPU's
    PACKAGES = ("vllm", "torch", "gms", "transformers")
    LOAD_KEY = "vllm_load_s"  # the engine's own weight-load figure (Engine.load_line)
    SETUPS = SETUPS
    ENGINE, VERBS = "vLLM", ("/sleep", "/wake_up")  # (the table's words)
    TITLE = "gms against vLLM's own weight daemon"

    def __init__(self, args) -> None:
        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix=f"gms-{self.PREFIX.replace('_', '-')}-", dir=args.work_root))
        self.nvml = Nvml()
        self.cache = args.cache_root
        self.kv_bytes = int(args.kv_gib * GiB)
        self.model = self._made(Path(args.model), 0)
        self.other = self._made(Path(args.model + "-seed1"), 1)
        self.results: dict = {"gpu": gpu(), "versions": versions(*self.PACKAGES),
                              "kv_cache_bytes": self.kv_bytes, "eager": args.eager, "shape": args.shape,
                              "prompt": self.SETUP.PROMPT, "completion_tokens": TOKENS}

    def _made(self, folder: Path, seed: int) -> str:
        if not (folder / "config.json").exists():
            log(f"making {folder} (bench/vllm_model.py --shape {self.args.shape} --seed {seed})")
            subprocess.run([sys.executable, str(ROOT / "bench" / "vllm_model.py"), str(folder), "--shape",
                            self.args.shape, "--seed", str(seed)], check=True, capture_output=True)
        for f in folder.glob("*.safetensors"):
            warm(str(f))  # every setup reads a warm page cache
        return str(folder)

    def used(self) -> int:
        return self.nvml.used(0)

    def settled(self, timeout: float = 10) -> int:
        """The GPU's use once it stops falling for a second: what a release left."""
        last, deadline = self.used(), time.monotonic() + timeout
        while time.monotonic() < deadline:
            time.sleep(1.0)
            now = self.used()
            if now >= last - (16 << 20):
                return now
            last = now
        return last

    def wait_memory_back(self, timeout: float = 60) -> None:
        """Until the GPU's use stops falling: a killed engine's memory returns
        when the driver has torn its process down."""
        before, deadline = self.used(), time.monotonic() + timeout
        while time.monotonic() < deadline:
            time.sleep(0.5)
            now = self.used()
            if now >= before - (64 << 20):
                return
            before = now

    @property
    def name(self) -> str:
        """The results' file name: <PREFIX>_<the GPU's model, e.g. h100>."""
        tag = re.search(r"\b([A-Z]\d{2,4})\b", self.results["gpu"]["name"])
        return f"{self.PREFIX}_{tag.group(1).lower() if tag else 'gpu'}"

    def save(self) -> Path:
        return write_results(self.args.out, self.name, self.results)

    def run(self) -> None:
        for name in self.args.setups:
            setup = self.SETUP(self, name)
            try:
                self.results[name] = setup.run()
            except Exception as e:  # noqa: BLE001 - the next setup still runs; the failure is recorded
                log(f"{name}: failed: {e!r}")
                self.results[name] = {**setup.results, "failed": repr(e)[:2000]}
            finally:
                setup.close()
                self.wait_memory_back()
        own = self.results.get("alone", {}).get("other_checkpoint", {}).get("tokens")
        for name in self.args.setups:
            other = self.results[name].get("other_checkpoint")
            if other and own:
                other["tokens_are_its_own"] = other["tokens"] == own

    def run_and_report(self) -> None:
        """Every setup; then the JSON, the engines' log tails and each daemon's log under
        ``--out``, the work folder removed, and the table."""
        log(f"{self.results['gpu']}, {self.results['versions']}, work {self.work}")
        try:
            self.run()
        finally:
            name, out = self.name, self.save()
            if (self.work / "engines-tail.log").exists():
                shutil.copy(self.work / "engines-tail.log", out.parent / f"{name}_engines.log")
            for setup in self.SETUPS:
                if (self.work / setup / "daemon.log").exists():
                    shutil.copy(self.work / setup / "daemon.log", out.parent / f"{name}_{setup}_daemon.log")
            shutil.rmtree(self.work, ignore_errors=True)
        package = self.PACKAGES[0]
        print_table(f"{self.TITLE} ({self.results['gpu']['name']}, {self.ENGINE} {self.results['versions'].get(package)})",
                    rows(self.results, self.SETUPS, self.ENGINE, self.LOAD_KEY, self.VERBS), ("figure", *self.SETUPS))


def rows(r: dict, setups: tuple[str, ...], engine: str, load_key: str, verbs: tuple[str, str]) -> list[tuple]:
    def gib(v) -> str:
        return f"{v / GiB:.2f}"

    def sleep(x) -> str:
        return f"{x['sleep']['sleep_s']:.3f}" if x["sleep"]["supported"] else "no: " + x["sleep"]["answer"][:60]

    table = (
        ("daemon: start to serving, s", lambda x: f"{x['daemon_start_s']:.1f}" if x["daemon_start_s"] else "—"),
        ("first engine: spawn to ready, s", lambda x: f"{x['e1']['spawn_to_ready_s']:.1f}"),
        ("second engine: spawn to ready, s", lambda x: f"{x['e2']['spawn_to_ready_s']:.1f}"),
        (f"second engine: weight load ({engine}'s line), s", lambda x: f"{x['e2'][load_key]:.2f}"),
        ("second engine: weights from", lambda x: x["e2"]["weights_from"]),
        ("GPU memory, 1 engine (daemon included), GiB", lambda x: gib(x["memory_1_2_4"][0])),
        ("GPU memory, 2 engines, GiB", lambda x: gib(x["memory_1_2_4"][1])),
        ("GPU memory, 4 engines, GiB", lambda x: gib(x["memory_1_2_4"][2])),
        (f"{verbs[0]}, s", sleep),
        (f"{verbs[1]}, s", lambda x: f"{x['sleep']['wake_s']:.3f}"),
        ("GPU memory a sleep releases, GiB", lambda x: gib(x["sleep"]["released_bytes"])),
        ("same tokens after the wake", lambda x: str(x["sleep"]["tokens_equal_after_wake"])),
        ("daemon SIGKILLed: the serving engine answers, same tokens",
         lambda x: f"{x['daemon_killed']['engine_answers']}, {x['daemon_killed'].get('tokens_equal')}"),
        ("daemon SIGKILLed: serving again after, s", lambda x: f"{x['daemon_killed']['daemon_back_s']:.2f}"),
        ("daemon SIGKILLed: GPU memory its return adds, GiB",
         lambda x: gib(x["daemon_killed"]["daemon_back_bytes"])),
        ("daemon SIGKILLed: the next engine's weights from",
         lambda x: x["daemon_killed"]["next_engine"]["weights_from"]),
        ("engine SIGKILLed, started again: spawn to ready, s",
         lambda x: f"{x['engine_restarted']['spawn_to_ready_s']:.1f}"),
        ("engine SIGKILLed, started again: weights from", lambda x: x["engine_restarted"]["weights_from"]),
        ("another checkpoint, same shapes: weights from", lambda x: x["other_checkpoint"]["weights_from"]),
        ("another checkpoint, same shapes: its own tokens",
         lambda x: str(x["other_checkpoint"]["tokens_are_its_own"])),
    )

    def cell(name: str, fn) -> str:
        try:
            return fn(r[name])
        except (KeyError, TypeError):
            return "—"

    return [(what, *(cell(name, fn) for name in setups)) for what, fn in table]


def parser(doc: str, setups: tuple[str, ...]) -> argparse.ArgumentParser:
    """The arguments every side-by-side takes (bench/sglang_daemons.py's too)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    add_out(p)
    p.add_argument("--model", default="/var/tmp/gms-vllm-model", help="made there unless it holds a model")
    p.add_argument("--shape", default="llama-2b")
    p.add_argument("--setups", default=",".join(setups), type=lambda v: v.split(","),
                   help="which, in order (alone first: its answer on the other checkpoint is the reference)")
    p.add_argument("--work-root", default=None, help="where the run's folder goes (default: the temp dir)")
    return p


def parsed(p: argparse.ArgumentParser, setups: tuple[str, ...]) -> argparse.Namespace:
    args = p.parse_args()
    if not set(args.setups) <= set(setups):
        p.error(f"--setups: some of {setups}")
    return args


def main() -> int:
    p = parser(__doc__, SETUPS)
    p.add_argument("--kv-gib", type=float, default=1.0, help="KV cache per engine (--kv-cache-memory-bytes)")
    p.add_argument("--gpu-utilization", type=float, default=0.08, help="vLLM's start gate only (the KV is fixed)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--eager", action="store_true", help="--enforce-eager everywhere (no compile, no graphs)")
    p.add_argument("--ready-timeout", type=float, default=600)
    p.add_argument("--cache-root", default="/var/tmp/gms-vllm-cache", help="VLLM_CACHE_ROOT (compile cache)")
    Bench(parsed(p, SETUPS)).run_and_report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
