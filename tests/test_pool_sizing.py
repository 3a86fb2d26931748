"""The self-sizing host pool's count of a build (gms.server.tiers.pool_sizing), on a real core."""

from __future__ import annotations

import os

from gms.cuda.host import HostBackend
from gms.fsm.state import KV_CACHE
from gms.server.assembly import open_core
from gms.server.tiers.pool_sizing import SLICE, PoolSizing
from gms.system.peer import Peer
from gms.wire import messages as m

CHUNK = HostBackend().granularity  # a chunk of the backend's granule: 2-granule allocations hold two


async def test_a_big_build_is_counted_a_slice_per_look_and_scratch_never_counts():
    core = await open_core(HostBackend())
    conn = core.new_conn()
    core.handshake(conn, m.HandshakeRequest("RW", None, "model"), Peer(os.getpid(), os.getuid(), os.getgid()),
                   lambda grant: None)
    count = 2 * SLICE + 88
    for _ in range(count):
        await core.placement.allocate(conn, 2 * CHUNK, "weights")
    sizing = PoolSizing(lambda: core.log.state, cap_bytes=1 << 40)
    looks = [sizing.target(CHUNK) for _ in range(4)]
    # a first count shows what it has counted so far; no look walks more than a slice
    assert looks == [SLICE * 2 * CHUNK, 2 * SLICE * 2 * CHUNK, count * 2 * CHUNK, count * 2 * CHUNK]

    await core.placement.allocate(conn, 4 * CHUNK, KV_CACHE)  # the build grew, by scratch only
    assert [sizing.target(CHUNK) for _ in range(3)] == [count * 2 * CHUNK] * 3, "the last count stands meanwhile"

    await core.placement.allocate(conn, 3 * CHUNK, "weights")
    for _ in range(3):
        sizing.target(CHUNK)
    assert sizing.target(CHUNK) == (count * 2 + 3) * CHUNK
    assert PoolSizing(lambda: core.log.state, cap_bytes=5 * CHUNK + 1).target(CHUNK) == 5 * CHUNK, "capped"

    core.requests.commit(conn, m.CommitRequest(None))
    assert sizing.target(CHUNK) == 0, "nothing builds"


def test_without_a_cap_the_pool_holds_at_most_half_the_hosts_memory():
    half = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    assert half > 0 and PoolSizing(lambda: None).cap_bytes == half
