"""gms.torch on every backend: encoding, views, packing, publish/materialize, loading.

On the host backend the tensors are CPU tensors over shared memory, so all of
this runs in CI; on the CUDA backend the same tests run on the GPU.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import gms  # noqa: E402
import gms.torch as gt  # noqa: E402
from gms import GMSClientMemoryManager, RequestedLockType  # noqa: E402
from gms.client.transport import RpcTransport  # noqa: E402
from gms.cuda.host import HostBackend, HostMapper  # noqa: E402

from .torch_models import INPUT, Tiny, tiny  # noqa: E402

PROC = str(Path(__file__).with_name("proc_torch.py"))
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn, torch.complex64]


def metas():
    return st.builds(
        lambda dtype, shape, stride: gt.TensorMeta(dtype, tuple(shape), tuple(stride[: len(shape)])),
        st.sampled_from(DTYPES),
        st.lists(st.integers(0, 5), max_size=4),
        st.lists(st.integers(0, 40), min_size=4, max_size=4),
    )


@given(metas())
def test_encoding_round_trips(meta):
    value = gt.encode(meta)
    assert gt.decode(value) == meta
    assert len(value) <= 6 + len(gt.encoding.dtype_name(meta.dtype)) + 18 * len(meta.shape)  # compact


@pytest.mark.parametrize("value", [
    b"", b"\x93\x01\x02\x03", b"not msgpack \xc1",
    __import__("msgpack").packb([2, "float32", [1], [1]]),
    __import__("msgpack").packb([1, "no_such_dtype", [1], [1]]),
    __import__("msgpack").packb([1, "float32", [2, 2], [1]]),
    __import__("msgpack").packb([1, "float32", [-1], [1]]),
    __import__("msgpack").packb([1, "Tensor", [1], [1]]),
    # Regression (tests/reliability): a name that is no string raised TypeError.
    __import__("msgpack").packb([1, 5, [1], [1]]),
    __import__("msgpack").packb([1, b"float32", [1], [1]]),
    __import__("msgpack").packb([1, None, [1], [1]]),
])
def test_decoding_refuses_what_is_not_a_tensor_description(value):
    with pytest.raises(gt.TensorMetaError):
        gt.decode(value)


@pytest.fixture(scope="module")
def host_region():
    backend, mapper = HostBackend(), HostMapper()
    size = 4 << 20
    held = backend.create(size)
    va = mapper.reserve(size)
    handle = mapper.map(os.dup(held.fd), va, size, True)
    yield va, size
    mapper.unmap(va, size, handle)
    mapper.free(va, size)
    backend.release(held)
    backend.close()


@settings(max_examples=200)
@given(meta=metas(), slot=st.integers(0, 64))
def test_views_over_mapped_memory_read_what_was_written(host_region, meta, slot):
    va, size = host_region
    offset = slot * 64  # 64-aligned, like every packed placement
    region = gt.views.Region(va, size, torch.device("cpu"))
    base = region.base
    if offset + meta.extent_bytes > size:
        with pytest.raises(ValueError):
            region.tensor(offset, meta)
        return
    tensor = region.tensor(offset, meta)
    assert (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride())) == (meta.dtype, meta.shape, meta.stride)
    if not tensor.numel():
        return  # torch gives empty tensors no address
    assert tensor.data_ptr() == va + offset
    extent = meta.extent_bytes
    base[offset : offset + extent] = torch.randint(0, 256, (extent,), dtype=torch.uint8)
    expected = base[offset : offset + extent].view(meta.dtype).as_strided(meta.shape, meta.stride)

    def raw(t):  # bytes, so NaN patterns compare equal
        return torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8)

    assert torch.equal(raw(tensor), raw(expected))


@given(st.lists(st.integers(0, 5000), max_size=60), st.integers(1000, 20000), st.sampled_from([1, 64, 256]))
def test_pack_plan_places_everything_aligned_and_apart(sizes, pack_bytes, align):
    plan = gt.plan_packs(sizes, pack_bytes, align)
    assert len(plan.placements) == len(sizes)
    spans: dict[int, list] = {}
    for size, p in zip(sizes, plan.placements):
        assert p.offset % align == 0 and p.offset + max(size, 1) <= plan.pack_sizes[p.pack]
        assert p.offset < plan.pack_sizes[p.pack]  # metadata offsets must fall inside
        spans.setdefault(p.pack, []).append((p.offset, p.offset + max(size, 1)))
    for pack, ranges in spans.items():
        ranges.sort()
        assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))
        assert plan.pack_sizes[pack] <= pack_bytes or len(ranges) == 1
    assert len(plan.pack_sizes) <= max(1, math.ceil(sum(max(s, 1) + align for s in sizes) / pack_bytes) * 2 + 1)


def test_empty_parameters_builds_a_skeleton_with_real_buffers():
    with gt.empty_parameters():
        model = Tiny()
    assert all(p.is_meta for p in model.parameters())
    assert not model.positions.is_meta and model.positions[1] == 1 / 16
    assert model.head.weight is model.embed.weight


# -- across processes, on every backend ------------------------------------------------


def read_in_another_process(server, prefix: str) -> dict:
    out = subprocess.run(
        [sys.executable, PROC, server.socket, "0", prefix], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def expected_logits(model: Tiny) -> list[float]:
    with torch.no_grad():
        return model(INPUT).float().flatten().tolist()


def writer(server) -> GMSClientMemoryManager:
    mgr = GMSClientMemoryManager(server.socket)
    mgr.connect(RequestedLockType.RW)
    return mgr


def test_publish_then_materialize_in_another_process(server, backend):
    model = tiny(seed=1)
    mgr = writer(server)
    count = gt.publish_module(model, mgr, prefix="tiny/")
    assert count == len(list(gt.module_tensors(model)))
    assert server.layout().allocation_count == 1, "small tensors share one packed allocation"
    mgr.commit()
    got = read_in_another_process(server, "tiny/")
    assert got["tied"] and got["inside"] and got["missing"] == []
    assert got["device"] == ("cuda:0" if backend == "cuda" else "cpu")
    assert got["logits"] == pytest.approx(expected_logits(model), rel=1e-5, abs=1e-5)
    mgr.close()


def test_safetensors_checkpoint_into_gms_then_a_model(server, backend, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    model = tiny(seed=2)
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_model(model, str(path))  # drops the tied duplicate, as HF does
    mgr = writer(server)
    loaded = gt.load_safetensors(mgr, tmp_path, prefix="ckpt/", pack_bytes=8 << 10, progress=False)
    assert set(loaded) == set(safetensors_torch.load_file(str(path)))
    assert server.layout().allocation_count > 1, "a small pack size spreads tensors over packs"
    mgr.commit()
    got = read_in_another_process(server, "ckpt/")
    reference = Tiny()
    safetensors_torch.load_model(reference, str(path))
    assert got["tied"]
    assert got["logits"] == pytest.approx(expected_logits(reference), rel=1e-5, abs=1e-5)
    mgr.close()


def test_import_costs_a_bounded_number_of_round_trips(server, monkeypatch):
    tensors = {f"layer.{i}.weight": torch.full((16 + i % 7,), float(i)) for i in range(600)}
    mgr = writer(server)
    gt.publish_tensors(mgr, tensors, prefix="many/", pack_bytes=256)  # one allocation each
    assert server.layout().allocation_count > 300
    mgr.commit()
    reader = GMSClientMemoryManager(server.socket)
    reader.connect(RequestedLockType.RO)
    calls = []
    original = RpcTransport.call
    monkeypatch.setattr(RpcTransport, "call", lambda self, req, *rest: calls.append(type(req).__name__) or original(self, req, *rest))
    imported = gt.import_tensors(reader, "many/")
    assert len(imported) == 600
    assert calls.count("MetadataScanRequest") == 1
    assert calls.count("ExportAllocationsRequest") == math.ceil(server.layout().allocation_count / 253)
    assert len(calls) <= 5
    for name, tensor in tensors.items():
        assert torch.equal(imported[name].cpu(), tensor)
    reader.close()
    mgr.close()


def test_shape_mismatch_is_refused(server):
    mgr = writer(server)
    gt.publish_module(tiny(), mgr, prefix="a/")
    mgr.commit()
    reader = GMSClientMemoryManager(server.socket)
    reader.connect(RequestedLockType.RO)
    with gt.empty_parameters():
        other = Tiny(width=32)
    with pytest.raises(ValueError, match="published"):
        gt.materialize_module(other, reader, prefix="a/")
    with gt.empty_parameters():
        model = Tiny()
    with pytest.raises(KeyError, match="not published"):
        gt.materialize_module(model, reader, prefix="nothing/")
    reader.close()


def logits(model) -> list[float]:
    """The model's logits, on whatever device its parameters live."""
    with torch.no_grad():
        return model(INPUT.to(next(model.parameters()).device)).float().cpu().flatten().tolist()


