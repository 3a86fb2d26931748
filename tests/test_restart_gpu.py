"""Restarts and take-overs on the CUDA backend: what only a GPU can show.

* memory held by the keeper's fds outlives the server that made it, and the
  next server adopts it (``cuMemImportFromShareableHandle`` without a
  context): the bytes a client wrote are there, the card's used memory does
  not move (nothing is copied or made twice), and neither the keeper nor the
  new server ever shows up as a GPU process;
* a take-over on CUDA: a client's mapped memory and lock go on;
* the validity check: an fd that is not this device's VMM memory does not
  adopt, and its layout is dropped (``LAYOUT_LOST``), the others kept;
* host copies the copier made in pinned chunks: kept by the keeper chunk by
  chunk, adopted on the host tier, restored through the next server's copier.

Run by the lead on the H100 (``pytest -m gpu tests/test_restart_gpu.py``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

import pytest

from gms import GMSClientMemoryManager, RequestedLockType
from gms.client.probes import get_runtime_state
from gms.errors import GMSError
from gms.fsm import compute_layout_hash
from gms.fsm.events import (
    AllocationCreated,
    HostCopyCreated,
    MetadataPut,
    RwCommit,
    RwConnect,
    ServerStarted,
    SessionClosed,
    SessionOpened,
)
from gms.handover.image import STATE_VERSION, ServerInfo, StateImage, encode_image
from gms.keeper.store import Store
from gms.store import EventLog
from gms.wire import messages as m

from .helpers import RawConn, ServerProcess, served_from_store, wait_until

pytestmark = pytest.mark.gpu
MiB, GiB = 1 << 20, 1 << 30


def used_bytes(server: ServerProcess) -> int:
    """The card's used memory, as NVML says (through the server's probe), once the
    server's copier runs: its CUDA context takes device memory of its own, and a
    new server's copier starts after it serves (compare one context with one)."""
    state = wait_until(lambda: (s := server.state()).copier in ("running", "off") and s, timeout=120,
                       what="the server's copier")
    assert state.device_free_bytes is not None, "NVML must answer on a GPU host"
    return state.capacity_bytes - state.device_free_bytes


def gpu_processes() -> set[str]:
    if shutil.which("nvidia-smi") is None:
        pytest.skip("nvidia-smi not found")
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True).stdout
    return set(out.split())


def killed(server: ServerProcess) -> int:
    old = server.server_pid()
    os.kill(old, signal.SIGKILL)

    def new_pid():
        try:
            pid = get_runtime_state(server.socket, timeout=60).pid
        except GMSError:
            return None
        return pid if pid != old else None

    return wait_until(new_pid, timeout=120, what="the keeper's next server")


def lost(server: ServerProcess) -> list[tuple[str, str]]:
    """(layout, why) of each LAYOUT_LOST: what an assertion shows when memory did not come back."""
    events = RawConn(server.socket).call(m.GetEventHistoryRequest()).events
    return [(e["layout"], e["reason"]) for e in events if e["kind"] == "LAYOUT_LOST"]


def publish(path: str, layout: str, sizes, fill: int) -> tuple[str, list]:
    writer = GMSClientMemoryManager(path, layout=layout)
    writer.connect(RequestedLockType.RW)
    for n, size in enumerate(sizes):
        va = writer.create_mapping(size=size, tag=layout)
        writer.write(va, bytes([fill + n]) * 4096)
        writer.write(va + size - 4096, bytes([fill + n]) * 4096)
        writer.metadata_put(f"t{n}", next(mp.allocation_id for mp in writer.mappings if mp.va == va), 0, b"x")
    writer.commit()
    writer.close()
    reader = GMSClientMemoryManager(path, layout=layout)
    reader.connect(RequestedLockType.RO)
    layout_hash = reader.get_memory_layout_hash()
    handles = reader.list_handles()
    reader.close()
    return layout_hash, handles


def check_bytes(path: str, layout: str, handles, fill: int) -> None:
    reader = GMSClientMemoryManager(path, layout=layout)
    reader.connect(RequestedLockType.RO)
    for n, handle in enumerate(sorted(handles, key=lambda h: h.layout_slot)):
        va = reader.create_mapping(handle.allocation_id)
        assert reader.read(va, 4096) == bytes([fill + n]) * 4096
        assert reader.read(va + handle.size - 4096, 4096) == bytes([fill + n]) * 4096
    reader.close()


def test_a_killed_cuda_server_comes_back_with_its_memory_nothing_copied(tmp_path):
    server = ServerProcess(tmp_path, backend="cuda", keeper=True)
    try:
        layout_hash, handles = publish(server.socket, "weights", (GiB, 512 * MiB), fill=7)
        before = used_bytes(server)
        new_pid = killed(server)
        state = server.state()
        assert state.layout("weights").memory_layout_hash == layout_hash, lost(server)
        assert (state.server_handle_count, state.server_handle_bytes) == (2, GiB + 512 * MiB)
        after = used_bytes(server)
        assert abs(after - before) < 256 * MiB, f"nothing copied or made twice: {before} -> {after}"
        check_bytes(server.socket, "weights", handles, fill=7)
        apps = gpu_processes()
        assert str(new_pid) not in apps and str(server.pid) not in apps, "no context in the keeper or the server"
    finally:
        server.kill()


