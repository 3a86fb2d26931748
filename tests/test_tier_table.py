"""Every tier behind one interface (gms.server.tiers.table): what a restart hands
each tier, a tier the node lacks, memory that comes in the wrong shape."""

from __future__ import annotations

import os

import pytest
import trio

from gms.cuda.host import HostBackend
from gms.fsm import MemoryTier
from gms.server.restart.resume import kept_by_tier
from gms.server.tiers.host_memory import HostMemory
from gms.server.tiers.lanes import Lane
from gms.server.tiers.memory import Memory
from gms.server.tiers.table import Absent, Kept, tier_table


def _open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _memfd(size: int) -> int:
    fd = os.memfd_create("gms-test")
    os.ftruncate(fd, size)
    return fd


def test_handed_fds_are_grouped_by_the_tier_and_allocation_the_state_names():
    fds = {name: os.open(os.devnull, os.O_RDONLY) for name in
           ("gpu:a", "host:b/0/4096", "host:b/4096/4096", "host:c", "gpu:gone", "listener", "host:b/x/1")}
    held = {("gpu", "a"): 4096, ("host", "b"): 8192, ("host", "c"): 4096, ("gpu", "none-kept"): 4096}
    kept, unnamed = kept_by_tier(fds, held)
    try:
        assert kept[MemoryTier.GPU] == [Kept("a", 4096, ((None, None, fds["gpu:a"]),)), Kept("none-kept", 4096, ())]
        assert kept[MemoryTier.HOST] == [
            Kept("b", 8192, ((0, 4096, fds["host:b/0/4096"]), (4096, 4096, fds["host:b/4096/4096"]))),
            Kept("c", 4096, ((None, None, fds["host:c"]),)),
        ]
        assert sorted(key for key, _ in unnamed) == ["gpu:gone", "host:b/x/1", "listener"]
    finally:
        for fd in fds.values():
            os.close(fd)


def test_a_tier_the_node_lacks_is_absent_not_missing():
    table = tier_table({MemoryTier.GPU: object()})
    assert list(table) == list(MemoryTier)
    assert isinstance(table[MemoryTier.HOST], Absent) and isinstance(table[MemoryTier.DISK], Absent)
    host = table[MemoryTier.HOST]
    host.release(["x"])  # nothing held: nothing to do
    assert host.held_fds() == [] and host.fd_count() == 0
    fd = os.open(os.devnull, os.O_RDONLY)
    lost = trio.run(host.adopt, [Kept("b", 4096, ((None, None, fd),))])
    assert lost == [("b", "no host tier here")]
    assert not _open(fd), "what a tier it lacks was handed is closed, not leaked"


@pytest.mark.parametrize("table", ["device", "host"])
def test_each_tier_adopts_what_another_server_held_and_loses_what_does_not_fit(table):
    async def main():
        backend = HostBackend(capacity=1 << 30)
        memory = Memory(backend, Lane(table))
        store = memory if table == "device" else HostMemory(memory)
        size = backend.granularity
        whole, split = _memfd(size), [_memfd(size), _memfd(size)]
        kept = [Kept("whole", size, ((None, None, whole),)),
                Kept("split", 2 * size, ((0, size, split[0]), (size, size, split[1])))]
        lost = await store.adopt(kept)
        try:
            if table == "device":  # a GPU allocation is one fd: one in two parts is not one of its own
                assert lost == [("split", "its memory came in 2 parts, not one")]
                assert not any(_open(fd) for fd in split)
                assert [name for name, _ in store.held_fds()] == ["whole"]
            else:  # a host copy may come in chunks, put back together in order
                assert lost == []
                named = sorted(name for name, _ in store.held_fds())
                assert named == [f"split/0/{size}", f"split/{size}/{size}", "whole"]
            assert store.fd_count() == len(store.held_fds())
        finally:
            await store.close()

    trio.run(main)


def test_a_host_copy_whose_chunks_do_not_make_it_up_is_lost_whole():
    async def main():
        backend = HostBackend(capacity=1 << 30)
        store = HostMemory(Memory(backend, Lane("host")))
        size = backend.granularity
        parts = [_memfd(size), _memfd(size)]
        lost = await store.adopt([Kept("gap", 3 * size, ((0, size, parts[0]), (2 * size, size, parts[1])))])
        try:
            assert lost == [("gap", f"its host copy's chunks do not make up its {3 * size} bytes")]
            assert not any(_open(fd) for fd in parts) and store.held_fds() == []
        finally:
            await store.close()

    trio.run(main)