def test_tensors_outlive_a_server_restart_and_wake_on_the_same_layout(start_server):
    """Imported tensors keep working while their server is gone; the reader rides
    through to a server holding the same layout, sleeps and wakes on it; a KV
    cache is rebuilt at its addresses; a server without the layout makes the
    next wake stale at once."""
    model = tiny(seed=3)
    first = start_server()
    gt.publish_module(model, publisher := writer(first), prefix="t/")
    publisher.commit()
    reader = GMSClientMemoryManager(first.socket)
    reader.connect(RequestedLockType.RO)
    with gt.empty_parameters():
        copy = Tiny()
    gt.materialize_module(copy, reader, prefix="t/")
    kv = GMSClientMemoryManager(first.socket, layout="kv")
    kv.connect(RequestedLockType.RW)
    kv_va = kv.create_mapping(size=1 << 20, tag="kv_cache")
    first.kill()
    assert logits(copy) == pytest.approx(expected_logits(model), rel=1e-5, abs=1e-5)

    second = start_server(socket_path=first.socket)
    gt.publish_module(model, again := writer(second), prefix="t/")  # the same layout, published anew
    again.commit()
    assert reader.ensure_connected() is True  # rode through
    gt.sleep(reader)
    gt.wake_weights(reader)
    assert logits(copy) == pytest.approx(expected_logits(model), rel=1e-5, abs=1e-5)
    with pytest.raises(gms.BuildLostError):
        kv.ensure_connected()
    gt.rebuild_kv_cache(kv, "kv_cache")
    assert [mp.va for mp in kv.mappings] == [kv_va] and second.layout("kv").allocation_count == 1

    gt.sleep(reader)
    second.kill()
    third = start_server(socket_path=first.socket)  # empty: the wake waits for a commit
    with pytest.raises(gms.LockTimeoutError):
        gt.wake_weights(reader, timeout_ms=200)
    other = writer(third)
    other.create_mapping(size=3 << 20, tag="other")
    other.commit()
    with pytest.raises(gms.StaleMemoryLayoutError):
        gt.wake_weights(reader)
    for mgr in (reader, kv, publisher, again):
        mgr.close()
