"""SGLang on gms with a real engine (GPU and SGLang needed; docs/sglang.md).

Runs ``bench/sglang_gms.py`` (tiny model) twice, ``share,restart`` and
``failover`` (each fits one call on the lent GPU), and checks what it found:
SGLang alone gives the reference greedy output; engine A
(``--load-format gms --enable-memory-saver``) loads from disk and publishes,
engine B (``gms_read_only``) imports, both give the reference; B's release
of every tag drops its KV and graph layouts and its read lock, and
``/gms/health`` says so; after the resume B's CUDA graphs replay over the
same addresses and give the reference again.  (SGLang alone's output after
its own release and resume is recorded, not asserted: its memory saver
discards the weights unless ``--enable-weights-cpu-backup``.)  Then, with
requests back to back on A and B, the daemon taken over and SIGKILLed: no
request fails, no weight is loaded again, B's release and resume finds the
server that came back.  And the coordinator over two SGLang engines: the
primary SIGKILLed twice, the shadow's first token, its output the primary's.
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


def bench(tmp_path_factory, name: str, *args: str) -> tuple[dict, subprocess.CompletedProcess]:
    keep = os.environ.get("GMS_TEST_KEEP")  # a folder to keep the JSON and the engines' logs in
    out = Path(keep) / name if keep else tmp_path_factory.mktemp(name)
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "sglang_gms.py"), "--shape", "tiny",
                           "--out", str(out), "--work-root", str(out), *args],
                          capture_output=True, text=True, timeout=1500)
    path = out / "sglang_gms.json"
    assert path.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(path.read_text()), proc


def completed(results: dict, proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:] + json.dumps(
        {k: v.get("log_tail") for k, v in results["engines"].items()})[-6000:]
    return results


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    return completed(*bench(tmp_path_factory, "sglang_gms", "--parts", "share,restart"))


@pytest.fixture(scope="module")
def failover(tmp_path_factory) -> dict:
    return completed(*bench(tmp_path_factory, "sglang_failover", "--parts", "failover", "--repeats", "2"))


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


def test_engines_serve_through_a_take_over_and_a_killed_daemon_without_reloading(run):
    x = run["restart"]
    weights = run["engines"]["A"]["gms_layout"]
    for name, windows in x["requests"].items():
        assert windows["all"]["n"] > 0 and windows["take_over"]["n"] > 0 and windows["sigkill"]["n"] > 0, name
        assert windows["all"]["failed"] == 0 and windows["all"]["unequal"] == 0, (name, windows)
    assert x["weight_loads"] == {"A": 1, "B": 1}  # SGLang's "Load weight end": once each, at start
    assert x["gms_loads"]["A"]["loaded from disk and published"] == 1 and x["gms_loads"]["B"]["imported"] == 1

    def weights_hash(layouts):
        return next(lay["hash"] for lay in layouts if lay["name"] == weights)

    before = weights_hash(x["layouts_before"])
    assert weights_hash(x["layouts_after_take_over"]) == before == weights_hash(x["layouts_after_sigkill"])
    assert x["take_over"]["old_exit"] == 0


def test_an_engine_released_and_resumed_after_a_killed_daemon_finds_the_server_that_came_back(run):
    x = run["restart"]
    assert x["B_release"]["health_released"][1]["status"] == "asleep"
    assert x["B_release"]["health_resumed"][1]["status"] == "serving"
    assert x["B_after_equal"] and x["A_after_equal"]
    mine = [lay for lay in x["layouts_after_B_resume"] if lay["writer"]]
    assert {lay["name"].split("/")[0] for lay in mine} == {"sglang-kv", "sglang-graph"}  # B's, made anew
    weights = next(lay for lay in x["layouts_after_B_resume"] if lay["name"] == run["engines"]["A"]["gms_layout"])
    assert weights["readers"] >= 1  # B reads it again (A rides through on its next call)


def test_the_coordinator_fails_sglang_engines_over(failover):
    f = failover["failover"]
    assert len(f["runs"]) == 2 and all(r["ok"] for r in f["runs"])
    assert [r["failed"] for r in f["runs"]] == ["A", "B"]  # the killed set came back as the shadow
    assert all(r["signal_to_first_token_s"] < 30 for r in f["runs"])  # not a fresh start (~60 s)
    assert failover["failover_output_equal"]  # the woken shadow's graphs give the primary's output
    assert len(failover["outputs"]["failover"]) == failover["completion_tokens"]
