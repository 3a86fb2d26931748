"""GMSClientMemoryManager against a real server, with readers in other processes."""

from __future__ import annotations

import gc
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import gms
from gms import (
    GMSClientMemoryManager,
    GMSServerError,
    GMSUsageError,
    GrantedLockType,
    LockTimeoutError,
    RequestedLockType,
    StaleMemoryLayoutError,
)
from gms.wire import messages as m

from .helpers import MiB, RawConn, build_layout, wait_until

PROC = str(Path(__file__).with_name("proc_client.py"))
PAYLOAD = bytes(range(256)) * 16  # 4 KiB, no two neighbouring bytes alike


def publish(socket_path: str, tensors: dict[str, bytes], tag: str = "weights") -> tuple[str, dict[str, int]]:
    """Writer: one allocation per tensor, bytes + metadata, commit.  Returns (hash, vas)."""
    writer = GMSClientMemoryManager(socket_path)
    writer.connect(RequestedLockType.RW)
    vas = {}
    for key, data in tensors.items():
        va = writer.create_mapping(size=len(data) + 4096, tag=tag)
        writer.write(va + 4096, data)
        writer.metadata_put(key, _id_at(writer, va), 4096, str(len(data)).encode())
        vas[key] = va
    assert writer.get_memory_layout_hash() == "", "no hash while a writer builds"
    assert writer.commit() is True
    assert not writer.is_connected and writer.is_unmapped
    writer.close()
    return gms.get_runtime_state(socket_path).layout("weights").memory_layout_hash, vas


def _id_at(mgr: GMSClientMemoryManager, va: int) -> str:
    return next(mp.allocation_id for mp in mgr.mappings if mp.va == va)


def spawn(cmd: str, server, key: str = "t0") -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, PROC, cmd, server.socket, "0", key],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def first_line(proc: subprocess.Popen) -> list[str]:
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise AssertionError(f"client process printed nothing; stderr:\n{proc.stderr.read()}")
    return line.split()


def asleep_reader(socket_path: str) -> GMSClientMemoryManager:
    """A reader that mapped "t0", then slept: unmapped and disconnected."""
    mgr = GMSClientMemoryManager(socket_path)
    mgr.connect(RequestedLockType.RO)
    mgr.create_mapping(mgr.metadata_get("t0")[0])
    mgr.unmap_all_vas()
    mgr.abort()
    return mgr


def test_readers_in_other_processes_see_the_writers_bytes(server):
    publish(server.socket, {"t0": PAYLOAD, "t1": PAYLOAD[::-1]})
    readers = [spawn("read", server, key) for key in ("t0", "t1", "t0")]
    outputs = [first_line(r) for r in readers]
    assert [bytes.fromhex(o[1]) for o in outputs] == [PAYLOAD, PAYLOAD[::-1], PAYLOAD]
    assert server.layout().readers == 3
    for reader in readers:
        reader.communicate("\n", timeout=30)
        assert reader.returncode == 0
    wait_until(lambda: server.layout().readers == 0, what="readers gone")


def test_read_only_mapping_cannot_be_written(server):
    publish(server.socket, {"t0": PAYLOAD})
    proc = spawn("write-ro", server)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "survived" not in out, err
    reader = GMSClientMemoryManager(server.socket)
    reader.connect(RequestedLockType.RO)
    allocation_id, offset, _ = reader.metadata_get("t0")
    va = reader.create_mapping(allocation_id)
    assert reader.read(va + offset, len(PAYLOAD)) == PAYLOAD, "the failed write changed nothing"
    reader.close()


def test_unmapped_memory_is_really_gone(server):
    publish(server.socket, {"t0": PAYLOAD})
    proc = spawn("touch-unmapped", server)
    out, err = proc.communicate(timeout=60)
    assert "reading" in out and "survived" not in out and proc.returncode != 0, err


def test_sleep_and_wake_keep_addresses_and_bytes(server):
    layout_hash, _ = publish(server.socket, {"t0": PAYLOAD, "t1": PAYLOAD[::-1]})
    mgr = GMSClientMemoryManager(server.socket)
    mgr.connect(RequestedLockType.RO)
    assert mgr.get_memory_layout_hash() == layout_hash
    vas = {}
    for key in ("t0", "t1"):
        allocation_id, offset, _ = mgr.metadata_get(key)
        vas[key] = mgr.create_mapping(allocation_id) + offset
    total = mgr.total_bytes
    mgr.unmap_all_vas()  # sleep
    mgr.abort()
    assert mgr.is_unmapped and not mgr.is_connected and mgr.total_bytes == total
    wait_until(lambda: server.layout().state == "COMMITTED", what="reader released")
    mgr.connect(RequestedLockType.RO)  # wake
    mgr.remap_all_vas()
    assert not mgr.is_unmapped
    assert mgr.read(vas["t0"], len(PAYLOAD)) == PAYLOAD
    assert mgr.read(vas["t1"], len(PAYLOAD)) == PAYLOAD[::-1]
    assert server.layout().memory_layout_hash == layout_hash
    mgr.close()


