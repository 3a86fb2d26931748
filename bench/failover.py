"""Shadow-engine failover, end to end: from the primary's death to the shadow's first token.

A real gms server per rank, two engine sets (examples/engine, a
Qwen3-0.6B-shaped model with random weights, bf16) and the coordinator
(``gms failover``).  A client polls ``POST /v1/completions`` (one token) on
the shadow set's rank 0, as a router that follows the serving lock would,
and the clock runs from the signal to the first completed token.

Cases:

The signal goes to rank 0 of the serving set (``--kill all``: every rank);
the coordinator takes the set's other ranks down itself.

* ``a``  SIGKILL the primary; the KV cache fits beside the primary's
  (``--kv-small``, default 2 GiB per engine).
* ``b``  SIGKILL the primary; the KV cache is so large (``--kv-large-fraction``
  of the GPU, default 0.8) that the shadow's can only be made from the dead
  primary's memory.  Also measured in the same run: the dead process's own
  teardown, from SIGKILL until the GPU's used memory (NVML) drops by half the
  KV size.  Run once per ``--retry-intervals`` value (the server's
  ``--alloc-retry-interval``): if the wake waits on the retry interval rather
  than on the teardown, the two runs differ by about the interval.
* ``c``  SIGSTOP the primary (hung: alive, holding its KV lock, answering
  nothing); small KV.  Reported: from the coordinator's decision to the first
  token (through revoke, or, on a core without revoke, the kill), and the
  detection time (interval x failures + canary timeout).

Each case alternates the roles ``--repeats`` times (the failed set comes back
as the shadow before the next kill).  GPU by default; ``--backend host``
runs the same on CPU with the tiny model as a smoke test (case b against a
256 MiB host capacity, without the teardown measurement).

    python bench/failover.py [--cases a,b,c] [--ranks 1|2] [--repeats 3]
    GMS_BENCH_OUT=/tmp/out python bench/failover.py --ranks 2     # 2 GPUs: one engine per GPU per set

Writes failover_<backend>_<ranks>r.json under ``--out``.
Ranks are independent replicas (no tensor parallelism): the coordinator
wakes and restarts them in lockstep.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from _common import add_out, cpu_name, gpu_line, print_table, write_results
from coordinated import FirstToken, read_events, wait_event

ROOT = Path(__file__).resolve().parent.parent
ENGINE = str(ROOT / "examples" / "engine")
GiB = 1 << 30
HOST_CAPACITY = 256 << 20  # host backend: bytes per server, so that case b's two KV caches cannot both fit

SHAPES = {
    # Qwen3-0.6B's architecture (no download: random weights).
    "qwen3-0.6b": ("qwen3", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True, bos_token_id=151643,
        eos_token_id=151645)),
    # The CI tests' tiny Llama: the CPU smoke run.
    "tiny": ("llama", dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)),
}


# -- the checkpoint -------------------------------------------------------------


def write_checkpoint(folder: Path, shape: str, dtype: str) -> int:
    """config.json + model.safetensors with random weights; returns the weight bytes.

    Names and shapes come from the transformers model itself, built on the
    meta device (no memory, no init); tensors are filled one at a time.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, fields = SHAPES[shape]
    config = AutoConfig.for_model(model_type, **fields)
    config.dtype = dtype
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    names = {n: t for n, t in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        names.pop("lm_head.weight", None)  # as save_pretrained does: the tie is restored on load
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for name, meta in names.items():
        if meta.dim() == 1:
            tensors[name] = torch.ones(meta.shape, dtype=meta.dtype)
        else:
            tensors[name] = (torch.randn(meta.shape, generator=generator) * 0.02).to(meta.dtype)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(folder)
    return sum(t.numel() * t.element_size() for t in tensors.values())


# -- GPU memory, from NVML (the driver's library; no Python package needed) ------------


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class Nvml:
    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        if self.lib.nvmlInit_v2() != 0:
            raise RuntimeError("nvmlInit failed")

    def memory(self, index: int) -> _NvmlMemory:
        handle = ctypes.c_void_p()
        if self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
            raise RuntimeError(f"no NVML device {index}")
        info = _NvmlMemory()
        if self.lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(info)) != 0:
            raise RuntimeError("nvmlDeviceGetMemoryInfo failed")
        return info

    def used(self, index: int) -> int:
        return self.memory(index).used


