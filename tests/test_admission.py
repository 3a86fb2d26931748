"""What a connection may cost the server before and after it is a session:
admission (a cap per uid, the fd budget and its reserve for admins), the first
request's deadline and size, memory refused for want of fds, exports lent
from the budget; and the bounded bookkeeping around them (per-layout metrics
series, rate-limited log lines).  The attacks themselves, by real uids
with a victim's figures, are tests/reliability/test_isolation.py.
"""

from __future__ import annotations

import logging
import os
import socket
import time

import pytest
import trio

from gms.cuda.host import HostBackend
from gms.fsm import OverLimit
from gms.operator.policy import OPEN_POLICY, parse_policy
from gms.server import Server, ServerConfig
from gms.server.edge.admission import Admission, FdBudget, FdsExhausted, refusal_frame
from gms.server.edge.ratelimit import RateLimit
from gms.system.peer import Peer
from gms.wire import FrameDecoder, decode, encode
from gms.wire import messages as m
from gms.wire.connection import PRE_SESSION_MAX_FRAME_BYTES

from .helpers import MiB, RawConn, dropped

POLICY = parse_policy(
    """
[[tenant]]
name = "a"
uids = [1001]
write = ["*"]

[[tenant]]
name = "ops"
uids = [1500]
admin = true
"""
)


# -- admission, without sockets ------------------------------------------------------------


def test_a_uid_is_held_to_its_connections_and_admins_are_not():
    admission = Admission(POLICY, server_uid=999, fds=FdBudget(10_000, 100, 10), max_connections_per_uid=2)
    tenant, stranger = Peer(1, 1001, 1001), Peer(2, 4242, 4242)
    tickets = [admission.admit(tenant), admission.admit(tenant), admission.admit(stranger)]
    with pytest.raises(OverLimit) as caught:
        admission.admit(tenant)
    over = caught.value
    assert (over.code, over.limit, over.scope, over.used, over.asked, over.bound) == (
        "LIMIT_EXCEEDED", "max_connections_per_uid", "uid", 2, 1, 2,
    )
    assert "uid 1001" in over.message
    for admin in (Peer(3, 0, 0), Peer(4, 999, 999), Peer(5, 1500, 1500)):  # root, the server's uid, a policy admin
        for _ in range(5):
            tickets.append(admission.admit(admin))
    admission.leave(tickets[0])
    admission.admit(tenant)  # room again
    assert admission.fds.connections == len(tickets)


def test_the_fd_budget_keeps_a_reserve_for_admins():
    budget = FdBudget(limit=100, reserve=20, base=70)
    admission = Admission(OPEN_POLICY, server_uid=999, fds=budget, max_connections_per_uid=None)
    for _ in range(10):
        admission.admit(Peer(1, 1000, 1000))
    assert budget.used() == 80
    with pytest.raises(FdsExhausted) as caught:
        admission.admit(Peer(1, 1000, 1000))
    assert (caught.value.code, caught.value.limit, caught.value.used, caught.value.bound) == (
        "RESOURCE_EXHAUSTED", "fds", 80, 80,
    )
    for _ in range(15):  # the reserve is the admins'
        admission.admit(Peer(2, 0, 0))
    assert budget.used() == 95


def test_memory_takes_three_quarters_of_the_budget_and_exports_borrow_the_rest():
    held = [0]
    budget = FdBudget(limit=1000, reserve=200, base=0, memory=lambda: held[0])
    assert budget.memory_budget == 600
    held[0] = 599
    budget.check_memory(1)
    with pytest.raises(FdsExhausted) as caught:
        budget.check_memory(2)
    assert (caught.value.used, caught.value.asked, caught.value.bound) == (599, 2, 600)
    budget.lend(150)  # an export's dups, until its reply is sent
    with pytest.raises(FdsExhausted):
        budget.lend(52)
    budget.returned(150)
    budget.lend(201)
    assert budget.used() == 800


def test_a_refusal_frame_carries_the_figures():
    over = OverLimit("max_connections_per_uid", "uid", 3, 1, 3, "uid 7 already has 3 connections")
    decoder = FrameDecoder()
    decoder.feed(refusal_frame(over))
    message = decode(decoder.next_frame())
    assert (message.code, message.limit, message.scope, message.used, message.asked, message.quota) == (
        "LIMIT_EXCEEDED", "max_connections_per_uid", "uid", 3, 1, 3,
    )


# -- a server in this process ----------------------------------------------------------------


