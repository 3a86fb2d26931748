"""vLLM at tensor parallel 2 on gms: two GPUs, vLLM and a real engine needed (docs/vllm.md).

``bench/vllm.py --tp 2`` on the tiny Llama, as the benchmark runs it: ``gms
serve --devices 0,1`` (a server per GPU), vLLM alone at TP=2 for the
reference, engine A (publishes each rank's shard on its GPU's server) and
B (imports both), sleep and wake of each, then the coordinator over two
TP=2 sets with one rank of the serving engine SIGKILLed.
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
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    from gms.cuda import cuda_device_count

    if cuda_device_count() < 2:
        pytest.skip("needs two GPUs")
    keep = os.environ.get("GMS_TEST_KEEP")  # a folder to keep the JSON and the engines' logs in
    out = Path(keep) / "vllm_tp2" if keep else tmp_path_factory.mktemp("vllm_tp2")
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "vllm.py"), "--tp", "2", "--fault", "kill-rank", "--shape", "tiny",
         "--model", str(out / "model"), "--parts", "share,sleep,failover", "--repeats", "1", "--kv-gib", "0.5",
         "--gpu-utilization", "0.1", "--max-model-len", "512", "--work-root", str(out), "--keep"],
        env={**os.environ, "GMS_BENCH_OUT": str(out)}, capture_output=True, text=True, timeout=2400, check=False)
    found = sorted(out.glob("vllm_*_tp2_share-sleep-failover.json"))
    assert proc.returncode == 0 and found, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(found[-1].read_text())


def test_a_second_tp2_engine_imports_both_shards_and_both_give_vllm_s_own_output(run):
    assert run["tensor_parallel"] == 2
    assert run["A"]["gms_how"] == "loaded from disk and published" and run["B"]["gms_how"] == "imported"
    assert run["A"]["output_equals_baseline"] and run["B"]["output_equals_baseline"]
    weights = {(row["gpu"], row["name"].rsplit("/", 1)[-1]) for row in run["gms_layouts_after"]
               if row["state"] == "COMMITTED" and row["name"].startswith("vllm/")}
    assert weights == {(0, "tp0of2"), (1, "tp1of2")}  # each rank's shard on its own GPU's server


def test_a_tp2_engine_sleeps_and_wakes_with_its_output_unchanged(run):
    for name in ("A", "B"):
        assert run["sleep"][name]["output_equal_all"], run["sleep"][name]


def test_one_rank_of_a_tp2_primary_killed_fails_over_to_the_tp2_shadow(run):
    (failover,) = run["failover"]["runs"]
    assert (failover["fault"], failover["signalled"], failover["rank"]) == ("kill", "rank", 1) and failover["ok"]
    assert failover["signal_to_first_token_s"] > 0
