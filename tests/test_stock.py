"""Small allocations made ahead of need (gms.server.tiers.memory.Stock)."""

from __future__ import annotations

import os

from gms.cuda import Held
from gms.server.tiers.memory import Stock
from gms.wire import messages as m

from .helpers import MiB, RawConn, ServerProcess, wait_until


def held(size: int, fd: int = -1) -> Held:
    return Held(None, fd, size)


def test_the_stock_keeps_a_few_spares_of_small_sizes_within_its_bound():
    stock = Stock(32 * MiB)  # each size at most a quarter of it, DEPTH spares at most
    assert stock.missing(2 * MiB, pending=0) == Stock.DEPTH == 4
    assert stock.missing(2 * MiB, pending=3) == 1
    assert stock.missing(16 * MiB, pending=0) == 0, "over a quarter of the bound: never stocked"
    assert stock.missing(8 * MiB, pending=0) == 1
    for _ in range(4):
        assert stock.put(held(2 * MiB)) == []
    assert stock.bytes == 8 * MiB and stock.missing(2 * MiB, pending=0) == 0
    assert stock.take(2 * MiB).size == 2 * MiB and stock.take(3 * MiB) is None
    for _ in range(3):
        assert stock.put(held(8 * MiB)) == []  # 6 + 24 MiB
    gone = stock.put(held(8 * MiB))  # 38 MiB would not fit: the least recently asked size gives way
    assert [g.size for g in gone] == [2 * MiB] * 3 and stock.bytes == 32 * MiB
    assert sum(h.size for h in stock.drain()) == 32 * MiB
    assert stock.bytes == 0 and stock.take(8 * MiB) is None


def stock_fds(pid: int) -> int:
    names = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            names.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return sum("gms-stock" in name for name in names)


def test_spares_serve_allocations_and_go_first_when_the_device_is_full(tmp_path):
    server = ServerProcess(tmp_path, "--alloc-stock", "32MiB", "--host-capacity", "64MiB", backend="host")
    try:
        writer = RawConn(server.socket)
        assert writer.call(m.HandshakeRequest("RW", None, "w")).success
        for _ in range(3):
            assert isinstance(writer.call(m.AllocateRequest(2 * MiB)), m.AllocateResponse)
        wait_until(lambda: stock_fds(server.pid) >= 2, what="spares made on the lane")
        state = server.state()
        assert (state.server_handle_count, state.server_handle_bytes) == (3, 6 * MiB), "spares are no allocations"
        # 6 MiB held + up to 8 MiB of spares + 56 MiB > 64 MiB: the spares must give way.
        big = writer.call(m.AllocateRequest(56 * MiB))
        assert isinstance(big, m.AllocateResponse), big  # it fits only once the spares are gone
        assert server.state().server_handle_count == 4
    finally:
        server.kill()


def test_spares_are_no_state_the_keeper_holds_only_allocations_and_they_die_with_the_server(tmp_path):
    """Under a keeper: an allocation taken from the stock is told to the keeper
    as it gets its id (before its event); the spares never are, so a crash
    takes them with the server, and the next one makes its own."""
    import signal

    from gms.client.probes import get_runtime_state

    server = ServerProcess(
        tmp_path, "--alloc-stock", "32MiB", "--host-capacity", "256MiB", backend="host", keeper=True
    )
    try:
        writer = RawConn(server.socket)
        assert writer.call(m.HandshakeRequest("RW", None, "w")).success
        old = server.server_pid()
        for _ in range(5):  # the first made on the lane, the others from the stock made after it
            assert isinstance(writer.call(m.AllocateRequest(2 * MiB)), m.AllocateResponse)
        assert writer.call(m.CommitRequest()).success
        # Spares are made on the lane in the background: on a loaded machine the
        # first ones may come after the last allocation asked for them.
        wait_until(lambda: stock_fds(old) >= 4, what="allocations taken from the stock, and spares")
        wait_until(lambda: memfds(server.pid) == 5, what="the keeper holding the five allocations")
        wait_until(lambda: memfds(old) > 5, what="spares the server keeps to itself")
        os.kill(old, signal.SIGKILL)
        wait_until(lambda: get_runtime_state(server.socket, timeout=30).pid != old, timeout=30, what="a new server")
        assert server.state().server_handle_count == 5 and memfds(server.pid) == 5
    finally:
        server.kill()


def memfds(pid: int) -> int:
    """The gms memfds a process holds (allocations, spares)."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:gms-")
        except OSError:
            pass
    return count
