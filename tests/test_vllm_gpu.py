"""vLLM on gms with a real engine (GPU and vLLM needed; docs/vllm.md).

One gms server (CUDA) and a tiny Llama made on the spot (bench/vllm_model.py):

* vLLM's default loader reads it (the reference output, greedy);
* engine A, ``--load-format gms``, is the first on the GPU: it loads from
  disk and publishes; engine B, ``{"gms_read_only": true}``, imports; both
  give the reference output, and the server shows one weights layout with
  two readers and one KV layout per engine;
* ``POST /sleep`` and ``POST /wake_up`` on each: while asleep its KV layout
  is gone from the server and its weights are unmapped; after the wake the
  output is the same (vLLM's CUDA graphs, captured before, replay over the
  same addresses).

The engines are started once for the module (``bench/vllm_engines.py``, the
benchmark's own launcher) and stopped at its end.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import httpx
import pytest

from gms.client.probes import get_runtime_state

from .helpers import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]
PROMPT = "The shadow engine wakes up when the primary fails, and"
TOKENS = 24
GiB = 1 << 30


def _bench():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import vllm_engines
        import vllm_model
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return vllm_engines, vllm_model


class Deployment:
    def __init__(self, work: Path) -> None:
        self.engines_mod, model_mod = _bench()
        self.work = work
        self.model = model_mod.make_model(work / "model", "tiny", "bfloat16")["folder"]
        self.server = ServerProcess(work, backend="cuda")
        self.env = self.engines_mod.serve_env(str(work / "vllm-cache"))
        self.engines: dict[str, object] = {}

    def start(self, name: str, port: int, **options):
        argv = self.engines_mod.serve_argv(self.model, port, kv_bytes=GiB // 2, gpu_utilization=0.1,
                                           max_model_len=512, max_num_seqs=4, **options)
        engine = self.engines_mod.Engine(argv, self.env, self.work / f"{name}.log", port)
        self.engines[name] = engine
        engine.wait_ready(900)
        return engine

    def gms_state(self, name: str) -> dict:
        r = httpx.post(f"{self.engines[name].url}/collective_rpc", json={"method": "gms_state"}, timeout=60)
        r.raise_for_status()
        return r.json()["results"][0]

    def layouts(self) -> dict:
        return {row.name: row for row in get_runtime_state(self.server.socket).layouts}

    def close(self) -> None:
        for engine in self.engines.values():
            engine.stop()
        self.server.kill()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    dep = Deployment(tmp_path_factory.mktemp("vllm-gpu"))
    try:
        yield dep
    finally:
        dep.close()


def test_first_engine_publishes_the_next_imports_and_both_match_vllms_own_load(deployment):
    dep = deployment
    reference = dep.start("default", 18300, load_format="safetensors")
    expected = reference.complete(PROMPT, TOKENS)["token_ids"]
    reference.stop()
    assert expected and len(expected) == TOKENS

    a = dep.start("A", 18301, extra={"gms_socket": dep.server.socket})
    assert a.load_line()["gms_how"] == "loaded from disk and published"
    assert a.complete(PROMPT, TOKENS)["token_ids"] == expected
    b = dep.start("B", 18302, extra={"gms_socket": dep.server.socket, "gms_read_only": True})
    assert b.load_line()["gms_how"] == "imported"
    assert b.complete(PROMPT, TOKENS)["token_ids"] == expected

    state_a, state_b = dep.gms_state("A"), dep.gms_state("B")
    weights = state_a["weights"]["layout"]
    assert state_b["weights"]["layout"] == weights and weights.startswith("vllm/model/bfloat16/")
    assert state_a["weights"]["lock"] == state_b["weights"]["lock"] == "RO"  # the writer reads too, now
    layouts = dep.layouts()
    assert layouts[weights].committed and layouts[weights].readers == 2
    kv = {state_a["kv_cache"]["layout"], state_b["kv_cache"]["layout"]}
    assert len(kv) == 2 and all(layouts[name].writer for name in kv)  # one KV layout per engine


@pytest.mark.parametrize("name", ["B", "A"])  # the reader, then the engine that published
def test_sleep_and_wake_through_vllms_endpoints(deployment, name):
    dep = deployment
    if name not in dep.engines:
        pytest.skip("the engines did not start")
    engine = dep.engines[name]
    before = engine.complete(PROMPT, TOKENS)["token_ids"]
    state = dep.gms_state(name)
    weights, kv = state["weights"]["layout"], state["kv_cache"]["layout"]
    readers = dep.layouts()[weights].readers

    engine.sleep()
    assert engine.is_sleeping()
    asleep = dep.gms_state(name)
    assert asleep["asleep"] == ["kv_cache", "weights"]
    assert not asleep["weights"]["mapped"] and not asleep["kv_cache"]["mapped"]
    layouts = dep.layouts()
    assert kv not in layouts  # the KV layout went with its lock
    assert layouts[weights].committed and layouts[weights].readers == readers - 1

    engine.wake()
    assert not engine.is_sleeping()
    awake = dep.gms_state(name)
    assert awake["asleep"] == [] and awake["weights"]["mapped"] and awake["kv_cache"]["mapped"]
    assert awake["kv_cache"]["bytes"] == state["kv_cache"]["bytes"]
    assert engine.complete(PROMPT, TOKENS)["token_ids"] == before
    assert dep.layouts()[weights].readers == readers
