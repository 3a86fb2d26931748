"""gms against SGLang's own weight cache daemon, side by side: SGLang alone, the weight cache, gms.

    python3 bench/sglang_daemons.py [--model DIR] [--shape llama-2b] [--setups alone,weight_cache,gms]

SGLang 0.5.23 ships a weight cache: ``python -m sglang.srt.weight_cache.daemon``
loads a model once per GPU rank, keeps it in GPU memory and serves it to
engines started with ``--weight-cache-mode client`` over CUDA IPC (a Unix
socket per physical GPU; an engine that finds no daemon, or one whose
configuration differs, loads from disk).  The same questions as
bench/vllm_daemons.py asks vLLM (its docstring lists them), of the three ways
a user can start SGLang engines on one GPU:

* **alone**: every engine reads the checkpoint, ``--enable-memory-saver``
  (its ``/release_memory_occupation`` and ``/resume_memory_occupation``);
* **weight_cache**: the standalone daemon first (its ``.ready`` file says when
  it serves; its socket and ready file in this run's folder, through
  ``SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE`` and ``..._READY_TEMPLATE``), then
  engines with ``--weight-cache-mode client``; the memory saver is asked for,
  and what a release answers is recorded;
* **gms**: ``gms serve`` as a user starts it (keeper and spare on), then
  engines with ``--load-format gms --enable-memory-saver``.

Engines run as bench/sglang_engines.py starts them (Triton attention, PyTorch
sampling, decode CUDA graphs), each with a fixed KV pool (``--max-total-tokens``).
Writes ``sglang_daemons_<gpu>.json`` under ``--out`` and prints the table.
Written against SGLang 0.5.23's source; not yet run on a GPU (issue 62).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar

from _common import wait_for
from sglang_engines import SGLangEngine, serve_argv, serve_env
from vllm_daemons import Bench, Setup, parsed, parser

SETUPS = ("alone", "weight_cache", "gms")
DAEMON = [sys.executable, "-m", "sglang.srt.weight_cache.daemon"]
HOW = (
    (re.compile(r"\[IpcModelLoader\] Fetched \d+ tensors from daemon"), "daemon (ipc)"),
    (re.compile(r"falling back to disk load"), "disk (daemon unusable)"),
    (re.compile(r"gms: weights imported"), "gms (imported)"),
    (re.compile(r"gms: weights loaded from disk and published"), "disk (published to gms)"),
)


class Engine(SGLangEngine):
    """SGLang's release and resume, under the names the questions use."""

    def sleep(self) -> float:
        return self.release()

    def wake(self) -> float:
        return self.resume()


class SGLangSetup(Setup):
    PORTS: ClassVar[dict[str, int]] = {"alone": 18500, "weight_cache": 18520, "gms": 18540}
    HOW = HOW
    PROMPT = (5, 17, 99, 3, 250, 41, 7, 600, 12, 88, 301, 9)  # token ids every made-here vocabulary has

    def _templates(self) -> dict[str, str]:
        """The weight cache's socket and ready file, in this run's folder (the daemon's and the engines')."""
        return {"SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE": str(self.work / "wc-{device_uuid}.sock"),
                "SGLANG_WEIGHT_CACHE_READY_TEMPLATE": str(self.work / "wc-{device_uuid}.ready")}

    def start_daemon(self) -> float:
        if self.name != "weight_cache":
            return super().start_daemon()  # gms serve, or none
        started = time.perf_counter()
        with open(self.work / "daemon.log", "ab") as daemon_log:
            self.daemon = subprocess.Popen(
                [*DAEMON, "--model-path", self.bench.model, "--tp-size", "1"],
                env={**serve_env(), **self._templates()}, stdout=daemon_log, stderr=subprocess.STDOUT,
                start_new_session=True)
        wait_for(self._cache_serves, self.bench.args.ready_timeout, "the weight cache daemon's .ready file")
        return time.perf_counter() - started

    def _cache_serves(self) -> bool:
        if self.daemon.poll() is not None:
            raise RuntimeError(f"the weight cache daemon exited with {self.daemon.returncode}: "
                               f"see {self.work / 'daemon.log'}")
        return any(self.work.glob("wc-*.ready"))

    def kill_daemon(self) -> float:
        if self.name == "weight_cache":  # nothing restarts it: started again as a user would
            for ready in self.work.glob("wc-*.ready"):
                ready.unlink()  # (the next daemon finds its pid dead and would remove it too)
        return super().kill_daemon()

    def argv(self, model: str | None = None, sleep_mode: bool = False) -> list[str]:
        args, model = self.bench.args, model or self.bench.model
        options = {"port": next(self.ports), "max_total_tokens": args.max_total_tokens,
                   "mem_fraction": args.mem_fraction}
        if self.name == "alone":
            return serve_argv(model, load_format="auto", **options)
        if self.name == "weight_cache":
            return [*serve_argv(model, load_format="auto", **options), "--weight-cache-mode", "client"]
        return serve_argv(model, extra={"gms_socket": self.socket}, **options)

    def engine(self, argv: list[str], log_path: Path, port: int) -> Engine:
        env = {**serve_env(), **(self._templates() if self.name == "weight_cache" else {})}
        return Engine(argv, env, log_path, port)


class SGLangBench(Bench):
    SETUP = SGLangSetup
    PREFIX = "sglang_daemons"
    PACKAGES = ("sglang", "torch", "gms", "transformers")
    LOAD_KEY = "sglang_load_s"
    SETUPS = SETUPS
    ENGINE, VERBS = "SGLang", ("/release_memory_occupation", "/resume_memory_occupation")
    TITLE = "gms against SGLang's own weight cache"

    def __init__(self, args) -> None:
        args.kv_gib, args.eager = 0.0, False  # (the KV pool is --max-total-tokens; graphs as the GPU tests run)
        super().__init__(args)


def main() -> int:
    p = parser(__doc__, SETUPS)
    p.add_argument("--max-total-tokens", type=int, default=8192, help="each engine's KV pool, in tokens")
    p.add_argument("--mem-fraction", type=float, default=0.3, help="--mem-fraction-static (its start gate)")
    p.add_argument("--ready-timeout", type=float, default=900)
    args = parsed(p, SETUPS)
    args.cache_root = None
    SGLangBench(args).run_and_report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
