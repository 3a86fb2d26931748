"""Two sessions across every await: a server in this process whose memory calls
block until the test lets them go.

The model-based machines step one request at a time; these tests hold a
request inside the server's await (its memory being made on the lane) while
another session acts, which is how races get through.  Each test is one of
the interleavings the issue behind them named: two writers racing for the
last of the host budget (it was overshot), for the last of the GPU budget,
and a writer revoked while its memory is being made.  Every backend call is
also checked to run on a lane, never on the event loop.
"""

from __future__ import annotations

import threading

import pytest
import trio

from gms.cuda.host import HostBackend
from gms.fsm import check_invariants
from gms.server import Server, ServerConfig
from gms.units import parse_budget
from gms.wire import messages as m

from .helpers import MiB, RawConn


class GatedBackend:
    """A backend whose calls can be held at a gate, and which notes the thread of each call."""

    def __init__(self, inner: HostBackend) -> None:
        self.inner = inner
        self.name, self.device, self.granularity = inner.name, inner.device, inner.granularity
        self.loop_bytes = 0  # its calls wait at a gate: never on the loop
        self.gates = {"create": threading.Event(), "release": threading.Event()}
        for gate in self.gates.values():
            gate.set()
        self.arrived = {"create": 0, "release": 0}
        self.threads: set[str] = set()
        self._changed = threading.Condition()

    def _pass(self, name: str) -> None:
        self.threads.add(threading.current_thread().name)
        with self._changed:
            self.arrived[name] += 1
            self._changed.notify_all()
        self.gates[name].wait()

    def hold(self, name: str) -> None:
        self.gates[name].clear()

    def let_go(self, name: str) -> None:
        self.gates[name].set()

    def wait_arrived(self, name: str, count: int) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: self.arrived[name] >= count, timeout=10), self.arrived

    def create(self, aligned_size, label=""):
        self._pass("create")
        return self.inner.create(aligned_size, label)

    def release(self, held):
        self._pass("release")
        return self.inner.release(held)

    def device_info(self):
        self.threads.add(threading.current_thread().name)
        return self.inner.device_info()

    def close(self):
        self.inner.close()


async def serving(nursery, tmp_path, *args: str, host_budget: str | None = None, budget: str | None = None):
    gpu, host = GatedBackend(HostBackend(capacity=64 * MiB)), GatedBackend(HostBackend())
    config = ServerConfig(
        socket_path=str(tmp_path / "gms.sock"), backend="host", gpu_budget=budget, host_budget=host_budget,
        alloc_retry_timeout=None, alloc_stock_bytes=0,  # every create at the gate is a request's
    )
    server = Server(config, backend=gpu, host_tier=host)
    await nursery.start(server.serve)
    return server, gpu, host


async def call(conn: RawConn, request):
    conn.send(request)
    return await recv(conn)


async def recv(conn: RawConn):
    response, fds = await trio.to_thread.run_sync(conn.recv, 10.0)
    for fd in fds:
        __import__("os").close(fd)
    return response


async def writer_with(path: str, layout: str, *sizes: int) -> tuple[RawConn, list[str]]:
    conn = RawConn(path)
    assert (await call(conn, m.HandshakeRequest("RW", None, layout))).success
    ids = [(await call(conn, m.AllocateRequest(size))).allocation_id for size in sizes]
    return conn, ids


async def until(predicate, what: str) -> None:
    with trio.fail_after(10):
        while not predicate():
            await trio.sleep(0.005)


async def test_two_writers_cannot_both_take_the_last_of_the_host_budget(tmp_path):
    """Both ask for a 2 MiB host copy under a 3 MiB host budget; the first one's copy
    is being pinned (held at the gate) when the second's request is decided.
    Before the fold held the budget, both passed the check, the budget was
    overshot and a replay failed; then the second was made too and refused when
    recorded.  Now memory in the making counts against the budget (the host
    tier's physical total, gms/server/tiers/host_memory.py): the second is refused at
    once, before any memory is pinned for it."""
    async with trio.open_nursery() as nursery:
        server, gpu, host = await serving(nursery, tmp_path, host_budget="3MiB")
        path = server.config.socket_path
        a, (a_id,) = await writer_with(path, "a", 2 * MiB)
        b, (b_id,) = await writer_with(path, "b", 2 * MiB)
        host.hold("create")
        a.send(m.ExportHostCopiesRequest([a_id]))
        await trio.to_thread.run_sync(host.wait_arrived, "create", 1)
        refused = await call(b, m.ExportHostCopiesRequest([b_id]))
        assert isinstance(refused, m.ErrorResponse) and refused.code == "HOST_MEMORY_EXHAUSTED", refused
        assert host.arrived["create"] == 1, "nothing was pinned for the loser"
        host.let_go("create")
        assert isinstance(await recv(a), m.ExportHostCopiesResponse)
        state = server.core.state
        check_invariants(state)
        assert state.host_bytes == 2 * MiB <= parse_budget("3MiB", None)
        assert server.core.host_tier.host.live() == (1, 2 * MiB)
        assert server.core.log.replay() == state
        nursery.cancel_scope.cancel()


