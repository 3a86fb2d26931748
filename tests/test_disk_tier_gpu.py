"""The disk tier on a GPU (issue 52): the copier's CUDA path (pinned staging,
cuMemcpy, O_DIRECT, a crc32 per extent), under a keeper, across a simulated
reboot: every gms process stopped, ``gms serve`` started again."""

from __future__ import annotations

import pytest

from gms import GMSClientMemoryManager, RequestedLockType
from gms.errors import GMSServerError

from .test_disk_tier import _no_server_outlives_its_test, flip_bit, read, saved  # noqa: F401 (the fixture: every server killed)
from .test_disk_tier import publish as publish_on
from .test_disk_tier import serve as serve_on

pytestmark = pytest.mark.gpu
MiB = 1 << 20
SIZES = (96 * MiB + 12345, 5 * MiB, 64 * MiB)  # several extents, a short one, an odd size


def serve(tmp_path, *args: str, socket_path: str | None = None):
    return serve_on(tmp_path, *args, socket_path=socket_path, backend="cuda")


def publish(path: str) -> tuple[str, list[bytes]]:
    return publish_on(path, sizes=SIZES)


def test_a_persisted_layout_is_back_on_the_gpu_after_every_gms_process_is_gone(tmp_path):
    server = serve(tmp_path)
    layout_hash, contents = publish(server.socket)
    saved(server)
    server.stop()
    server = serve(tmp_path)
    assert server.layout().tier == "disk"
    granted, again, got = read(server.socket)
    assert (granted.value, again) == ("RO", layout_hash) and got == contents, "RW_OR_RO imports the same bytes"
    assert server.layout().tier == "device" and server.layout().restores == 1
    server.kill()  # keeper and all, at once
    server = serve(tmp_path)
    assert read(server.socket, lock=RequestedLockType.RO)[1:] == (layout_hash, contents)
    server.stop()


def test_restore_at_start_on_the_gpu_then_a_reader_imports(tmp_path):
    server = serve(tmp_path)
    layout_hash, contents = publish(server.socket)
    saved(server)
    server.stop()
    server = serve(tmp_path, "--restore-at-start", socket_path=server.socket)
    row = server.layout()
    assert (row.tier, row.restores, row.memory_layout_hash) == ("device", 1, layout_hash), server.log
    assert read(server.socket, lock=RequestedLockType.RO)[1:] == (layout_hash, contents)
    assert server.layout().restores == 1, "the reader imported what the server restored"
    server.stop()


def test_a_flipped_bit_on_disk_is_found_on_the_gpu_path_and_never_served(tmp_path):
    server = serve(tmp_path)
    publish(server.socket)
    path = saved(server)
    server.stop()
    flip_bit(path, 40 * MiB + 7)
    server = serve(tmp_path)
    with pytest.raises(GMSServerError) as refused:
        read(server.socket, lock=RequestedLockType.RO)
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
