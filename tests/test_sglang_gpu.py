"""SGLang on gms with a real engine (GPU and SGLang needed; docs/sglang.md).

Runs ``bench/sglang_gms.py`` (tiny model) once and checks what it found:
SGLang alone gives the reference greedy output; engine A
(``--load-format gms --enable-memory-saver``) loads from disk and publishes,
engine B (``gms_read_only``) imports, both give the reference; B's release
of every tag drops its KV and graph layouts and its read lock, and
``/gms/health`` says so; after the resume B's CUDA graphs replay over the
same addresses and give the reference again.  (SGLang alone's output after
its own release and resume is recorded, not asserted: its memory saver
discards the weights unless ``--enable-weights-cpu-backup``.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed"),
]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    keep = os.environ.get("GMS_TEST_KEEP")  # a folder to keep the JSON and the engines' logs in
    out = Path(keep) if keep else tmp_path_factory.mktemp("sglang")
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "GMS_BENCH_OUT": str(out)}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "sglang_gms.py"), "--shape", "tiny",
                           "--out", "sglang_gms.json", "--work-root", str(out)],
                          env=env, capture_output=True, text=True, timeout=1500)
    path = out / "sglang_gms.json"
    assert path.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads(path.read_text())
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:] + json.dumps(
        {k: v.get("log_tail") for k, v in results["engines"].items()})[-6000:]
    return results


def test_the_second_engine_imports_and_both_give_sglang_s_own_output(run):
    assert run["engines"]["A"]["gms_how"] == "loaded from disk and published"
    assert run["engines"]["B"]["gms_how"] == "imported"
    assert run["engines"]["A"]["gms_layout"] == run["engines"]["B"]["gms_layout"]
    assert len(run["outputs"]["alone"]) == run["completion_tokens"]
    assert run["A_equal"] and run["B_equal"]
    weights = [lay for lay in run["layouts_both_up"] if lay["name"] == run["engines"]["A"]["gms_layout"]]
    assert weights and weights[0]["readers"] == 2 and weights[0]["state"] == "RO"  # committed, two readers
    scratch = {lay["name"].split("/")[0] for lay in run["layouts_both_up"] if lay["writer"]}
    assert scratch == {"sglang-kv", "sglang-graph"}  # each engine's own KV cache and graph memory


def test_release_and_resume_keep_cuda_graphs_working(run):
    release = run["B_release"]
    code, body = release["health_released"]
    assert code == 200 and body["status"] == "asleep"
    assert release["health_resumed"][1]["status"] == "serving"
    mine = [lay for lay in release["layouts_released"] if lay["name"].startswith(("sglang-kv", "sglang-graph"))]
    assert sum(1 for lay in mine if lay["writer"]) == 2  # A's two; B's went with their locks
    weights = [lay for lay in release["layouts_released"] if lay["name"] == run["engines"]["A"]["gms_layout"]]
    assert weights[0]["readers"] == 1  # only A reads while B is released
    assert run["B_after_resume_equal"] and run["A_after_B_resume_equal"]
