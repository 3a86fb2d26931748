"""On-demand weights: a GPU budget, LRU eviction to the host tier, restore on the next read."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

import gms
from gms import GMSClientMemoryManager, RequestedLockType
from gms.wire import messages as m

from .helpers import MiB, RawConn, wait_until

SIZE = 4 * MiB


def pattern(name: str) -> bytes:
    return (name.encode() * (SIZE // len(name) + 1))[: 64 * 1024]


def publish(server, name: str, residency: str | None = "system", sizes=(SIZE,)) -> str:
    writer = GMSClientMemoryManager(server.socket, layout=name)
    writer.connect(RequestedLockType.RW)
    for n, size in enumerate(sizes):
        allocation_id, _ = writer.allocate_handle(size, tag="weights")
        va = writer.create_mapping(allocation_id)
        writer.write(va, pattern(name))
        writer.metadata_put(f"t{n}", allocation_id, 0, b"")
    writer.commit(residency)
    writer.close()
    return server.layout(name).memory_layout_hash


def read(server, name: str) -> bytes:
    with GMSClientMemoryManager(server.socket, layout=name) as reader:
        reader.connect(RequestedLockType.RO, timeout_ms=30_000)
        allocation_id, _, _ = reader.metadata_get("t0")
        va = reader.create_mapping(allocation_id)
        return reader.read(va, len(pattern(name)))


@pytest.fixture(params=["copier", "clients"])
def budgeted(start_server, request):
    """Room on the GPU for two of the 4 MiB models; the host tier for all of them.
    Host-tier bytes moved by the server's copier, or by the clients themselves."""
    copier = [] if request.param == "copier" else ["--no-copier"]
    return start_server("--gpu-budget", str(2 * SIZE), "--alloc-retry-timeout", "1", *copier)


def tiers(server) -> dict[str, str]:
    return {row.name: row.tier for row in server.state().layouts}


def test_least_recently_used_idle_layouts_are_evicted_and_restored_on_demand(budgeted):
    hashes = {name: publish(budgeted, name) for name in ("a", "b")}
    assert read(budgeted, "a") == pattern("a")  # a is now more recently used than b
    hashes["c"] = publish(budgeted, "c")  # no room: b, the least recently used, goes to the host
    assert tiers(budgeted) == {"a": "device", "b": "host", "c": "device"}
    evicted = [e for e in budgeted.events() if e.kind == "LAYOUT_EVICTED"]
    assert [(e.layout, e.fields["reason"]) for e in evicted] == [("b", "budget")]

    assert read(budgeted, "b") == pattern("b"), "restored from the host copy, byte for byte"
    state = budgeted.state()
    assert tiers(budgeted) == {"a": "host", "b": "device", "c": "device"}  # a was then the LRU one
    assert state.layout("b").restores == 1 and state.layout("b").memory_layout_hash == hashes["b"]
    assert state.used_bytes == 2 * SIZE <= state.budget_bytes
    assert state.host_used_bytes == 3 * SIZE and state.host_handle_count == 3
    kinds = budgeted.kinds()
    assert kinds[kinds.index("RESTORE_CLAIMED"):][:4] == [
        "RESTORE_CLAIMED", "LAYOUT_EVICTED", "RESTORE_LOADING", "RESTORE_FINISHED",
    ]


def test_a_sleeping_reader_remaps_at_the_same_addresses_after_an_eviction(budgeted):
    publish(budgeted, "m")
    reader = GMSClientMemoryManager(budgeted.socket, layout="m")
    reader.connect(RequestedLockType.RO)
    allocation_id, _, _ = reader.metadata_get("t0")
    va = reader.create_mapping(allocation_id)
    reader.unmap_all_vas()
    reader.abort()  # asleep: addresses kept, no lock
    gms.client.admin.evict(budgeted.socket, "m")
    assert budgeted.layout("m").tier == "host"
    reader.connect(RequestedLockType.RO)  # this reader restores it, unasked
    reader.remap_all_vas()  # the hash is the same: no StaleMemoryLayoutError
    assert reader.read(va, len(pattern("m"))) == pattern("m")
    reader.close()


