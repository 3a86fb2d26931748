"""What only a GPU can show: real VMM memory, the card's capacity, the driver's view.

(The server, client and model-based suites also run here, on the CUDA
backend, through the ``backend`` fixture.)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import gms
from gms import GMSClientMemoryManager, RequestedLockType
from gms.wire import messages as m

from .helpers import RawConn, ServerProcess, wait_until

pytestmark = pytest.mark.gpu
GiB = 1 << 30


@pytest.fixture
def cuda_server(tmp_path):
    server = ServerProcess(tmp_path, "--alloc-retry-interval", "0.05", backend="cuda")
    yield server
    server.kill()


def test_runtime_state_names_the_gpu(cuda_server):
    state = cuda_server.state()
    assert state.backend == "cuda" and state.device_uuid.startswith("GPU-")
    assert state.device_name and state.capacity_bytes > 8 * GiB
    assert state.device_free_bytes is None or 0 < state.device_free_bytes <= state.capacity_bytes
    assert gms.socket_path(0).endswith(f"gms_{state.device_uuid}.sock")


def test_server_holds_memory_without_a_context(cuda_server):
    """cuMemCreate and export need no context: the server never shows up as a GPU process."""
    writer = RawConn(cuda_server.socket)
    writer.handshake("RW")
    assert isinstance(writer.call(m.AllocateRequest(GiB, "weights")), m.AllocateResponse)
    state = cuda_server.state()
    assert (state.server_handle_count, state.server_handle_bytes) == (1, GiB)
    if shutil.which("nvidia-smi") is None:
        pytest.skip("nvidia-smi not found")
    apps = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
        capture_output=True, text=True, check=True,
    ).stdout.split()
    assert str(cuda_server.pid) not in apps


def test_oom_backpressure_near_the_cards_capacity(tmp_path):
    """Fill the card through a reader's import, then wait for it to let go."""
    server = ServerProcess(tmp_path, "--alloc-retry-interval", "0.05", backend="cuda")
    try:
        free = server.state().device_free_bytes
        assert free, "NVML must report free memory on a GPU host"
        chunk = (int(free * 0.6) // (2 << 20)) * (2 << 20)
        writer = GMSClientMemoryManager(server.socket)
        writer.connect(RequestedLockType.RW)
        va = writer.create_mapping(size=chunk, tag="weights")
        writer.write(va, b"big")
        writer.commit()
        reader = GMSClientMemoryManager(server.socket)
        reader.connect(RequestedLockType.RO)
        reader.create_mapping(reader.list_handles()[0].allocation_id)
        reader.abort()  # lock released, memory still imported

        second = RawConn(server.socket)
        second.handshake("RW")  # clears the layout: the server lets go of its handle
        assert server.state().server_handle_count == 0
        second.send(m.AllocateRequest(chunk, "weights"))
        wait_until(lambda: "ALLOCATION_OOM_WAIT" in server.kinds(), what="OOM wait", timeout=30)
        assert not second.readable(0.5), "60% + 60% of the card cannot both exist"
        reader.unmap_all_vas()  # the last importer releases the old memory
        response, _ = second.recv(timeout=30)
        assert isinstance(response, m.AllocateResponse) and response.size == chunk
        assert server.kinds()[-2:] == ["ALLOCATION_OOM_WAIT", "ALLOCATION_CREATED"]
        reader.close()
        writer.close()
    finally:
        server.kill()


def test_oom_timeout_on_the_card(tmp_path):
    server = ServerProcess(tmp_path, "--alloc-retry-interval", "0.05", "--alloc-retry-timeout", "0.5",
                           backend="cuda")
    try:
        total = server.state().capacity_bytes
        conn = RawConn(server.socket)
        conn.handshake("RW")
        response = conn.call(m.AllocateRequest(int(total * 0.7), "weights"))
        assert isinstance(response, m.AllocateResponse)
        response = conn.call(m.AllocateRequest(int(total * 0.7), "weights"))
        assert (type(response), response.code) == (m.ErrorResponse, "OUT_OF_MEMORY")
        assert server.kinds()[-2:] == ["ALLOCATION_OOM_WAIT", "ALLOCATION_OOM_GAVE_UP"]
        # Bigger than the card: refused at once, not waited on.
        response = conn.call(m.AllocateRequest(total + 1, "weights"))
        assert response.code == "LIMIT_EXCEEDED"
    finally:
        server.kill()


def test_device_memory_written_by_a_kernel_is_read_by_another_process(cuda_server):
    """cuMemsetD32 runs on the device: bytes that never passed through the host."""
    from cuda.bindings import driver as cu

    writer = GMSClientMemoryManager(cuda_server.socket)
    writer.connect(RequestedLockType.RW)
    va = writer.create_mapping(size=64 << 20, tag="weights")
    (err,) = cu.cuMemsetD32(va, 0xC0FFEE11, (64 << 20) // 4)
    assert err == cu.CUresult.CUDA_SUCCESS
    writer.metadata_put("t0", writer.mappings[0].allocation_id, 0, str(1 << 20).encode())
    writer.commit()

    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("proc_client.py")), "read", cuda_server.socket, "0", "t0"],
        input="\n", capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    data = bytes.fromhex(proc.stdout.split()[1])
    assert data == (0xC0FFEE11).to_bytes(4, "little") * ((1 << 20) // 4)


WRITE_THEN_UNMAP = r"""
import sys
from gms.cuda import open_mapper
from gms.wire import messages as m
from tests.helpers import RawConn

conn = RawConn(sys.argv[1])
conn.send(m.HandshakeRequest("RW", None, "a", None))
conn.recv()
mapper = open_mapper("cuda", 0)
for round in range(int(sys.argv[2])):
    allocation = conn.call(m.AllocateRequest(1 << 20, "weights"))
    conn.send(m.ExportAllocationRequest(allocation.allocation_id))
    _, (fd,) = conn.recv()
    va = mapper.reserve(allocation.aligned_size)
    handle = mapper.map(fd, va, allocation.aligned_size, True)
    mapper.write(va, round.to_bytes(8, "little") * 8)
    mapper.unmap(va, allocation.aligned_size, handle)  # at once: no read, no sync between
    mapper.free(va, allocation.aligned_size)
    assert conn.call(m.FreeAllocationRequest(allocation.allocation_id)).success
print("ok")
"""


def test_a_write_has_landed_when_it_returns_so_an_unmap_right_after_is_safe(cuda_server):
    """``cuMemcpyHtoD`` from pageable memory returns once the bytes are staged; the
    mapper's ``write`` waits until they land.  Before, an unmap right after had the
    GPU write to an unmapped address (Xid 31, FAULT_PDE): the model-based machine
    with a copier died of it (``CUDA_ERROR_LAUNCH_FAILED`` in the client)."""
    proc = subprocess.run(
        [sys.executable, "-c", WRITE_THEN_UNMAP, cuda_server.socket, "300"],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent.parent,
    )
    assert (proc.returncode, proc.stdout.strip()) == (0, "ok"), proc.stderr