async def serving(nursery, tmp_path, **options) -> Server:
    config = ServerConfig(socket_path=str(tmp_path / "gms.sock"), backend="host", **options)
    server = Server(config, backend=HostBackend(capacity=1 << 30), host_tier=HostBackend())
    await nursery.start(server.serve)
    return server


async def call(conn: RawConn, request, timeout: float = 10.0):
    return await trio.to_thread.run_sync(conn.call, request, timeout)


async def test_a_connection_that_sends_nothing_is_closed_at_the_deadline(tmp_path):
    async with trio.open_nursery() as nursery:
        server = await serving(nursery, tmp_path, handshake_timeout=0.3)
        path = server.config.socket_path
        idle, late, prompt = RawConn(path), RawConn(path), RawConn(path)
        late.send_raw(encode(m.HandshakeRequest("RO", 0, "w"))[:5])  # half a frame is not a request
        assert (await call(prompt, m.HandshakeRequest("RW", None, "w"))).success
        started = time.monotonic()
        assert await trio.to_thread.run_sync(idle.closed_by_peer, 5.0)
        assert await trio.to_thread.run_sync(late.closed_by_peer, 5.0)
        assert 0.2 < time.monotonic() - started < 3
        await trio.sleep(0.4)
        assert isinstance(await call(prompt, m.AllocateRequest(MiB)), m.AllocateResponse), "a session has no deadline"
        assert server.metrics.refused.labels("handshake_timeout")._value.get() == 2
        assert not server.core.state.sessions.get(2) and len(server.core.state.sessions) == 1
        nursery.cancel_scope.cancel()


async def test_before_a_handshake_frames_are_small(tmp_path):
    async with trio.open_nursery() as nursery:
        server = await serving(nursery, tmp_path)
        path = server.config.socket_path
        big = m.MetadataListRequest("p" * PRE_SESSION_MAX_FRAME_BYTES)
        stranger = RawConn(path)
        stranger.send(big)
        assert await trio.to_thread.run_sync(dropped, stranger), "dropped before any session"
        drops = [e.event for e in server.core.log.entries() if e.event.KIND == "CONNECTION_DROPPED"]
        assert f"exceeds {PRE_SESSION_MAX_FRAME_BYTES}" in drops[-1].reason
        session = RawConn(path)
        assert (await call(session, m.HandshakeRequest("RW", None, "w"))).success
        assert (await call(session, big)).keys == [], "after the handshake the server's cap applies"
        nursery.cancel_scope.cancel()


async def test_a_uid_buffers_big_frames_a_few_at_a_time(tmp_path):
    """Past 128 KiB a connection reads on only with one of its uid's two slots:
    a third half-sent big frame is not read (its client's send blocks) until a
    holder's frame is whole and served."""
    import threading

    async with trio.open_nursery() as nursery:
        server = await serving(nursery, tmp_path)
        path = server.config.socket_path
        conns = [RawConn(path) for _ in range(3)]
        for n, conn in enumerate(conns):
            assert (await call(conn, m.HandshakeRequest("RW", None, f"big-{n}"))).success
        frames = [encode(m.MetadataListRequest("p" * (8 * MiB))) for _ in conns]
        half = len(frames[0]) // 2
        for conn, frame in zip(conns[:2], frames):  # sent from threads: the server runs on this one
            await trio.to_thread.run_sync(conn.send_raw, frame[:half])
        inflight = server.core.inflight
        await until(lambda: inflight.holders(os.getuid()) == 2, "two slots held")
        third_sent = threading.Event()

        def send_third() -> None:
            conns[2].send_raw(frames[2][:half])
            third_sent.set()

        threading.Thread(target=send_third, daemon=True).start()
        await trio.sleep(0.5)
        assert not third_sent.is_set(), "the third big frame waits for a slot"
        await trio.to_thread.run_sync(conns[0].send_raw, frames[0][half:])  # whole: served, its slot let go
        assert (await trio.to_thread.run_sync(conns[0].recv, 10.0))[0].keys == []
        await until(third_sent.is_set, "the third read on")
        for conn, frame in zip(conns[1:], frames[1:]):
            await trio.to_thread.run_sync(conn.send_raw, frame[half:])
            assert (await trio.to_thread.run_sync(conn.recv, 10.0))[0].keys == []
        await until(lambda: inflight.holders(os.getuid()) == 0, "every slot back")
        nursery.cancel_scope.cancel()


