"""gms.torch on the GPU: the pluggable allocator, CUDA graphs across sleep/wake,
and the example engine against a plain from_pretrained load."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import gms.torch as gt  # noqa: E402
from gms import GMSClientMemoryManager, RequestedLockType  # noqa: E402

from .helpers import ServerProcess, wait_until  # noqa: E402
from .test_torch import read_in_another_process  # noqa: E402
from .torch_models import INPUT, Tiny, tiny  # noqa: E402

pytestmark = pytest.mark.gpu
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture
def weights(tmp_path):
    server = ServerProcess(tmp_path, backend="cuda")
    yield server
    server.kill()


def connected(server, lock, layout: str = "weights") -> GMSClientMemoryManager:
    mgr = GMSClientMemoryManager(server.socket, layout=layout)
    mgr.connect(lock)
    return mgr


def test_tensors_made_under_use_memory_live_in_gms_and_publish_without_copies(weights):
    mgr = connected(weights, RequestedLockType.RW)
    with gt.use_memory(mgr, tag="weights"):
        model = tiny(seed=3).cuda()
    spans = [(mp.va, mp.va + mp.size) for mp in mgr.mappings]
    assert all(any(lo <= p.data_ptr() < hi for lo, hi in spans) for p in model.parameters())
    before = weights.layout().allocation_count
    assert before >= 1
    with torch.no_grad():
        expected = model(INPUT.cuda()).float().flatten().tolist()
    gt.publish_module(model, mgr, prefix="m/")
    assert weights.layout().allocation_count == before, "nothing was copied"
    mgr.commit()
    got = read_in_another_process(weights, "m/")
    assert got["tied"] and got["inside"] and got["device"] == "cuda:0"
    assert got["logits"] == pytest.approx(expected, rel=1e-5, abs=1e-5)
    mgr.close()


def test_frees_after_the_block_still_find_their_owner(weights):
    mgr = connected(weights, RequestedLockType.RW)
    with gt.use_memory(mgr, tag="weights") as pool:
        big = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    assert weights.layout().allocation_count >= 1
    del big
    mgr._torch_pools.clear()
    del pool
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    wait_until(lambda: weights.layout().allocation_count == 0, what="server allocation freed", timeout=10)
    assert mgr.mappings == []
    mgr.close()


def test_a_cuda_graph_replays_after_sleep_and_wake(weights):
    writer = connected(weights, RequestedLockType.RW)
    gt.publish_module(tiny(seed=4), writer, prefix="m/")
    writer.commit()
    writer.close()

    w = connected(weights, RequestedLockType.RO)
    with gt.empty_parameters():
        model = Tiny()
    gt.materialize_module(model, w, prefix="m/")
    kv = connected(weights, RequestedLockType.RW, layout="kv_cache")
    with gt.use_memory(kv, tag="kv_cache"):
        cache = torch.empty(1 << 20, device="cuda")
    cache.fill_(0.25)
    static = INPUT.cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):
            model(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = model(static) + cache[:8].sum()
    graph.replay()
    torch.cuda.synchronize()
    before = out.clone()
    pointers = [p.data_ptr() for p in model.parameters()] + [cache.data_ptr()]

    gt.sleep(w)
    gt.sleep(kv)
    wait_until(lambda: weights.layout().readers == 0, what="weights lock released")
    wait_until(lambda: weights.layout("kv_cache").allocation_count == 0, what="KV memory released")

    gt.wake_weights(w)
    gt.wake_kv_cache(kv, tag="kv_cache")
    assert [p.data_ptr() for p in model.parameters()] + [cache.data_ptr()] == pointers
    cache.fill_(0.25)  # the KV cache comes back as fresh memory
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, before)
    w.close()
    kv.close()


def _have_transformers() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None


needs_transformers = pytest.mark.skipif(not _have_transformers(), reason="transformers not installed")


def run_example(*args: str, timeout: int = 600) -> str:
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-4000:])
    return out.stdout


@needs_transformers
def test_example_engine_readers_match_a_plain_load(weights, tmp_path):
    from transformers import AutoModelForCausalLM

    workdir = tmp_path / "tiny-llama"
    published = json.loads(run_example(str(EXAMPLES / "llm_writer.py"), "--socket", weights.socket,
                                       "--workdir", str(workdir)).splitlines()[-1])
    assert published["published"] > 10
    assert "already published" in run_example(str(EXAMPLES / "llm_writer.py"), "--socket", weights.socket,
                                              "--workdir", str(tmp_path / "again"))
    readers = [
        subprocess.Popen([sys.executable, str(EXAMPLES / "llm_reader.py"), "--socket", weights.socket,
                          "--logits", str(tmp_path / f"logits{n}.pt")], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for n in range(2)
    ]
    results = []
    for reader in readers:
        out, err = reader.communicate(timeout=600)
        assert reader.returncode == 0, err[-4000:]
        results.append(json.loads(out.splitlines()[-1]))
    assert results[0]["tokens"] == results[1]["tokens"] and results[0]["device"] == "cuda:0"

    reference = AutoModelForCausalLM.from_pretrained(workdir).cuda().eval()
    with torch.no_grad():
        expected = reference(torch.tensor([[1, 17, 301, 5, 99, 1024, 7, 3]], device="cuda")).logits.cpu()
        tokens = reference.generate(torch.tensor([[1, 17, 301, 5, 99, 1024, 7, 3]], device="cuda"),
                                    max_new_tokens=16, do_sample=False)[0, 8:].tolist()
    for n in range(2):
        got = torch.load(tmp_path / f"logits{n}.pt")
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert results[0]["tokens"] == tokens


@needs_transformers
def test_shadow_pair_example_fails_over(weights, tmp_path):
    run_example(str(EXAMPLES / "llm_writer.py"), "--socket", weights.socket, "--workdir", str(tmp_path / "m"))
    out = run_example(str(EXAMPLES / "shadow_pair.py"), "demo", "--socket", weights.socket)
    summary = json.loads(out.splitlines()[-1])
    assert summary["same_tokens"], summary
    # gms's part of a failover: the primary's socket closes as its process
    # starts to exit (RW_ABORT) and the waiting shadow is granted at once.  The
    # shadow's own next driver calls may then wait for the driver to tear the
    # primary's context down (seconds on some hosts); that is not gms.
    kinds = [(e.kind, e.time) for e in weights.events() if e.layout == "kv_cache" and e.kind.startswith("RW_")]
    abort = next(i for i, (kind, _) in enumerate(kinds) if kind == "RW_ABORT")
    granted_kind, granted_at = kinds[abort + 1]
    assert granted_kind == "RW_CONNECT" and granted_at - kinds[abort][1] < 0.5, (summary, kinds)