def test_a_new_layout_in_between_makes_the_wake_stale(server):
    """The seed's wake: connect(RO) is granted the new layout, remap_all_vas says stale."""
    publish(server.socket, {"t0": PAYLOAD})
    mgr = asleep_reader(server.socket)
    publish(server.socket, {"t0": PAYLOAD, "extra": b"x" * 10})
    mgr.connect(RequestedLockType.RO)
    with pytest.raises(StaleMemoryLayoutError):
        mgr.remap_all_vas()
    assert mgr.is_unmapped, "nothing was mapped over the preserved addresses"
    assert server.layout().readers == 1, "it reads the new layout: re-import from scratch"
    mgr.close()


def test_a_layout_replaced_while_the_wake_waits_makes_remap_stale(server):
    """The server checks expect_hash when the handshake arrives; a layout rebuilt
    while the handshake waits behind a writer is granted, and remap says stale."""
    publish(server.socket, {"t0": PAYLOAD})
    mgr = asleep_reader(server.socket)
    holder = GMSClientMemoryManager(server.socket)
    holder.connect(RequestedLockType.RO)
    writer = RawConn(server.socket)
    writer.send(m.HandshakeRequest("RW"))  # waits for the reader; readers after it wait too
    wait_until(lambda: server.layout().waiting_writers == 1, what="writer queued")
    woke = threading.Thread(target=mgr.connect, args=(RequestedLockType.RO,))
    woke.start()
    wait_until(lambda: server.layout().waiting_readers == 1, what="wake queued behind the writer")
    holder.close()
    assert writer.recv()[0].success
    build_layout(writer, sizes=(MiB,))
    assert isinstance(writer.call(m.CommitRequest()), m.CommitResponse)
    woke.join(30)
    assert mgr.granted_lock_type is GrantedLockType.RO
    with pytest.raises(StaleMemoryLayoutError):
        mgr.remap_all_vas()
    assert mgr.is_unmapped
    mgr.close()


def test_the_same_structure_republished_remaps(server):
    """The hash is structural: a rebuild of the same layout is not stale."""
    publish(server.socket, {"t0": PAYLOAD})
    mgr = GMSClientMemoryManager(server.socket)
    mgr.connect(RequestedLockType.RO)
    allocation_id, offset, _ = mgr.metadata_get("t0")
    va = mgr.create_mapping(allocation_id)
    mgr.unmap_all_vas()
    mgr.abort()
    publish(server.socket, {"t0": PAYLOAD[::-1]})  # new ids, new bytes, same structure
    mgr.connect(RequestedLockType.RO)
    mgr.remap_all_vas()
    assert mgr.read(va + offset, len(PAYLOAD)) == PAYLOAD[::-1]
    assert mgr.mappings[0].allocation_id != allocation_id
    mgr.close()


def test_writer_commits_then_reads_back_at_its_own_addresses(server):
    writer = GMSClientMemoryManager(server.socket)
    writer.connect(RequestedLockType.RW_OR_RO)
    assert writer.granted_lock_type is GrantedLockType.RW
    va = writer.create_mapping(size=2 * MiB, tag="weights")
    writer.write(va, PAYLOAD)
    writer.metadata_put("t0", _id_at(writer, va), 0, b"4096")
    writer.commit()
    writer.connect(RequestedLockType.RO)
    writer.remap_all_vas()
    assert writer.granted_lock_type is GrantedLockType.RO
    assert writer.read(va, len(PAYLOAD)) == PAYLOAD
    writer.close()


