"""vLLM on gms against vLLM on its own: shared weights, sleep and wake, failover.

    python3 bench/vllm.py [--parts share,sleep,failover] [--model DIR] [--kv-gib 4] [--repeats 3]
    python3 bench/vllm.py --tp 2 [--fault kill-rank] ...     # tensor parallel, one gms server per GPU
    python3 bench/vllm.py --parts failover --fault hang --saturate-s 180 [--busy-cpus 16]  # a hung primary; a busy one

With ``--tp N`` every engine (the baseline too) runs ``--tensor-parallel-size
N``; gms runs as ``gms serve --devices all`` (one server per GPU, its socket
in the run's folder through ``GMS_SOCKET_DIR``, which the engines' loader
reads too), each rank's shard on its own GPU's server; memory is summed over
the N GPUs; the coordinator's ranks are the N sockets.

``--fault`` is what befalls the serving engine in the failover part:
``kill`` (SIGKILL of its launcher, the default), ``kill-rank`` (SIGKILL of
only the last rank's process: found as the process under its launcher that
holds a session on that GPU's server), ``hang`` and ``hang-rank`` (SIGSTOP of
the engine core, or of the last rank's process: alive, answering nothing; the
coordinator must see it stop making progress); a comma list takes turns over
the ``--repeats`` failovers.  ``--saturate-s S`` first
keeps the primary's batch full for S seconds (long prompts, long answers),
with ``--busy-cpus N`` processes spinning on the host meanwhile, and records
that no failover came of it.

A Llama of 2.2 B parameters (bench/vllm_model.py: random bf16 weights, a
tokenizer trained offline; made in DIR unless it holds one already), one
gms server, and real ``vllm serve`` engines (bench/vllm_engines.py), each
with the same fixed KV cache (``--kv-cache-memory-bytes``).  Greedy
completions through vLLM's OpenAI endpoint check every output against the
baseline's.  Each part runs alone or with the others:

* **share**: the baseline, vLLM's default loader (``--load-format
  safetensors``), starts alone: its weight-load time (vLLM's own "Model
  loading took" line), its start to first answer, and the GPU memory it adds
  (NVML); then gms engine A (the first: loads from disk and publishes) and
  gms engine B (imports A's weights): the same three figures for each.  The
  figure of the issue is B against the baseline: load time and memory added.
* **sleep**: ``POST /sleep`` (level 1) and ``POST /wake_up`` through vLLM's
  own endpoints, ``--repeats`` times per engine, against vLLM's own sleep
  mode on the baseline (``--enable-sleep-mode``: CuMem, weights copied to
  host memory and back): seconds for each, GPU memory released, and the
  greedy output before and after, which must be equal.
* **failover**: the example coordinator (``gms failover``, health path
  ``/gms/health``) drives two gms engines, A serving and B asleep; the
  primary's API server is SIGKILLed (its engine core follows it: the gms
  worker exits with its parent) and a client waits for the shadow's first
  token through ``/v1/completions``.  ``--repeats`` failovers (the failed set
  comes back as the shadow before the next).  Baseline: a fresh vLLM with
  the default loader, from spawn to first token (from ``share`` when it ran).

Page cache: the checkpoint is read once before the baseline (warm, vLLM's
best case); ``--cold`` drops it before the baseline and before engine A.
Writes ``vllm_<gpu>_<parts>.json`` and ``vllm_engines.log`` (the tail of every
engine's log) under ``--out`` (bench/_common.out_dir); prints a
table with every ratio.  Needs vLLM (scripts/gpu-vllm-install.sh on the GPU
host); never imports it itself, so it holds no CUDA context of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import add_out, gpu, log, out_dir, print_table, versions, wait_served, write_results
from coordinated import Coordinator
from failover import Nvml
from llama_checkpoint import evict, warm
from vllm_engines import Engine, GiB, serve_argv, serve_env

# This file is bench/vllm.py: with bench/ first on sys.path, "import vllm" here
# would find this script rather than vLLM.  Nothing below imports vLLM, but
# the folder goes from the path all the same.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The shadow engine wakes up when the primary fails, and the weights stay where they are:"
TOKENS = 32
PORTS = {"baseline": 18200, "A": 18201, "B": 18202, "failover-A": 18211, "failover-B": 18212}


class Bench:
    def __init__(self, args) -> None:
        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix="gms-vllm-bench-", dir=args.work_root))
        self.nvml = Nvml()
        self.cache = args.cache_root
        self.kv_bytes = int(args.kv_gib * GiB)
        self.engines: dict[str, Engine] = {}
        self.results: dict = {"gpu": gpu(), "versions": versions("vllm", "torch", "gms", "transformers", "cuda-bindings"), "kv_cache_bytes": self.kv_bytes,
                              "prompt": PROMPT, "completion_tokens": TOKENS,
                              "page_cache": "cold" if args.cold else "warm"}
        self.model = self._model()
        self.tp = args.tp
        self.results["tensor_parallel"] = self.tp
        self.server_log = open(self.work / "gms-server.log", "wb")
        self.env: dict[str, str] = {}  # what the engines' environment adds for gms
        if self.tp == 1:
            self.sockets = [str(self.work / "gms.sock")]
            where = ["--socket", self.sockets[0]]
        else:  # a server per GPU, each on its default socket in a folder of the run's
            from gms.cuda.vmm import device_uuid  # the driver's word, no context made
            from gms.system.paths import socket_path_in

            folder = self.work / "sockets"
            folder.mkdir(mode=0o700)
            self.env = {"GMS_SOCKET_DIR": str(folder)}
            self.sockets = [socket_path_in(str(folder), device_uuid(i)) for i in range(self.tp)]
            where = ["--devices", ",".join(str(i) for i in range(self.tp))]
        self.server = subprocess.Popen([sys.executable, "-m", "gms", "serve", "--backend", "cuda", *where,
                                        "--log-level", "warning"], stdout=self.server_log,
                                       stderr=subprocess.STDOUT, env={**os.environ, **self.env})
        self._wait_server()
        self.reference: list[int] | None = None

    # -- setup ------------------------------------------------------------------------

    def _model(self) -> str:
        folder = Path(self.args.model)
        if not (folder / "config.json").exists():
            log(f"making the model in {folder} (bench/vllm_model.py --shape {self.args.shape})")
            out = subprocess.run([sys.executable, str(ROOT / "bench" / "vllm_model.py"), str(folder), "--shape",
                                  self.args.shape], capture_output=True, text=True, check=True)
            made = json.loads(out.stdout.strip().splitlines()[-1])
            log(f"model: {made}")
        config = json.loads((folder / "config.json").read_text())
        files = sorted(folder.glob("*.safetensors"))
        self.results["model"] = {
            "folder": str(folder), "architecture": config["architectures"][0], "dtype": config.get("torch_dtype"),
            "layers": config["num_hidden_layers"], "hidden": config["hidden_size"], "vocab": config["vocab_size"],
            "checkpoint_bytes": sum(f.stat().st_size for f in files)}
        self.checkpoint = files
        return str(folder)

    def _wait_server(self) -> None:
        for socket in self.sockets:
            wait_served(socket, self.server, str(self.work / "gms-server.log"))

    def _gms_extra(self, extra: dict | None = None) -> dict:
        """The loader's config: the socket where one server serves; none under
        ``--tp`` (each rank finds its GPU's server by GMS_SOCKET_DIR)."""
        return {**({"gms_socket": self.sockets[0]} if self.tp == 1 else {}), **(extra or {})}

    def used(self) -> int:
        """The GPUs' used memory (NVML), summed over the engines' GPUs."""
        return sum(self.nvml.used(i) for i in range(self.tp))

    def page_cache(self, cold: bool) -> None:
        for f in self.checkpoint:
            if cold:
                evict(str(f))
            else:
                warm(str(f))

    def wait_memory_back(self, used: int, timeout: float = 60) -> None:
        """Until the GPU's used memory is back to ``used`` (+256 MiB): a dead engine's
        memory returns when the driver has torn its process down."""
        deadline = time.monotonic() + timeout
        while self.used() > used + (256 << 20) and time.monotonic() < deadline:
            time.sleep(0.1)

    # -- engines ------------------------------------------------------------------------

    def start(self, name: str, *, load_format: str = "gms", extra: dict | None = None,
              sleep_mode: bool = False) -> dict:
        """Start one engine alone on what the GPU holds now; its start, load and memory."""
        used_before = self.used()
        if load_format == "gms":
            extra = self._gms_extra(extra)
        argv = serve_argv(self.model, PORTS[name], load_format=load_format, extra=extra, kv_bytes=self.kv_bytes,
                          gpu_utilization=self.args.gpu_utilization, max_model_len=self.args.max_model_len,
                          sleep_mode=sleep_mode, eager=self.args.eager, tp=self.tp)
        engine = Engine(argv, {**serve_env(self.cache), **self.env}, self.work / f"{name}.log", PORTS[name])
        self.engines[name] = engine
        log(f"{name}: starting ({load_format})")
        start_s = engine.wait_ready(self.args.ready_timeout)
        first = engine.complete(PROMPT, TOKENS)
        used_after = self.used()
        out = {"load_format": load_format, "start_to_ready_s": start_s,
               "start_to_first_completion_s": time.time() - engine.started_at,
               "gpu_memory_added_bytes": used_after - used_before, "completion_s": first["seconds"],
               **engine.load_line()}
        if self.reference is None:
            self.reference = first["token_ids"]
        out["output_equals_baseline"] = first["token_ids"] == self.reference
        log(f"{name}: ready in {start_s:.1f} s, load {out.get('vllm_load_s')} s, "
            f"+{out['gpu_memory_added_bytes'] / GiB:.2f} GiB, output {'=' if out['output_equals_baseline'] else '!='}")
        return out

    def stop(self, name: str) -> None:
        engine = self.engines.pop(name, None)
        if engine is not None:
            engine.stop()
            self._save_tail(name, engine)

    def _save_tail(self, name: str, engine: Engine) -> None:
        with open(self.work / "engines-tail.log", "a") as f:
            f.write(f"===== {name}: {' '.join(engine.argv)}\n{engine.tail(200)}\n")

    def sleep_wake(self, name: str) -> dict:
        """Each answer after a wake is compared with the engine's first answer
        (``self.reference``, which every engine matched at its start): sleep drops
        vLLM's prefix cache, so the answer after a wake is computed as the first one
        was.  An answer while awake, served from the prefix cache, can differ on
        these random weights (near-tie logits, another kernel path), on vLLM's own
        sleep mode as on gms: ``repeat_equals_first`` records it."""
        engine = self.engines[name]
        repeat = engine.complete(PROMPT, TOKENS)["token_ids"]
        runs = []
        for _ in range(self.args.repeats):
            used_awake = self.used()
            sleep_s = engine.sleep()
            asleep = engine.is_sleeping()
            used_asleep = self.used()
            wake_s = engine.wake()
            used_woken = self.used()
            after = engine.complete(PROMPT, TOKENS)
            runs.append({"sleep_s": sleep_s, "wake_s": wake_s, "is_sleeping": asleep,
                         "released_bytes": used_awake - used_asleep, "back_bytes": used_woken - used_asleep,
                         "first_completion_after_wake_s": after["seconds"],
                         "output_equal": after["token_ids"] == self.reference})
        out = {"runs": runs, "output_equal_all": all(r["output_equal"] and r["is_sleeping"] for r in runs),
               "repeat_equals_first": repeat == self.reference}
        for key in ("sleep_s", "wake_s", "released_bytes", "first_completion_after_wake_s"):
            out[key] = statistics.median(r[key] for r in runs)
        log(f"{name}: sleep {out['sleep_s'] * 1e3:.0f} ms, wake {out['wake_s'] * 1e3:.0f} ms, "
            f"released {out['released_bytes'] / GiB:.2f} GiB, output equal: {out['output_equal_all']}")
        return out

    # -- parts ---------------------------------------------------------------------------

    def share_and_sleep(self, parts: set[str]) -> None:
        self.page_cache(self.args.cold)
        idle = self.used()
        base = self.start("baseline", load_format="safetensors", sleep_mode="sleep" in parts)
        self.results["baseline"] = base
        if "sleep" in parts:
            self.results.setdefault("sleep", {})["baseline"] = self.sleep_wake("baseline")
        self.stop("baseline")
        self.wait_memory_back(idle)
        if self.args.cold:
            self.page_cache(True)
        self.results["A"] = self.start("A")
        if "share" in parts:
            self.results["B"] = self.start("B", extra={"gms_read_only": True})
        if "sleep" in parts:
            for name in ("B", "A"):
                if name in self.engines:
                    self.results.setdefault("sleep", {})[name] = self.sleep_wake(name)
        for name in ("B", "A"):
            self.stop(name)
        self.results["gms_layouts_after"] = self._layouts()

    def _layouts(self) -> list[dict]:
        from gms import get_runtime_state

        return [{"name": r.name, "state": r.state, "bytes": r.bytes, "allocations": r.allocation_count,
                 "readers": r.readers, "gpu": i} for i, socket in enumerate(self.sockets)
                for r in get_runtime_state(socket).layouts]

    def failover(self) -> None:
        if "baseline" not in self.results and not self.args.no_baseline:
            self.page_cache(False)
            idle = self.used()
            self.results["baseline"] = self.start("baseline", load_format="safetensors")
            self.stop("baseline")
            self.wait_memory_back(idle)
        commands = {}
        for name in ("A", "B"):
            port = PORTS[f"failover-{name}"]
            commands[name] = (port, serve_argv(self.model, port, extra=self._gms_extra(),
                                               kv_bytes=self.kv_bytes, gpu_utilization=self.args.gpu_utilization,
                                               max_model_len=self.args.max_model_len, eager=self.args.eager,
                                               tp=self.tp))
        coordinator = Coordinator(self.work / "failover", self.sockets, commands,
                                  {**serve_env(self.cache, endpoint_plugin=True), **self.env}, engine="vllm",
                                  interval=self.args.interval, failures=self.args.failures,
                                  canary_timeout=self.args.canary_timeout)
        runs = []
        try:
            self.results["failover_bring_up_s"] = coordinator.wait_ready()
            log(f"failover: both sets ready in {self.results['failover_bring_up_s']:.1f} s")
            if self.args.saturate_s:
                self.results["saturated"] = coordinator.saturate(self.args.saturate_s, busy_cpus=self.args.busy_cpus)
                log(f"saturated for {self.args.saturate_s:.0f} s: {self.results['saturated']}")
            for n in range(self.args.repeats):
                fault = self.args.fault[n % len(self.args.fault)]
                rank = self.tp - 1 if fault.endswith("-rank") else None
                runs.append(coordinator.fail_over(rank=rank, hang=fault.startswith("hang")))
                log(f"failover {n}: signal -> first token {runs[-1]['signal_to_first_token_s']:.3f} s")
        finally:
            coordinator.close(self.work / "engines-tail.log")
        self.results["failover"] = coordinator.results(runs)

    def close(self) -> None:
        for name in list(self.engines):
            self.stop(name)
        self.server.terminate()
        try:
            self.server.wait(60)
        except subprocess.TimeoutExpired:
            self.server.kill()
        self.server_log.close()


def ratios(r: dict) -> list[tuple]:
    """(what, gms, baseline, gms / baseline) rows from the results."""
    rows = []
    base = r.get("baseline", {})
    for name in ("A", "B"):
        e = r.get(name)
        if not e or not base:
            continue
        for key, what in (("vllm_load_s", "weight load, s (vLLM's line)"), ("start_to_ready_s", "start to ready, s"),
                          ("gpu_memory_added_bytes", "GPU memory added, GiB")):
            g, b = e.get(key), base.get(key)
            if g is None or not b:
                continue
            scale = GiB if key.endswith("bytes") else 1
            rows.append((f"{name}: {what}", f"{g / scale:.3f}", f"{b / scale:.3f}", f"{g / b:.3f}"))
    sleep = r.get("sleep", {})
    for name in ("A", "B"):
        if name in sleep and "baseline" in sleep:
            for key in ("sleep_s", "wake_s"):
                g, b = sleep[name][key], sleep["baseline"][key]
                rows.append((f"{name}: {key[:-2]}, s", f"{g:.3f}", f"{b:.3f}", f"{g / b:.3f}"))
    f = r.get("failover")
    if f and f["signal_to_first_token_s"] and base.get("start_to_first_completion_s"):
        g, b = f["signal_to_first_token_s"]["median"], base["start_to_first_completion_s"]
        rows.append(("SIGKILL -> shadow's first token, s (baseline: fresh start)", f"{g:.3f}", f"{b:.3f}",
                     f"{g / b:.4f}"))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="share,sleep,failover")
    add_out(p)
    p.add_argument("--model", default="/var/tmp/gms-vllm-model", help="made there unless it holds a model")
    p.add_argument("--shape", default="llama-2b")
    p.add_argument("--kv-gib", type=float, default=4.0, help="KV cache per engine (--kv-cache-memory-bytes)")
    p.add_argument("--gpu-utilization", type=float, default=0.25, help="vLLM's start gate only (the KV is fixed)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3, help="sleep/wake cycles per engine, failovers")
    p.add_argument("--cold", action="store_true", help="drop the checkpoint from the page cache before loads")
    p.add_argument("--eager", action="store_true", help="--enforce-eager (no torch.compile, no CUDA graphs)")
    p.add_argument("--interval", type=float, default=0.1, help="coordinator: seconds between probes")
    p.add_argument("--failures", type=int, default=2)
    p.add_argument("--canary-timeout", type=float, default=5.0)
    p.add_argument("--ready-timeout", type=float, default=900)
    p.add_argument("--work-root", default=None, help="where the run's folder goes (default: the temp dir)")
    p.add_argument("--cache-root", default="/var/tmp/gms-vllm-cache", help="VLLM_CACHE_ROOT (compile cache)")
    p.add_argument("--keep", action="store_true", help="keep the run's folder")
    p.add_argument("--tp", type=int, default=1, help="--tensor-parallel-size: GPUs 0..N-1, a gms server each")
    p.add_argument("--fault", default="kill", type=lambda v: v.split(","),
                   help="failover: SIGKILL the serving engine's launcher (kill) or its last rank (kill-rank), or "
                        "SIGSTOP its engine core (hang) or its last rank (hang-rank); a comma list takes turns")
    p.add_argument("--saturate-s", type=float, default=0.0,
                   help="failover: first keep the primary's batch full this long; no failover may come of it")
    p.add_argument("--no-baseline", action="store_true", help="failover alone: no fresh vLLM to compare with")
    p.add_argument("--busy-cpus", type=int, default=0,
                   help="--saturate-s: this many processes spin on the host meanwhile (a loaded host)")
    args = p.parse_args()
    faults = {"kill", "kill-rank", "hang", "hang-rank"}
    if not set(args.fault) <= faults:
        p.error(f"--fault: one or more of {sorted(faults)}, not {','.join(args.fault)}")
    if any(f.endswith("-rank") for f in args.fault) and args.tp < 2:
        p.error("--fault ...-rank needs --tp 2 or more")
    parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    if not parts <= {"share", "sleep", "failover"}:
        p.error(f"unknown parts: {sorted(parts - {'share', 'sleep', 'failover'})}")
    bench = Bench(args)
    log(f"{bench.results['gpu']}, {bench.results['versions']}, work {bench.work}")
    try:
        if parts & {"share", "sleep"}:
            bench.share_and_sleep(parts)
        if "failover" in parts:
            bench.failover()
    finally:
        bench.close()
        out = out_dir(args.out)
        if (bench.work / "engines-tail.log").exists():
            shutil.copy(bench.work / "engines-tail.log", out / "vllm_engines.log")
        bench.results["parts"] = sorted(parts)
        model = re.search(r"\b([A-Z]\d{2,4})\b", bench.results["gpu"]["name"])  # "NVIDIA H100 80GB HBM3"
        gpu_tag = model.group(1).lower() if model else "gpu"
        tp_tag = f"tp{bench.tp}_" if bench.tp > 1 else ""
        name = f"vllm_{gpu_tag}_{tp_tag}{'-'.join(p for p in ('share', 'sleep', 'failover') if p in parts)}"
        write_results(args.out, name, bench.results)
        if not args.keep:
            shutil.rmtree(bench.work, ignore_errors=True)
    print_table(f"vLLM on gms vs vLLM alone ({bench.results['gpu']['name']}; ratio = gms / baseline)",
                ratios(bench.results), ("figure", "gms", "baseline", "ratio"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
