"""SGLang on gms against SGLang alone, on one GPU, in one run (docs/sglang.md).

    python bench/sglang_gms.py [--shape tiny|llama-2b] [--out docs/results/sglang_h100.json]

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

Every output is compared with the reference; the JSON records each.  Timed
as a user sees them: an HTTP call from its send to its answer.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import Server, gpu, log, print_table, versions, write_json
from failover import Nvml
from sglang_engines import SGLangEngine, serve_argv, serve_env

ROOT = Path(__file__).resolve().parent.parent
PORTS = {"alone": 18300, "A": 18301, "B": 18302}
PROMPT = [5, 17, 99, 3, 250, 41, 7, 600, 12, 88, 301, 9]  # token ids every made-here vocabulary has
TOKENS = 24


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
                 "bytes": lay.bytes, "gpu_bytes": lay.gpu_bytes} for lay in state.layouts]

    def used(self) -> int:
        return self.nvml.used(0)

    def run(self) -> dict:
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
        return r

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="tiny", choices=("tiny", "llama-2b"))
    p.add_argument("--out", default="docs/results/sglang_gms.json")
    p.add_argument("--work-root", default=os.environ.get("TMPDIR", "/tmp"))
    args = p.parse_args()
    run = Run(args)
    try:
        results = run.run()
    finally:
        run.close()
        write_json(args.out, run.results)
    r = results
    MiB = 1 << 20
    print_table("SGLang on gms (" + r["gpu"]["name"] + ")", [
        ("SGLang alone: weight load s", r["engines"]["alone"].get("sglang_load_s")),
        ("A (gms, publishes): weight load s", r["engines"]["A"].get("sglang_load_s")),
        ("B (gms, imports): weight load s", r["engines"]["B"].get("sglang_load_s")),
        ("GPU memory added, SGLang alone MiB", r["alone_added_bytes"] // MiB),
        ("GPU memory added, B MiB", r["B_added_bytes"] // MiB),
        ("release s / freed MiB, SGLang alone", f"{r['alone_release']['release_s']:.3f} / "
         f"{r['alone_release']['freed_bytes'] // MiB}"),
        ("release s / freed MiB, B", f"{r['B_release']['release_s']:.3f} / {r['B_release']['freed_bytes'] // MiB}"),
        ("resume s, SGLang alone / B", f"{r['alone_release']['resume_s']:.3f} / {r['B_release']['resume_s']:.3f}"),
        ("outputs equal (A, B, B after resume, alone after resume)",
         (r["A_equal"], r["B_equal"], r["B_after_resume_equal"], r["alone_after_resume_equal"])),
    ])


if __name__ == "__main__":
    main()