class MemoryDrop(threading.Thread):
    """Samples a GPU's used memory every millisecond until stopped; ``at`` is when
    it first fell below ``below`` (None if it never did: e.g. the shadow's KV
    took the memory as fast as it came back)."""

    def __init__(self, nvml: Nvml, index: int, below: int) -> None:
        super().__init__(daemon=True)
        self.nvml, self.index, self.below = nvml, index, below
        self.samples: list[tuple[float, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.samples.append((time.time(), self.nvml.used(self.index)))
            time.sleep(0.001)

    @property
    def at(self) -> float | None:
        return next((t for t, used in self.samples if used <= self.below), None)

    @property
    def lowest(self) -> tuple[float, int] | None:
        return min(self.samples, key=lambda s: s[1]) if self.samples else None


# -- the client --------------------------------------------------------------------


# -- one deployment --------------------------------------------------------------


class Deployment:
    def __init__(self, work: Path, args, model: Path, kv_bytes: int, retry_interval: float, tag: str) -> None:
        self.work = work / tag
        self.work.mkdir(parents=True)
        self.args = args
        self.servers: list[subprocess.Popen] = []
        self.sockets = [str(self.work / f"gms{r}.sock") for r in range(args.ranks)]
        for rank, socket in enumerate(self.sockets):
            extra = ("--alloc-retry-interval", str(retry_interval), "--log-level", "warning")
            if args.backend == "host":
                extra += ("--host-capacity", str(HOST_CAPACITY))
            argv = [sys.executable, "-m", "gms", "serve", "--backend", args.backend, "--device", str(rank),
                    "--socket", socket, *extra]
            log = open(self.work / f"server{rank}.log", "wb")
            self.servers.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
        self._wait_servers()
        self.ports = {"A": [args.port_base + r for r in range(args.ranks)],
                      "B": [args.port_base + 100 + r for r in range(args.ranks)]}
        command = [sys.executable, ENGINE, "--model", str(model), "--gms-socket", "{socket}", "--port", "{port}",
                   "--rank", "{rank}", "--world-size", "{world_size}", "--device", "{rank}",
                   "--max-seq-len", str(args.max_seq_len), "--kv-bytes", str(kv_bytes)]
        self.events = self.work / "events.jsonl"
        config = {
            "lock": f"file:{self.work / 'serving.lock'}", "initial": "A", "ranks": self.sockets,
            "interval_s": args.interval, "failures": args.failures, "canary_timeout_s": args.canary_timeout,
            "wake_timeout_s": 600.0, "ready_timeout_s": 900.0, "events": str(self.events),
        }
        lines = [f"{k} = {json.dumps(v)}" for k, v in config.items()]
        for name, ports in self.ports.items():
            lines += [f"\n[sets.{name}]", 'kind = "local"', f"ports = {json.dumps(ports)}",
                      f"command = {json.dumps(command)}", f'log_dir = "{self.work / "logs"}"',
                      'env = { ENGINE_LOG_LEVEL = "WARNING" }']
        (self.work / "failover.toml").write_text("\n".join(lines) + "\n")
        self.log = open(self.work / "coordinator.log", "wb")
        self.coordinator = subprocess.Popen(
            [sys.executable, "-m", "gms", "failover", "--config", str(self.work / "failover.toml")],
            stdout=subprocess.DEVNULL, stderr=self.log)
        for name in ("A", "B"):
            self.wait_event(lambda e, n=name: e["event"] == "ready" and e["set"] == n, 900)

    def _wait_servers(self) -> None:
        from gms import get_runtime_state
        from gms.errors import GMSError

        deadline = time.monotonic() + 120
        for socket in self.sockets:
            while True:
                try:
                    get_runtime_state(socket, timeout=1)
                    break
                except GMSError:
                    if time.monotonic() > deadline or any(p.poll() is not None for p in self.servers):
                        raise RuntimeError(f"gms server did not start (logs in {self.work})") from None
                    time.sleep(0.05)

    def read_events(self) -> list[dict]:
        return read_events(self.events)

    def wait_event(self, match, timeout: float, after: int = 0) -> dict:
        return wait_event(self.events, self.coordinator, match, timeout, after)

    def serving(self) -> tuple[str, str]:
        serving = "A"
        for e in self.read_events():
            if e["event"] == "failover":
                serving = e["serving"]
        return serving, "B" if serving == "A" else "A"

    def url(self, name: str, rank: int = 0) -> str:
        return f"http://127.0.0.1:{self.ports[name][rank]}"

    def pid(self, name: str, rank: int = 0) -> int:
        return httpx.get(f"{self.url(name, rank)}/state", timeout=10).json()["pid"]

    def close(self) -> None:
        if self.coordinator.poll() is None:
            self.coordinator.send_signal(signal.SIGTERM)
            try:
                self.coordinator.wait(60)
            except subprocess.TimeoutExpired:
                self.coordinator.kill()
        for server in self.servers:
            server.terminate()
        for server in self.servers:
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
        self.log.close()


def one_failover(dep: Deployment, sig: int, kv_bytes: int, nvml: Nvml | None) -> dict:
    serving, standby = dep.serving()
    # the set that failed last time must be back as the shadow first
    dep.wait_event(lambda e: e["event"] == "ready" or (e["event"] == "restarted" and e["set"] == standby), 900,
                   after=_last_failover_index(dep))
    before = len(dep.read_events())
    # Rank 0 alone by default: a failure of any one rank fails the set, and the
    # coordinator must take the other ranks down itself (their memory too).
    ranks = range(dep.args.ranks) if dep.args.kill == "all" else [0]
    pids = [dep.pid(serving, r) for r in ranks]
    drop = None
    if nvml is not None and sig == signal.SIGKILL:
        drop = MemoryDrop(nvml, 0, nvml.used(0) - kv_bytes // 2)
        drop.start()
    poller = FirstToken(dep.url(standby), timeout=120, request_timeout=2.0)
    poller.start()
    killed_at = time.time()
    for pid in pids:
        os.kill(pid, sig)
    poller.join()
    event = dep.wait_event(lambda e: e["event"] == "failover", 600, before)
    restarted = dep.wait_event(lambda e: e["event"] == "restarted" and e["set"] == serving, 900, before)
    if drop is not None:
        drop.stop.set()
        drop.join(5)
    if poller.at is None:
        raise RuntimeError("no token from the shadow")
    out = {
        "failed": serving, "serving": standby, "ok": event["ok"],
        "signal_to_first_token_s": poller.at - killed_at,
        "decision_to_first_token_s": poller.at - event["decided_at"],
        "signal_to_decision_s": event["decided_at"] - killed_at,
        "coordinator": {k: event[k] for k in ("detect_s", "revoke_s", "lock_s", "wake_s", "first_token_s", "total_s")},
        "engine_wake": [w.get("engine", {}) for w in event["wake"]],
        "revoked": list(event["revoked"].values()),
        "restart_s": restarted["seconds"],
        "client_attempts": poller.attempts,
    }
    if drop is not None:
        out["teardown_s"] = (drop.at - killed_at) if drop.at else None
        lowest = drop.lowest
        if lowest is not None:  # where the used memory bottomed out, and when
            out["lowest_used_bytes"], out["lowest_used_at_s"] = lowest[1], lowest[0] - killed_at
    return out


def _last_failover_index(dep: Deployment) -> int:
    events = dep.read_events()
    idx = [i for i, e in enumerate(events) if e["event"] == "failover"]
    return idx[-1] if idx else 0


def summarize(runs: list[dict], key: str) -> dict:
    values = [r[key] for r in runs if r.get(key) is not None]
    if not values:
        return {}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cuda", choices=("cuda", "host"))
    add_out(parser)
    parser.add_argument("--shape", default=None, choices=sorted(SHAPES), help="default: qwen3-0.6b (cuda), tiny (host)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 (cuda), float32 (host)")
    parser.add_argument("--cases", default="a,b,c")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-small", type=float, default=2.0, help="GiB per engine, cases a and c")
    parser.add_argument("--kv-large-fraction", type=float, default=0.8, help="of the GPU's memory, case b")
    parser.add_argument("--retry-intervals", default="0.5,0.05", help="the server's --alloc-retry-interval, case b")
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--interval", type=float, default=0.1, help="coordinator: seconds between probes")
    parser.add_argument("--failures", type=int, default=2)
    parser.add_argument("--canary-timeout", type=float, default=1.0)
    parser.add_argument("--kill", default="rank0", choices=("rank0", "all"),
                        help="signal rank 0 of the serving set (default) or every rank")
    parser.add_argument("--port-base", type=int, default=18100)
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs)")
    args = parser.parse_args()
    shape = args.shape or ("qwen3-0.6b" if args.backend == "cuda" else "tiny")
    dtype = args.dtype or ("bfloat16" if args.backend == "cuda" else "float32")
    if args.backend == "host":
        args.max_seq_len = min(args.max_seq_len, 128)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    nvml = Nvml() if args.backend == "cuda" else None

    work = Path(tempfile.mkdtemp(prefix="gms-failover-bench-"))
    results: dict = {"backend": args.backend, "shape": shape, "dtype": dtype, "ranks": args.ranks, "kill": args.kill,
                     "cpu": cpu_name(), "coordinator": {"interval_s": args.interval, "failures": args.failures,
                                                        "canary_timeout_s": args.canary_timeout}, "cases": {}}
    if nvml is not None:
        total = nvml.memory(0).total
        results["gpu_total_bytes"] = total
        results["gpu"] = gpu_line()
    try:
        started = time.perf_counter()
        weight_bytes = write_checkpoint(work / "model", shape, dtype)
        print(f"checkpoint: {weight_bytes / GiB:.2f} GiB of {dtype} weights in {time.perf_counter() - started:.1f} s")
        results["weight_bytes"] = weight_bytes
        plan = []
        small = int(args.kv_small * GiB) if args.backend == "cuda" else 16 << 20
        if "a" in cases:
            plan.append(("a", signal.SIGKILL, small, 0.5))
        if "b" in cases:
            if nvml is not None:
                large = int(args.kv_large_fraction * results["gpu_total_bytes"]) - weight_bytes
            else:  # the host backend's capacity stands for the GPU's (no teardown to measure there)
                large = int(args.kv_large_fraction * HOST_CAPACITY)
            for interval in (float(x) for x in args.retry_intervals.split(",")):
                plan.append((f"b_retry{interval:g}", signal.SIGKILL, large, interval))
        if "c" in cases:
            plan.append(("c", signal.SIGSTOP, small, 0.5))
        for case, sig, kv_bytes, retry in plan:
            print(f"\n=== case {case}: {signal.Signals(sig).name}, KV {kv_bytes / GiB:.2f} GiB per engine, "
                  f"alloc retry {retry} s, {args.ranks} rank(s) ===", flush=True)
            dep = Deployment(work, args, work / "model", kv_bytes, retry, case)
            try:
                runs = []
                for n in range(args.repeats):
                    run = one_failover(dep, sig, kv_bytes, nvml if case.startswith("b") else None)
                    runs.append(run)
                    print(json.dumps({"case": case, "run": n, **run}), flush=True)
            finally:
                dep.close()
            results["cases"][case] = {
                "signal": signal.Signals(sig).name, "kv_bytes": kv_bytes, "alloc_retry_interval_s": retry,
                "runs": runs,
                "signal_to_first_token_s": summarize(runs, "signal_to_first_token_s"),
                "decision_to_first_token_s": summarize(runs, "decision_to_first_token_s"),
                "teardown_s": summarize(runs, "teardown_s"),
            }
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"work folder kept: {work}")

    rows = []
    for case, r in results["cases"].items():
        rows.append((case, r["signal"], f"{r['kv_bytes'] / GiB:.1f}",
                     _fmt(r["signal_to_first_token_s"]), _fmt(r["decision_to_first_token_s"]),
                     _fmt(r["teardown_s"])))
    print_table(f"failover ({args.backend}, {shape}, {args.ranks} rank(s)), median s [min-max]", rows,
                ("case", "signal", "KV GiB", "signal->token", "decision->token", "teardown"))
    write_results(args.out, f"failover_{args.backend}_{args.ranks}r", results)


def _fmt(s: dict) -> str:
    if not s:
        return "-"
    return f"{s['median']:.3f} [{s['min']:.3f}-{s['max']:.3f}]"


if __name__ == "__main__":
    sys.exit(main())