RESTORER = textwrap.dedent(
    """
    import sys, time
    from gms.wire import messages as m
    from tests.helpers import RawConn
    conn = RawConn(sys.argv[1])
    response = conn.call(m.HandshakeRequest("RO", None, "m"))
    assert response.restore, response
    print("restoring", flush=True)   # it holds the restore, the GPU memory is there, half-filled
    time.sleep(600)
    """
)


def test_a_restorer_killed_mid_copy_hands_the_restore_to_the_next_reader(start_server):
    budgeted = start_server("--gpu-budget", str(2 * SIZE), "--alloc-retry-timeout", "1", "--no-copier")
    publish(budgeted, "m")
    gms.client.admin.evict(budgeted.socket, "m")
    restorer = subprocess.Popen([sys.executable, "-c", RESTORER, budgeted.socket], stdout=subprocess.PIPE, text=True)
    assert restorer.stdout.readline().strip() == "restoring"
    waiting = RawConn(budgeted.socket)
    waiting.send(m.HandshakeRequest("RO", 200, "m"))
    assert waiting.recv()[0].success is False, "nobody reads a half-copied layout"
    restorer.send_signal(signal.SIGKILL)
    restorer.wait()
    wait_until(lambda: budgeted.layout("m").tier == "host", what="RESTORE_ABORTED")
    assert read(budgeted, "m") == pattern("m")
    assert budgeted.kinds().count("RESTORE_ABORTED") == 1


def test_unpinned_layouts_are_dropped_and_device_layouts_never_evicted(budgeted):
    publish(budgeted, "pinned", residency="device")
    publish(budgeted, "loose", residency="unpinned")
    publish(budgeted, "third", residency="device")  # evicts "loose": the only evictable one
    assert tiers(budgeted) == {"pinned": "device", "third": "device"}
    conn = RawConn(budgeted.socket)
    assert conn.handshake("RW_OR_RO", layout="loose").granted_lock_type == "RW", "its next user reloads it"
    refused = conn.call(m.AllocateRequest(SIZE, "w"))
    assert refused.code == "OUT_OF_MEMORY", "nothing evictable: the allocation waited, then gave up"
    assert tiers(budgeted) == {"pinned": "device", "third": "device", "loose": "device"}


def test_a_layout_larger_than_the_budget_is_a_clear_error_at_publish(budgeted):
    writer = GMSClientMemoryManager(budgeted.socket, layout="huge")
    writer.connect(RequestedLockType.RW)
    writer.allocate_handle(SIZE)
    writer.allocate_handle(SIZE)
    with pytest.raises(gms.GMSServerError, match="can never fit") as error:
        writer.allocate_handle(SIZE)
    assert error.value.code == "BUDGET_EXCEEDED"
    writer.close()


def test_host_memory_exhausted_is_a_clear_error_for_the_writer_and_nothing_is_lost(start_server):
    server = start_server("--host-budget", str(SIZE))
    publish(server, "first")
    writer = GMSClientMemoryManager(server.socket, layout="second")
    writer.connect(RequestedLockType.RW)
    allocation_id, _ = writer.allocate_handle(SIZE)
    va = writer.create_mapping(allocation_id)
    writer.write(va, pattern("second"))
    writer.metadata_put("t0", allocation_id, 0, b"")
    with pytest.raises(gms.GMSServerError) as error:
        writer.commit("system")
    assert error.value.code == "HOST_MEMORY_EXHAUSTED"
    assert server.layout("first").committed and server.layout("second").writer, "the writer keeps its layout"
    writer.remap_all_vas()
    assert writer.commit("device")  # and may publish it on the GPU only
    assert read(server, "second") == pattern("second") and read(server, "first") == pattern("first")


def test_operators_evict_and_pin_from_the_command_line(budgeted):
    publish(budgeted, "m")

    def gms_cli(*args):
        return subprocess.run([sys.executable, "-m", "gms", *args, "--socket", budgeted.socket],
                              capture_output=True, text=True, timeout=60)

    out = gms_cli("evict", "m")
    assert out.returncode == 0 and "now on tier host" in out.stdout
    pinned = gms_cli("pin", "m")
    assert pinned.returncode == 1 and "evicted" in pinned.stderr
    assert read(budgeted, "m") == pattern("m")
    assert gms_cli("pin", "m").stdout.strip() == "m: residency device"
    refused = gms_cli("evict", "m")
    assert refused.returncode == 1 and "pinned to the device" in refused.stderr
