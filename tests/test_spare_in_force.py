"""A restart serves what is in force when it happens, through the spare or not
(issue 48): the policy as its file says then, the code as installed then; and
a spare that does not take the node promptly (stopped, hung) is replaced by a
server started cold."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import gms
from gms.system.procs import gone
from gms.wire import messages as m

from .helpers import MiB, RawConn, ServerProcess, connect_as, wait_until
from .test_restart import killed

TEAM, GONE = 24501, 24502
AS_ROOT = os.geteuid() == 0

POLICY = """
[[tenant]]
name = "team"
uids = [{team}]
write = ["*"]

[[tenant]]
name = "leaver"
uids = [{gone}]
write = ["leaver-*"]
"""


def _commit(conn: RawConn, layout: str) -> m.Response:
    answer = conn.handshake("RW", layout=layout)
    if not answer.success:
        return answer
    allocation = conn.call(m.AllocateRequest(MiB, "w"))
    assert isinstance(allocation, m.AllocateResponse), allocation
    return conn.call(m.CommitRequest())


@pytest.mark.skipif(not AS_ROOT, reason="needs root: clients of other uids")
def test_a_policy_edited_while_a_spare_stood_by_is_the_one_served_after_a_restart(shared_tmp):
    policy = shared_tmp / "policy.toml"
    policy.write_text(POLICY.format(team=TEAM, gone=GONE))
    service = ServerProcess(shared_tmp, "--policy", str(policy), "--socket-mode", "666", "--spare-after", "0.2",
                            keeper=True)
    try:
        spare = service.wait_for_spare()  # it read the policy above
        assert _commit(connect_as(service.socket, GONE), "leaver-a").success
        policy.write_text(POLICY.format(team=TEAM, gone=99999))  # the leaver's uid removed
        assert killed(service) == spare  # the spare takes the node...
        refused = connect_as(service.socket, GONE).handshake("RW", layout="leaver-b")
        assert refused.code == "PERMISSION_DENIED"  # ...and serves the policy as it is now
        assert service.layout("leaver-a").committed  # what the leaver built stays
        assert _commit(connect_as(service.socket, TEAM), "team-a").success
    finally:
        service.kill()


def test_a_spare_whose_code_changed_on_disk_steps_aside_for_a_cold_start(tmp_path):
    service = ServerProcess(tmp_path, "--spare-after", "0.2", keeper=True)
    module = Path(gms.__file__).with_name("units.py")  # loaded by every server
    before = os.stat(module)
    try:
        publisher = gms.GMSClientMemoryManager(service.socket, layout="weights")
        publisher.connect(gms.RequestedLockType.RW)
        allocation_id, _ = publisher.allocate_handle(MiB, tag="w")
        publisher.commit()
        spare = service.wait_for_spare()
        os.utime(module, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))  # "upgraded" since the spare started
        new = killed(service)
        assert new != spare, "the spare must not serve code that is not gms's on disk now"
        wait_until(lambda: gone(spare), timeout=10,
                   what="the stale spare gone")
        assert service.layout("weights").committed
        assert "stepping aside" in service.log or "code in force" in service.log
    finally:
        os.utime(module, ns=(before.st_atime_ns, before.st_mtime_ns))
        service.kill()


def test_a_stopped_spare_is_replaced_by_a_cold_start(tmp_path):
    service = ServerProcess(tmp_path, "--spare-after", "0.2", keeper=True)
    try:
        publisher = gms.GMSClientMemoryManager(service.socket, layout="weights")
        publisher.connect(gms.RequestedLockType.RW)
        publisher.allocate_handle(MiB, tag="w")
        publisher.commit()
        spare = service.wait_for_spare()
        os.kill(spare, signal.SIGSTOP)  # stopped after its hello
        started = time.monotonic()
        new = killed(service)
        took = time.monotonic() - started
        assert new != spare and took < 15, f"served again by pid {new} after {took:.1f} s"
        assert service.layout("weights").committed
        wait_until(lambda: gone(spare), timeout=10,
                   what="the stopped spare killed")
    finally:
        service.kill()


async def test_a_spare_handed_the_node_that_stops_or_never_takes_it_is_killed(monkeypatch):
    """The keeper's watch over a spare it handed the node (gms.keeper.spare):
    stopped for STOPPED_S, or silent for SPARE_TAKE_S, it is killed; one that
    took it and serves is left alone."""
    import trio

    from gms.keeper import spare as spares

    monkeypatch.setattr(spares, "SPARE_TAKE_S", 0.5)

    async def watched(stop: bool, took: bool, serves: bool) -> tuple[bool, float]:
        proc = await trio.lowlevel.open_process(["sleep", "30"])
        one = spares.Spare(proc, None)
        served = trio.Event()
        if took:
            one.took.set()
        if serves:
            served.set()
        if stop:
            os.kill(proc.pid, signal.SIGSTOP)
        start = trio.current_time()
        with trio.move_on_after(1.5):
            await one.watch_taking(served)
        took_s = trio.current_time() - start
        proc.kill()
        await proc.wait()
        return one.stalled, took_s

    stalled, seconds = await watched(stop=True, took=True, serves=False)
    assert stalled and spares.STOPPED_S <= seconds < 1.0
    stalled, seconds = await watched(stop=False, took=False, serves=False)
    assert stalled and 0.5 <= seconds < 1.0
    stalled, _ = await watched(stop=False, took=True, serves=False)  # taking, not stopped: rebuilding
    assert not stalled
    stalled, seconds = await watched(stop=True, took=True, serves=True)  # it serves: nothing to watch
    assert not stalled and seconds < 0.1