async def test_big_answers_a_client_does_not_read_are_encoded_a_few_at_a_time(tmp_path):
    async with trio.open_nursery() as nursery:
        server = await serving(nursery, tmp_path)
        path = server.config.socket_path
        writer = RawConn(path)
        assert (await call(writer, m.HandshakeRequest("RW", None, "meta"))).success
        allocation = (await call(writer, m.AllocateRequest(MiB))).allocation_id
        for n in range(4):
            assert (await call(writer, m.MetadataPutRequest(f"k{n}", allocation, 0, b"v" * MiB))).success
        assert (await call(writer, m.CommitRequest())).success
        readers = [RawConn(path) for _ in range(5)]
        for reader in readers:
            assert (await call(reader, m.HandshakeRequest("RO", None, "meta"))).success
            reader.send(m.MetadataScanRequest(""))  # 4 MiB answers, not read yet
        inflight = server.core.inflight
        await until(lambda: inflight.holders(os.getuid()) == 2, "two answers being sent")
        await trio.sleep(0.3)
        assert inflight.holders(os.getuid()) == 2, "the other three wait, unencoded"
        for reader in readers:
            response, _ = await trio.to_thread.run_sync(reader.recv, 10.0)
            assert len(response.values) == 4 and response.values[3] == b"v" * MiB
        await until(lambda: inflight.holders(os.getuid()) == 0, "every slot back")
        nursery.cancel_scope.cancel()


async def until(predicate, what: str) -> None:
    with trio.fail_after(10):
        while not predicate():
            await trio.sleep(0.01)


async def test_memory_past_the_fd_budget_is_refused_at_once_and_exports_give_fds_back(tmp_path):
    async with trio.open_nursery() as nursery:
        server = await serving(nursery, tmp_path, alloc_retry_timeout=None)
        fds = server.core.fds
        writer = RawConn(server.config.socket_path)
        assert (await call(writer, m.HandshakeRequest("RW", None, "w"))).success
        ids = [(await call(writer, m.AllocateRequest(MiB))).allocation_id for _ in range(3)]
        fds.limit = fds.reserve + fds.used() + 1  # room for one more fd
        assert isinstance(await call(writer, m.AllocateRequest(MiB)), m.AllocateResponse)
        started = time.monotonic()
        refused = await call(writer, m.AllocateRequest(MiB))
        assert time.monotonic() - started < 1, "at once: no wait for memory"
        assert (refused.code, refused.limit, refused.scope, refused.asked) == ("RESOURCE_EXHAUSTED", "fds", "node", 1)
        assert refused.used == refused.quota == fds.used(), refused
        assert not any(e.event.KIND == "ALLOCATION_OOM_WAIT" for e in server.core.log.entries())
        fds.limit = 1 << 20
        for _ in range(20):
            writer.send(m.ExportAllocationsRequest(ids))
            _, got = await trio.to_thread.run_sync(writer.recv, 10.0)
            for fd in got:
                os.close(fd)
        await trio.sleep(0.05)
        assert fds.lent == 0, "every lent fd given back once its reply went out"
        nursery.cancel_scope.cancel()


async def test_a_layouts_metrics_series_go_with_the_layout(tmp_path):
    async with trio.open_nursery() as nursery:
        server = await serving(nursery, tmp_path)
        path = server.config.socket_path
        for n in range(20):
            writer = RawConn(path)
            assert (await call(writer, m.HandshakeRequest("RW", None, f"l{n}"))).success
            assert (await call(writer, m.CommitRequest("unpinned"))).success
            writer.close()
        assert server.metrics.series() == 20
        for n in range(19):
            assert (await call(RawConn(path), m.EvictRequest(f"l{n}"))).tier == "none"
        assert server.metrics.series() == 1
        families = {f.name: f for f in server.metrics.registry.collect()}
        labels = {s.labels["layout"] for s in families["gms_layout_transitions"].samples}
        assert labels == {"l19"}
        nursery.cancel_scope.cancel()


# -- log lines -------------------------------------------------------------------------


