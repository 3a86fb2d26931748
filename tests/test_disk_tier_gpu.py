"""The disk tier on a GPU (issue 52): the copier's CUDA path (pinned staging,
cuMemcpy, O_DIRECT, a crc32 per extent), under a keeper, across a simulated
reboot: every gms process stopped, ``gms serve`` started again."""

from __future__ import annotations

import hashlib
import os

import pytest

from gms import GMSClientMemoryManager, RequestedLockType
from gms.errors import GMSServerError

from .test_disk_tier import _no_server_outlives_its_test, flip_bit, saved  # noqa: F401 (the fixture: every server killed)
from .test_disk_tier import serve as serve_on

pytestmark = pytest.mark.gpu
MiB = 1 << 20
SIZES = (96 * MiB + 12345, 5 * MiB, 64 * MiB)  # several extents, a short one, an odd size


def serve(tmp_path):
    return serve_on(tmp_path, backend="cuda")


def publish(path: str) -> tuple[str, list[str]]:
    writer = GMSClientMemoryManager(path, layout="weights")
    writer.connect(RequestedLockType.RW)
    sums = []
    for n, size in enumerate(SIZES):
        va = writer.create_mapping(size=size, tag="weights")
        data = os.urandom(size)
        writer.write(va, data)
        sums.append(hashlib.sha256(data).hexdigest())
        writer.metadata_put(f"t{n}", writer.mappings[-1].allocation_id, 0, b"bf16")
    writer.commit(persist=True)
    layout_hash = writer.get_memory_layout_hash()
    writer.close()
    return layout_hash, sums


def read_sums(path: str, lock=RequestedLockType.RW_OR_RO) -> tuple[str, str, list[str]]:
    reader = GMSClientMemoryManager(path, layout="weights")
    reader.connect(lock)
    try:
        handles = reader.list_handles()
        vas = reader.create_mappings([h.allocation_id for h in handles])
        sums = [hashlib.sha256(reader.read(va, h.size)).hexdigest() for va, h in zip(vas, handles)]
        return reader.granted_lock_type.value, reader.get_memory_layout_hash(), sums
    finally:
        reader.close()


def test_a_persisted_layout_is_back_on_the_gpu_after_every_gms_process_is_gone(tmp_path):
    server = serve(tmp_path)
    layout_hash, sums = publish(server.socket)
    saved(server)
    server.stop()
    server = serve(tmp_path)
    assert server.layout().tier == "disk"
    assert read_sums(server.socket) == ("RO", layout_hash, sums), "RW_OR_RO imports the same bytes"
    assert server.layout().tier == "gpu" and server.layout().restores == 1
    server.kill()  # keeper and all, at once
    server = serve(tmp_path)
    assert read_sums(server.socket, RequestedLockType.RO) == ("RO", layout_hash, sums)
    server.stop()


def test_a_flipped_bit_on_disk_is_found_on_the_gpu_path_and_never_served(tmp_path):
    server = serve(tmp_path)
    publish(server.socket)
    path = saved(server)
    server.stop()
    flip_bit(path, 40 * MiB + 7)
    server = serve(tmp_path)
    with pytest.raises(GMSServerError) as refused:
        read_sums(server.socket, RequestedLockType.RO)
    assert refused.value.code == "SNAPSHOT_UNREADABLE"
    assert server.layout().state == "EMPTY"
    server.stop()


def test_a_torch_model_saved_to_persist_is_usable_in_a_new_process_after_a_reboot(tmp_path):
    torch = pytest.importorskip("torch")
    import gms.torch as gt

    from .test_torch import read_in_another_process
    from .torch_models import INPUT, tiny

    server = serve(tmp_path)
    model = tiny(seed=5).cuda()
    with torch.no_grad():
        expected = model(INPUT.cuda()).float().flatten().tolist()
    writer = GMSClientMemoryManager(server.socket, layout="weights")
    writer.connect(RequestedLockType.RW)
    gt.publish_module(model, writer, prefix="m/")
    writer.commit(persist=True)
    writer.close()
    saved(server)
    server.stop()
    server = serve(tmp_path)
    got = read_in_another_process(server, "m/")
    assert got["device"] == "cuda:0" and got["missing"] == []
    assert got["logits"] == pytest.approx(expected, rel=1e-5, abs=1e-5)
    server.stop()
