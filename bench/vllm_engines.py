"""vLLM engines as processes: for bench/vllm.py and tests/test_vllm_gpu.py.

One launcher for both, so the GPU test runs exactly the command lines the
benchmark measures.  Each engine is ``python3 -m vllm.entrypoints.cli.main
serve`` (the ``vllm serve`` command) in a process group of its own, with its
output in a log file; it is ready when ``GET /v1/models`` answers.

The engines of a run share a compile cache (``VLLM_CACHE_ROOT``), so only
the first start of a model pays for ``torch.compile``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

WORKER = "gms.integrations.vllm.worker.GMSWorker"
SERVE = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]
GiB = 1 << 30


def serve_argv(model: str, port: int, *, load_format: str = "gms", extra: dict | None = None,
               kv_bytes: int = 2 * GiB, gpu_utilization: float = 0.25, max_model_len: int = 1024,
               max_num_seqs: int = 8, capture_sizes: tuple[int, ...] | None = (1, 2, 4, 8),
               sleep_mode: bool = False, eager: bool = False, name: str = "model", tp: int = 1) -> list[str]:
    """``vllm serve`` for one engine.

    ``--kv-cache-memory-bytes`` fixes the KV cache, so engines sharing a GPU
    get the same cache whatever the others hold, and vLLM's memory
    profiling does not count another engine's growth as its own; the GPU
    utilization then only gates the start (free memory must exceed it).
    ``capture_sizes``: fewer CUDA graphs than vLLM's default, to start faster.
    """
    argv = [*SERVE, model, "--port", str(port), "--host", "127.0.0.1", "--served-model-name", name,
            "--load-format", load_format, "--kv-cache-memory-bytes", str(kv_bytes),
            "--gpu-memory-utilization", str(gpu_utilization), "--max-model-len", str(max_model_len),
            "--max-num-seqs", str(max_num_seqs),
            # The GPU host's wheel set leaves FlashInfer out (scripts/gpu-vllm-wheels.txt):
            # FlashAttention, which vLLM's wheel carries, is pinned instead.
            "--attention-backend", "FLASH_ATTN"]
    if tp > 1:
        argv += ["--tensor-parallel-size", str(tp)]
    if load_format == "gms":
        argv += ["--worker-cls", WORKER]
    if extra:
        argv += ["--model-loader-extra-config", json.dumps(extra)]
    if capture_sizes and not eager:
        argv += ["--compilation-config", json.dumps({"cudagraph_capture_sizes": list(capture_sizes)})]
    if eager:
        argv += ["--enforce-eager"]
    if sleep_mode:
        argv += ["--enable-sleep-mode"]  # vLLM's own sleep (CuMem): the baseline
    return argv


def serve_env(cache_root: str, *, endpoint_plugin: bool = False) -> dict[str, str]:
    env = {**os.environ,
           "VLLM_SERVER_DEV_MODE": "1",  # vLLM serves /sleep and /wake_up only in dev mode
           "VLLM_CACHE_ROOT": cache_root, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1",
           "VLLM_USE_FLASHINFER_SAMPLER": "0"}  # no FlashInfer on the GPU host (above)
    if endpoint_plugin:
        env["VLLM_PLUGINS"] = "gms"  # endpoint plugins load only where named; keeps the general one too
    return env


# V1's model runner says "GiB memory and", V2's (vLLM 0.26's default for dense models) "GiB and".
LOAD_LINE = re.compile(r"Model loading took (?P<vllm_load_gib>[\d.]+) GiB(?: memory)? and (?P<vllm_load_s>[\d.]+) seconds")
# The gms loader's line (vLLM's and SGLang's alike).
GMS_LINE = re.compile(r"gms: weights (?P<gms_how>loaded from disk and published|imported) "
                      r"\(layout '(?P<gms_layout>[^']*)', (?P<gms_gib>[\d.]+) GiB\) in (?P<gms_load_s>[\d.]+) s")
_NUMBER = re.compile(r"[\d.]+")


class Engine:
    """One ``vllm serve`` process (and its engine core) in a process group of its own."""

    LOAD_LINES = (LOAD_LINE, GMS_LINE)  # what the engine and the gms loader log about loading the weights

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path, port: int, name: str = "model"):
        self.argv, self.port, self.name, self.log_path = argv, port, name, log_path
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log_path, "wb")
        self.started_at = time.time()
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.ready_at: float | None = None

    def ready(self) -> bool:
        """The engine takes requests: ``/v1/models`` answers."""
        try:
            return httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout: float = 900) -> float:
        """Seconds from the spawn to the moment ``ready()`` first holds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine on port {self.port} exited with {self.proc.returncode}:\n{self.tail()}")
            if self.ready():
                self.ready_at = time.time()
                return self.ready_at - self.started_at
            time.sleep(0.1)
        raise RuntimeError(f"engine on port {self.port} not ready in {timeout} s:\n{self.tail()}")

    def complete(self, prompt, max_tokens: int = 32, timeout: float = 120) -> dict:
        """Greedy, ``ignore_eos``: the token ids, the text, and the seconds it took."""
        started = time.perf_counter()
        r = httpx.post(f"{self.url}/v1/completions", timeout=timeout, json={
            "model": self.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True})
        r.raise_for_status()
        choice = r.json()["choices"][0]
        return {"token_ids": choice.get("token_ids"), "text": choice["text"],
                "seconds": time.perf_counter() - started}

    def post(self, path: str, timeout: float = 300, body: dict | None = None) -> float:
        started = time.perf_counter()
        r = httpx.post(f"{self.url}{path}", json=body, timeout=timeout)
        r.raise_for_status()
        return time.perf_counter() - started

    def sleep(self, level: int = 1) -> float:
        return self.post(f"/sleep?level={level}")

    def wake(self) -> float:
        return self.post("/wake_up")

    def is_sleeping(self) -> bool:
        return httpx.get(f"{self.url}/is_sleeping", timeout=10).json()["is_sleeping"]

    def log(self) -> str:
        if not self._log.closed:  # closed once the engine stopped
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def load_line(self) -> dict:
        """What the engine and the gms loader logged about loading the weights (``LOAD_LINES``' groups)."""
        out: dict = {}
        text = self.log()
        for line in self.LOAD_LINES:
            if m := line.search(text):
                out |= {k: float(v) if _NUMBER.fullmatch(v) else v for k, v in m.groupdict().items()}
        return out

    def stop(self, timeout: float = 60) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the engine core too, whatever is left
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()