def test_repeated_lines_pass_once_an_interval_and_a_summary_counts_the_rest(caplog):
    now = [0.0]
    limit = RateLimit(interval=10, clock=lambda: now[0])
    logger = logging.getLogger("gms.test.ratelimit")
    logger.addFilter(limit)
    try:
        with caplog.at_level(logging.INFO, logger="gms.test.ratelimit"):
            for n in range(500):
                logger.info("conn %d dropped: %s", n, "bad frame")
                logger.info("other %d", n)
            assert [r.getMessage() for r in caplog.records] == ["conn 0 dropped: bad frame", "other 0"]
            now[0] = 11
            assert limit.flush() == 2
            summaries = [r.getMessage() for r in caplog.records[2:]]
            assert summaries[0] == "499 more like this in the last 11 s, the last: conn 499 dropped: bad frame"
            logger.info("conn %d dropped: %s", 500, "bad frame")  # a new interval: it passes
            assert caplog.records[-1].getMessage() == "conn 500 dropped: bad frame"
            now[0] = 12
            logger.info("conn %d dropped: %s", 501, "bad frame")
            now[0] = 30
            logger.info("conn %d dropped: %s", 502, "bad frame")
            assert caplog.records[-1].getMessage().endswith("[and 1 more like this in the last 19 s]")
    finally:
        logger.removeFilter(limit)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")
async def test_a_refused_client_gets_a_typed_error_naming_the_limit(shared_tmp):
    from gms import GMSClientMemoryManager, LimitExceededError, get_runtime_state

    from .reliability.tenants import AsUid

    def as_stranger(path: str) -> dict:
        held = [socket.socket(socket.AF_UNIX) for _ in range(2)]
        for sock in held:
            sock.connect(path)
        found = {}
        for name, attempt in (
            ("probe", lambda: get_runtime_state(path, timeout=5)),
            ("connect", lambda: GMSClientMemoryManager(path, layout="w").connect("RO", timeout_ms=1000)),
        ):
            try:
                attempt()
            except LimitExceededError as exc:
                found[name] = [exc.code, exc.limit, exc.scope, exc.used, exc.asked, exc.bound]
        return found

    async with trio.open_nursery() as nursery:
        server = await serving(nursery, shared_tmp, socket_mode=0o666, max_connections_per_uid=2)
        child = AsUid(4243, as_stranger, server.config.socket_path)
        child.go()
        found = await trio.to_thread.run_sync(child.result, 30)
        expected = ["LIMIT_EXCEEDED", "max_connections_per_uid", "uid", 2, 1, 2]
        assert found == {"probe": expected, "connect": expected}
        nursery.cancel_scope.cancel()


def test_the_scan_cache_stays_within_its_bytes():
    from gms.fsm.state import LayoutState
    from gms.server.service.requests import ScanCache

    cache = ScanCache(max_bytes=1 * MiB)
    for n in range(200):
        layout = LayoutState(f"l{n % 7}")
        response = m.MetadataScanResponse([f"k{n}"], ["a"], [0], [b"v" * (64 << 10)])
        cache.put(layout, f"p{n}", response)
        assert cache.bytes <= cache.max_bytes
    assert 10 <= len(cache._entries) <= 16
    cache.put(LayoutState("big"), "", m.MetadataScanResponse(["k"], ["a"], [0], [b"v" * (2 * MiB)]))
    assert cache.get(LayoutState("big"), "") is None, "an answer bigger than the cache is not kept"


async def test_copies_through_the_copier_give_back_the_fds_they_lend(tmp_path):
    """A publish and a restore through the copier export the writer's device
    allocations to it: lent from the fd budget until the link sent them, then
    given back (else every copy would shrink the budget for good)."""
    async with trio.open_nursery() as nursery:
        server = await serving(nursery, tmp_path, host_pool_bytes=4 * MiB, host_chunk_bytes=2 * MiB)
        path = server.config.socket_path
        with trio.fail_after(60):
            while server.core.copier.state != "running":
                await trio.sleep(0.05)
        writer = RawConn(path)
        assert (await call(writer, m.HandshakeRequest("RW", None, "m"))).success
        for _ in range(2):
            assert isinstance(await call(writer, m.AllocateRequest(3 * MiB)), m.AllocateResponse)
        assert (await call(writer, m.CommitRequest("system"))).success, "host copies by the copier"
        assert (await call(RawConn(path), m.EvictRequest("m"))).tier == "host"
        reader = RawConn(path)
        granted = await call(reader, m.HandshakeRequest("RO", None, "m"))
        assert (granted.success, granted.restore) == (True, False), "restored by the copier"
        await until(lambda: server.core.fds.lent == 0, "every fd lent to the copier given back")
        host = server.core.host_tier.host
        assert host.fd_count() == len(host.held_fds()) + host.book.pooled, "a chunk, an fd"
        nursery.cancel_scope.cancel()