def test_rw_or_ro_takes_over_after_a_writer_dies(server):
    holder = subprocess.Popen(
        [sys.executable, PROC, "hold-rw", server.socket, "0"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert holder.stdout.readline().strip() == "ready"
    result = {}

    def auto():
        mgr = GMSClientMemoryManager(server.socket)
        mgr.connect(RequestedLockType.RW_OR_RO)
        result["granted"] = mgr.granted_lock_type
        result["mgr"] = mgr

    thread = threading.Thread(target=auto)
    thread.start()
    wait_until(lambda: server.layout().waiting_readers == 1, what="auto client waiting")
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    thread.join(30)
    assert result["granted"] is GrantedLockType.RW
    assert server.layout().allocation_count == 0, "the dead writer's layout was dropped"
    result["mgr"].close()


def test_lock_timeout_raises_and_the_manager_stays_usable(server):
    holder = GMSClientMemoryManager(server.socket)
    holder.connect(RequestedLockType.RW)
    late = GMSClientMemoryManager(server.socket)
    with pytest.raises(LockTimeoutError) as caught:
        late.connect(RequestedLockType.RW, timeout_ms=200)
    assert isinstance(caught.value, TimeoutError)
    assert not late.is_connected and late.granted_lock_type is None
    holder.abort()
    late.connect(RequestedLockType.RW, timeout_ms=5000)
    assert late.granted_lock_type is GrantedLockType.RW
    late.close()
    holder.close()


def test_kv_cache_reallocation_keeps_addresses(start_server):
    kv = start_server()  # the kv_cache tag has a server of its own
    mgr = GMSClientMemoryManager(kv.socket)
    mgr.connect(RequestedLockType.RW)
    vas = [mgr.create_mapping(size=s, tag="kv_cache") for s in (3 * MiB, 1 * MiB, 5 * MiB)]
    for va in vas:
        mgr.write(va, b"kv" * 100)
    mgr.unmap_all_vas()  # sleep: memory released, addresses kept
    mgr.abort()
    wait_until(lambda: kv.layout().state == "EMPTY", what="kv layout dropped")
    mgr.connect(RequestedLockType.RW)  # wake
    mgr.reallocate_all_handles("kv_cache")
    mgr.remap_all_vas()
    assert [mp.va for mp in mgr.mappings] == sorted(vas)
    assert kv.layout().allocation_count == 3
    for va in vas:
        mgr.write(va, b"fresh")
        assert mgr.read(va, 5) == b"fresh"
    mgr.close()


def test_server_errors_raise_with_their_code_and_the_session_goes_on(server):
    mgr = GMSClientMemoryManager(server.socket)
    mgr.connect(RequestedLockType.RW)
    with pytest.raises(GMSServerError) as caught:
        mgr.free_handle("no-such-allocation")
    assert caught.value.code == "UNKNOWN_ALLOCATION"
    va = mgr.create_mapping(size=MiB, tag="weights")
    with pytest.raises(GMSServerError) as caught:
        mgr.metadata_put("k", _id_at(mgr, va), 2 * MiB, b"")
    assert caught.value.code == "OFFSET_OUT_OF_BOUNDS"
    assert mgr.metadata_put("k", _id_at(mgr, va), 0, b"ok")
    assert mgr.metadata_get("k") == (_id_at(mgr, va), 0, b"ok")
    assert mgr.metadata_list() == ["k"] and mgr.metadata_delete("k") and mgr.metadata_get("k") is None
    info = mgr.get_handle_info(_id_at(mgr, va))
    assert (info.size, info.aligned_size, info.tag, info.layout_slot) == (MiB, info.aligned_size, "weights", 0)
    assert [h.allocation_id for h in mgr.list_handles("weights")] == [info.allocation_id]
    assert mgr.list_handles("other") == []
    mgr.close()


def test_tier1_va_operations(server):
    mgr = GMSClientMemoryManager(server.socket)
    mgr.connect(RequestedLockType.RW)
    allocation_id, slot = mgr.allocate_handle(2 * MiB, "weights")
    assert slot == 0
    info = mgr.get_handle_info(allocation_id)
    va = mgr.reserve_va(info.aligned_size)
    fd = mgr.export_handle(allocation_id)
    mgr.map_va(fd, va, info.aligned_size, allocation_id, "weights")
    mgr.write(va, b"tier one")
    mgr.unmap_va(va)
    assert not mgr.mappings[0].mapped
    mgr.remap_all_vas()  # a writer remaps its own live allocation
    assert mgr.read(va, 8) == b"tier one"
    mgr.free_va(va)
    assert mgr.mappings == [] and mgr.total_bytes == 0
    with pytest.raises(GMSUsageError):
        mgr.free_va(va)
    mgr.close()


def test_concurrent_threads_share_one_manager(server):
    mgr = GMSClientMemoryManager(server.socket)
    mgr.connect(RequestedLockType.RW)
    va = mgr.create_mapping(size=4 * MiB, tag="weights")
    allocation_id = _id_at(mgr, va)
    errors = []

    def worker(n: int) -> None:
        try:
            for i in range(150):
                key = f"w{n}.{i}"
                assert mgr.metadata_put(key, allocation_id, n * 1000 + i, b"%d" % i)
                assert mgr.metadata_get(key) == (allocation_id, n * 1000 + i, b"%d" % i)
                if i % 50 == 0:
                    mgr.create_mapping(size=MiB, tag="weights")
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(mgr.metadata_list("w")) == 8 * 150
    assert len(mgr.mappings) == 1 + 8 * 3 == server.layout().allocation_count
    mgr.close()


def test_a_manager_made_in_one_thread_and_used_in_another_reads_its_own_answers(server):
    """Each call reads into its own thread's buffer: a manager made here and
    called from a worker while this thread makes calls of its own never reads
    the other's bytes (CI saw 'expected AllocateResponse, got RevokeResponse')."""
    publish(server.socket, {"t0": PAYLOAD})
    mgr = GMSClientMemoryManager(server.socket)
    mgr.connect(RequestedLockType.RO)
    errors = []

    def worker() -> None:
        try:
            for _ in range(400):
                assert [key for key in mgr.metadata_list("") if key == "t0"] == ["t0"]
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads take turns between any two bytecodes
    try:
        thread = threading.Thread(target=worker)
        thread.start()
        while thread.is_alive():
            assert gms.get_runtime_state(server.socket).layout("weights").committed
        thread.join()
    finally:
        sys.setswitchinterval(switch)
    assert errors == []
    mgr.close()


def _mapped(va: int) -> bool:
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= va < hi:
            return True
    return False


def test_close_and_abort_are_idempotent_and_gc_releases(server, backend):
    publish(server.socket, {"t0": PAYLOAD})
    mgr = GMSClientMemoryManager(server.socket)
    mgr.abort()
    mgr.close()
    mgr.connect(RequestedLockType.RO)
    va = mgr.create_mapping(mgr.metadata_get("t0")[0])
    mgr.abort()
    mgr.abort()
    mgr.close()
    mgr.close()
    with pytest.raises(GMSUsageError):
        mgr.metadata_list()

    dropped = GMSClientMemoryManager(server.socket)
    dropped.connect(RequestedLockType.RO)
    va = dropped.create_mapping(dropped.metadata_get("t0")[0])
    if backend == "host":
        assert _mapped(va)
    assert server.layout().readers == 1
    del dropped
    gc.collect()
    wait_until(lambda: server.layout().readers == 0, what="GC closed the connection")
    if backend == "host":
        assert not _mapped(va), "GC released the reservation"


def test_context_manager_and_probe_helpers(server):
    with GMSClientMemoryManager(server.socket) as mgr:
        mgr.connect(RequestedLockType.RW)
        mgr.create_mapping(size=MiB, tag="weights")
        state = gms.get_runtime_state(server.socket)
        assert isinstance(state, gms.client.probes.RuntimeState)
        assert (state.layout("weights").state, state.layout("weights").allocation_count) == ("RW", 1)
    history = gms.get_event_history(server.socket)
    assert [e.kind for e in history.events] == [
        "SERVER_STARTED", "SESSION_OPENED", "RW_CONNECT", "ALLOCATION_CREATED", "RW_ABORT", "SESSION_CLOSED",
    ]
    assert isinstance(history.events[0], gms.HistoryEvent)


def test_connect_twice_and_writes_without_rw_are_refused(server):
    mgr = GMSClientMemoryManager(server.socket)
    with pytest.raises(GMSUsageError):
        mgr.allocate_handle(MiB)
    mgr.connect(RequestedLockType.RW)
    with pytest.raises(GMSUsageError):
        mgr.connect(RequestedLockType.RW)
    mgr.commit()
    mgr.connect(RequestedLockType.RO)
    with pytest.raises(GMSUsageError):
        mgr.create_mapping(size=MiB)
    with pytest.raises(gms.GMSConnectionError):
        GMSClientMemoryManager(server.socket + ".nope").connect(RequestedLockType.RO)
    mgr.close()


def test_a_restarted_server_makes_the_wake_stale(start_server):
    first = start_server()
    publish(first.socket, {"t0": PAYLOAD})
    mgr = asleep_reader(first.socket)
    assert first.stop() == 0
    second = start_server()
    mgr.socket_path = second.socket
    with pytest.raises(LockTimeoutError):
        mgr.connect(RequestedLockType.RO, timeout_ms=200)  # nothing committed: a reader waits for a commit
    publish(second.socket, {"other": PAYLOAD * 2})
    mgr.connect(RequestedLockType.RO)
    with pytest.raises(StaleMemoryLayoutError):
        mgr.remap_all_vas()
    assert mgr.is_unmapped
    mgr.close()
