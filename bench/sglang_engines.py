"""Launch SGLang engines for the benchmark and the GPU tests (docs/sglang.md).

``python -m sglang.launch_server`` as a user types it, plus the settings the
GPU host needs: its wheel set leaves out FlashAttention-3's 1.1 GB kernel
library and FlashInfer's JIT (``scripts/gpu-sglang-wheels.txt``), so the
attention backend is Triton and sampling is PyTorch's.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

import httpx
from vllm_engines import GMS_LINE, Engine

SERVE = [sys.executable, "-m", "sglang.launch_server"]
LOAD_LINE = re.compile(r"Load weight end\. elapsed=(?P<sglang_load_s>[\d.]+) s.*?mem usage=(?P<sglang_load_gb>[\d.]+) GB")


def serve_argv(model: str, port: int, *, load_format: str = "gms", extra: dict | None = None,
               memory_saver: bool = True, max_total_tokens: int = 8192, mem_fraction: float = 0.3,
               graph_max_bs: int = 4) -> list[str]:
    argv = [*SERVE, "--model-path", model, "--port", str(port), "--host", "127.0.0.1",
            "--load-format", load_format, "--max-total-tokens", str(max_total_tokens),
            "--mem-fraction-static", str(mem_fraction), "--cuda-graph-max-bs-decode", str(graph_max_bs),
            "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
            "--log-level", "info",
            # SGLang's prefill graphs (its "breakable" backend) refuse its memory saver:
            # decode graphs only, for SGLang alone and on gms alike.
            "--disable-prefill-cuda-graph"]
    if memory_saver:
        argv += ["--enable-memory-saver"]
    if extra:
        argv += ["--model-loader-extra-config", json.dumps(extra)]
    return argv


def serve_env(*, graphs_in_saver: bool = True) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "SGLANG_DISABLE_REQUEST_LOGGING": "1"}
    if graphs_in_saver:
        env["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] = "1"  # SGLang's switch: graphs' memory under the saver too
    return env


def generate(url: str, prompt, max_tokens: int = 32, timeout: float = 120, client: httpx.Client | None = None) -> dict:
    """Greedy, ``ignore_eos``, through SGLang's native ``/generate``."""
    started = time.perf_counter()
    r = (client or httpx).post(f"{url}/generate", timeout=timeout, json={
        "input_ids": list(prompt),
        "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}})
    r.raise_for_status()
    body = r.json()
    return {"token_ids": body.get("output_ids"), "text": body.get("text"), "seconds": time.perf_counter() - started}


class SGLangEngine(Engine):
    """One ``sglang.launch_server`` (and its scheduler) in a process group of its own."""

    LOAD_LINES = (LOAD_LINE, GMS_LINE)
    # SGLang answers /v1/models before its own warm-up request has run; until that
    # request ends its status is "Starting" (its /health and /gms/health say 503) and a
    # release would hold the warm-up at the pause gate.  It logs this line when it is Up.
    READY_LINE = "The server is fired up and ready to roll!"

    def ready(self) -> bool:
        return self.READY_LINE in self.log() and super().ready()

    def complete(self, prompt, max_tokens: int = 32, timeout: float = 120) -> dict:
        return generate(self.url, prompt, max_tokens, timeout)

    def release(self, tags: list[str] | None = None) -> float:
        return self.post("/release_memory_occupation", body={"tags": tags} if tags else {})

    def resume(self, tags: list[str] | None = None) -> float:
        return self.post("/resume_memory_occupation", body={"tags": tags} if tags else {})

    def gms_health(self) -> tuple[int, dict]:
        r = httpx.get(f"{self.url}/gms/health", timeout=10)
        return r.status_code, r.json()