def test_a_take_over_on_cuda_keeps_a_client_s_mapping_and_lock(tmp_path):
    old = ServerProcess(tmp_path, backend="cuda", keeper=True)
    try:
        layout_hash, handles = publish(old.socket, "weights", (256 * MiB,), fill=3)
        reader = GMSClientMemoryManager(old.socket)
        reader.connect(RequestedLockType.RO)
        va = reader.create_mapping(handles[0].allocation_id)
        before = used_bytes(old)
        new = ServerProcess(tmp_path, "--take-over", socket_path=old.socket, backend="cuda", keeper=True)
        assert old.proc.wait(60) == 0
        assert reader.metadata_get("t0") is not None and reader.reconnects == 0, "no client noticed"
        assert reader.read(va, 4096) == bytes([3]) * 4096
        assert new.state().layout("weights").readers == 1
        assert abs(used_bytes(new) - before) < 256 * MiB
        reader.close()
        assert new.layout("weights").memory_layout_hash == layout_hash
        new.kill()
    finally:
        old.kill()


def test_an_fd_that_is_not_this_device_s_vmm_memory_drops_its_layout(tmp_path):
    """The context-free validity check: a keeper hands back one layout whose fds
    are real VMM memory (device and host tier) and one whose fd is a memfd."""
    from gms.cuda.vmm import VmmBackend, VmmHostTier, device_uuid

    device, host = VmmBackend(0), VmmHostTier(0)
    uuid = device_uuid(0)
    gran = device.granularity
    good = device.create(gran, "good")
    good_copy = host.create(max(gran, host.granularity), "good-copy")
    bad = os.memfd_create("not-vmm")
    os.ftruncate(bad, gran)
    log = EventLog(retain=None)
    log.append(ServerStarted(0, device.total_bytes, None, None, {"default": None}, {}, backend="cuda",
                             device=0, device_uuid=uuid, layout=""))
    for conn, (name, allocation_id, copy) in enumerate((("good", "g0", True), ("bad", "b0", False)), 1):
        log.extend([SessionOpened(conn, "default", 0, 0, conn, "RW", layout=name), RwConnect(conn, layout=name),
                    AllocationCreated(conn, allocation_id, gran, gran, "w", 0, layout=name),
                    MetadataPut(conn, "k", allocation_id, 0, b"v", layout=name)])
        if copy:
            log.append(HostCopyCreated(conn, allocation_id, layout=name))
        state = log.state.layout(name)
        digest = compute_layout_hash(state.allocations.values(), state.metadata.values())
        log.extend([RwCommit(conn, digest, "system" if copy else "device", layout=name),
                    SessionClosed(conn, layout=name)])
    store = Store()
    store.base = encode_image(StateImage(STATE_VERSION, ServerInfo(1, "cuda", 0, uuid, True), log.last_seq, 9,
                                         log.state))
    store.fds.update({"gpu:g0": os.dup(good.fd), "host:g0": os.dup(good_copy.fd), "gpu:b0": bad})
    try:
        with served_from_store(tmp_path, store, backend="cuda") as served:
            path = served.path
            state = get_runtime_state(path)
            events = [e for e in RawConn(path).call(m.GetEventHistoryRequest()).events if e["kind"] == "LAYOUT_LOST"]
            assert [row.name for row in state.layouts] == ["good"], [e["reason"] for e in events]
            assert (state.server_handle_count, state.host_handle_count) == (1, 1)
            assert [(e["layout"], e["allocation_id"], e["tier"]) for e in events] == [("bad", "b0", "gpu")]
            assert "cuMemImportFromShareableHandle" in events[0]["reason"] or "another kind" in events[0]["reason"]
    finally:
        store.close()
        device.release(good)
        host.release(good_copy)


def test_host_copies_the_copier_made_in_chunks_come_back_after_a_crash_and_restore(tmp_path):
    """On CUDA: the copier fills a publish's host copies with pinned chunks (a pool of
    64 MiB chunks, an exact one for the rest); the keeper keeps each chunk's fd, the
    next server adopts them on the host tier (no context) and its own copier, told
    of every chunk, restores the evicted layout from them: the bytes come back."""
    server = ServerProcess(tmp_path, "--host-pool", "256MiB", "--host-chunk", "64MiB", backend="cuda", keeper=True)
    try:
        wait_until(lambda: server.state().copier == "running", timeout=120, what="the copier")
        writer = GMSClientMemoryManager(server.socket, layout="cold")
        writer.connect(RequestedLockType.RW)
        sizes = (160 * MiB, 40 * MiB)  # 64 + 64 + 32 MiB; one exact chunk
        for n, size in enumerate(sizes):
            va = writer.create_mapping(size=size, tag="cold")
            writer.write(va, bytes([11 + n]) * 4096)
            writer.write(va + size - 4096, bytes([11 + n]) * 4096)
            writer.metadata_put(f"t{n}", next(mp.allocation_id for mp in writer.mappings if mp.va == va), 0, b"x")
        writer.commit("system")  # the copier fills the host copies
        writer.close()
        layout_hash = server.layout("cold").memory_layout_hash
        reader = GMSClientMemoryManager(server.socket, layout="cold")
        reader.connect(RequestedLockType.RO)
        handles = reader.list_handles()
        reader.close()
        assert RawConn(server.socket).call(m.EvictRequest("cold")).tier == "host"
        killed(server)
        assert server.layout("cold").tier == "host" and server.state().host_handle_count == 2, lost(server)
        wait_until(lambda: server.state().copier == "running", timeout=120, what="the new server's copier")
        granted = RawConn(server.socket).handshake("RO", layout="cold")
        assert (granted.success, granted.restore, granted.memory_layout_hash) == (True, False, layout_hash)
        check_bytes(server.socket, "cold", handles, fill=11)
    finally:
        server.kill()