async def test_the_last_of_the_gpu_budget_goes_to_one_writer_and_the_other_waits_for_it(tmp_path):
    """Two 4 MiB allocations under a 4 MiB budget, both decided before either's
    memory exists: whichever resumes second is decided again after its await,
    finds the room gone, gives its memory back and waits; the winner's abort
    wakes it (Trio picks the order: either may win)."""
    async with trio.open_nursery() as nursery:
        server, gpu, _ = await serving(nursery, tmp_path, budget="4MiB")
        path = server.config.socket_path
        a, _ = await writer_with(path, "a")
        b, _ = await writer_with(path, "b")
        gpu.hold("create")
        a.send(m.AllocateRequest(4 * MiB))
        await trio.to_thread.run_sync(gpu.wait_arrived, "create", 1)
        b.send(m.AllocateRequest(4 * MiB))
        await until(lambda: server.core.placement.gpu.lane._jobs.qsize() == 1, "b's memory queued")
        gpu.let_go("create")
        await until(
            lambda: any(e.event.KIND == "ALLOCATION_OOM_WAIT" for e in server.core.log.entries()), "one waiting"
        )
        (created,) = [e.event for e in server.core.log.entries() if e.event.KIND == "ALLOCATION_CREATED"]
        winner, loser = (a, b) if created.layout == "a" else (b, a)
        assert isinstance(await recv(winner), m.AllocateResponse)
        check_invariants(server.core.state)
        assert server.core.state.gpu_bytes == 4 * MiB
        await until(lambda: server.core.placement.gpu.live() == (1, 4 * MiB), "the loser's first memory back")
        winner.sock.close()  # RW_ABORT: the winner's memory is released, and the loser is woken
        with trio.fail_after(2):
            answer = await recv(loser)
        assert isinstance(answer, m.AllocateResponse), answer
        check_invariants(server.core.state)
        assert server.core.log.replay() == server.core.state
        nursery.cancel_scope.cancel()


async def test_a_writer_revoked_while_its_memory_is_made_gets_nothing_and_leaks_nothing(tmp_path):
    async with trio.open_nursery() as nursery:
        server, gpu, _ = await serving(nursery, tmp_path)
        path = server.config.socket_path
        writer, _ = await writer_with(path, "w")
        gpu.hold("create")
        writer.send(m.AllocateRequest(2 * MiB))
        await trio.to_thread.run_sync(gpu.wait_arrived, "create", 1)
        revoked = await call(RawConn(path), m.RevokeRequest("w"))
        assert revoked.sessions == 1
        gpu.let_go("create")
        assert await trio.to_thread.run_sync(writer.closed_by_peer), "the revoked writer's connection ends"
        await until(lambda: server.core.placement.gpu.live() == (0, 0), "the made memory released")
        state = server.core.state
        check_invariants(state)
        assert "w" not in state.layouts and not state.sessions
        assert not any(e.event.KIND == "ALLOCATION_CREATED" for e in server.core.log.entries())
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("release_held", [False, True])
async def test_every_memory_call_runs_on_a_lane_and_never_blocks_the_loop(tmp_path, release_held):
    """While a release is held on the GPU lane (as ``cuMemRelease`` of a large
    layout would take time), other sessions are still served."""
    async with trio.open_nursery() as nursery:
        server, gpu, host = await serving(nursery, tmp_path)
        path = server.config.socket_path
        writer, _ = await writer_with(path, "w", 2 * MiB, 2 * MiB)
        assert isinstance(await call(writer, m.ExportHostCopiesRequest([])), m.ExportHostCopiesResponse)
        if release_held:
            gpu.hold("release")
        writer.sock.close()  # RW_ABORT: two releases go to the lane
        other = RawConn(path)
        with trio.fail_after(5):
            assert (await call(other, m.HandshakeRequest("RW", None, "x"))).success
            assert isinstance(await call(other, m.MetadataListRequest()), m.MetadataListResponse)
        gpu.let_go("release")
        await until(lambda: server.core.placement.gpu.live() == (0, 0), "released")
        calls = gpu.threads | host.threads
        assert calls and all(name.startswith("gms-lane-") for name in calls), calls
        nursery.cancel_scope.cancel()


class NotingBackend(HostBackend):
    """The host backend, noting which thread made or freed what size; a
    release of more than 4 MiB waits at ``gate``."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.calls: list[tuple[str, int, str]] = []
        self.gate = threading.Event()
        self.gate.set()

    def create(self, aligned_size, label=""):
        self.calls.append(("create", aligned_size, threading.current_thread().name))
        return super().create(aligned_size, label)

    def release(self, held):
        self.calls.append(("release", held.size, threading.current_thread().name))
        if held.size > 4 * MiB:
            self.gate.wait(10)
        return super().release(held)


async def test_small_memfds_are_made_and_freed_on_the_loop_and_the_rest_on_the_lane(tmp_path):
    """The host backend's exception to the lanes (``loop_bytes``): a 2 MiB
    allocation is made and freed on the loop, an 8 MiB one on the lane; a
    small one the loop finds no room for is made on the lane, behind the
    release queued there that makes the room (a capacity of 12 MiB)."""
    gpu = NotingBackend(capacity=12 * MiB)
    config = ServerConfig(socket_path=str(tmp_path / "gms.sock"), backend="host", alloc_stock_bytes=0)
    server = Server(config, backend=gpu, host_tier=HostBackend())
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        writer, (small, big) = await writer_with(config.socket_path, "w", 2 * MiB, 8 * MiB)
        gpu.gate.clear()  # the 8 MiB release waits on the lane
        assert (await call(writer, m.FreeAllocationRequest(big))).success
        await until(lambda: len(gpu.calls) == 3, "the release at its gate")
        writer.send(m.AllocateRequest(4 * MiB))  # 2 + 8 + 4 > 12 until the release ran
        await until(lambda: len(gpu.calls) == 4, "the loop's attempt")
        gpu.gate.set()
        assert isinstance(await recv(writer), m.AllocateResponse)
        assert (await call(writer, m.FreeAllocationRequest(small))).success
        loop = threading.current_thread().name
        assert [(kind, size >> 20, name == loop) for kind, size, name in gpu.calls] == [
            ("create", 2, True), ("create", 8, False), ("release", 8, False),
            ("create", 4, True), ("create", 4, False), ("release", 2, True),
        ], gpu.calls
        nursery.cancel_scope.cancel()
