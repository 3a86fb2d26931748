"""Crash at every step: SIGKILL a real client process at each step of each lock
mode's flow, and check what the seed promises.

For every (lock mode, step) a victim process (``victim.py``) runs to the step
and says so; the test SIGKILLs it and checks:

* the layout's lock state is the seed's: a writer killed before its commit
  is an abort (its layout is dropped); once committed the layout stays; a
  restorer killed mid-restore leaves the layout evicted for the next reader;
  a waiter killed in the queue is never granted anything;
* the next client is granted within 50 ms of the kill (asserted with a
  margin, ``GMS_GRANT_BOUND_MS``; the real figures are recorded);
* the server's memory handles (device and host tier), sessions and open fds
  return to their baseline;
* a fresh reader reads the committed bytes intact, byte for byte, and the
  server's history refolds (pure core) to its live state with no broken
  invariant;
* another layout's committed bytes (the sentinel) are never disturbed.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from gms import GMSClientMemoryManager
from gms.client import admin
from gms.cuda import align_up
from gms.fsm import Allocation, MetadataEntry, compute_layout_hash
from gms.wire import messages as m

from ..helpers import RawConn, ServerProcess, wait_until
from .common import (
    GRANT_BOUND_MS,
    GRANT_TARGET_MS,
    baseline,
    read_line,
    record,
    refold,
    scale,
    server_figures,
    settle,
    spawn,
    summary_ms,
)
from .victim import SIZES, STEPS, build, describe, verify

GRANULARITY = 2 << 20
CAPACITY = 512 << 20
ROUNDS = scale(1, 10)
WRITER_STEPS = ("handshaken", "mid-allocate", "exported-fds", "metadata-put", "host-copy-fill", "commit-partial")
READER_STEPS = ("handshaken", "exported-fds", "reader-mapped")


def applies(lock: str, step: str) -> bool:
    if lock == "RO":
        return step in ("connected", "handshaken", "exported-fds", "reader-mapped", "restoring", "waiting")
    if lock == "RW":
        return step not in ("reader-mapped", "restoring")
    return True


CASES = [(lock, step) for lock in ("RW", "RO", "RW_OR_RO") for step in STEPS if applies(lock, step)]


def plan(lock: str, step: str) -> dict:
    """What the case starts from, who the next client is, and what the seed says."""
    if step == "connected":
        return dict(pre="committed", next="fresh", outcome="stays-p0")
    if step == "restoring":
        return dict(pre="evicted", next="queued", next_lock="RO", outcome="restore")
    if step == "waiting":
        return {
            # a queued writer holds new readers back (writer priority): its death must free them
            "RW": dict(pre="committed", holder="reader", next="queued", next_lock="RO", outcome="stays-p0"),
            # a queued reader behind a building writer: the commit goes to the live reader
            "RO": dict(pre="empty", holder="writer", next="queued", next_lock="RO", outcome="stays-p1"),
            # RW_OR_RO behind a writer that aborts: the live waiter, not the dead one, builds
            "RW_OR_RO": dict(pre="empty", holder="raw-writer", next="queued", next_lock="RW_OR_RO", outcome="abort"),
        }[lock]
    if lock == "RO" or (lock == "RW_OR_RO" and step == "reader-mapped"):
        return dict(pre="committed", next="fresh", outcome="stays-p0")
    if step in WRITER_STEPS:
        return dict(pre="empty", next="queued", next_lock="RW_OR_RO", outcome="abort")
    return dict(pre="empty", next="fresh", outcome="stays-victim")  # commit-sent, committed-mapped


def expected_hash(seed: str, sizes=SIZES) -> str:
    allocations = [
        Allocation(f"a{i}", size, align_up(size, GRANULARITY), "weights", i) for i, size in enumerate(sizes)
    ]
    metadata = [MetadataEntry(f"t{i}", f"a{i}", 0, describe(seed, i, size)) for i, size in enumerate(sizes)]
    return compute_layout_hash(allocations, metadata)


def commit_pattern(server, layout: str, seed: str, residency: str | None = None) -> None:
    with GMSClientMemoryManager(server.socket, layout=layout) as writer:
        writer.connect("RW")
        build(writer, seed)
        writer.commit(residency)


def read_back(server, layout: str) -> int:
    """A fresh reader (restoring the layout if it is evicted) checks every byte."""
    with GMSClientMemoryManager(server.socket, layout=layout) as reader:
        reader.connect("RO", timeout_ms=10_000)
        return verify(reader)


def drop_layout(server, layout: str) -> None:
    conn = RawConn(server.socket)
    assert conn.call(m.HandshakeRequest("RW", 10_000, layout)).success
    conn.close()
    wait_until(lambda: server.layout(layout).state == "EMPTY" and server.state().sessions == 0,
               what=f"layout {layout} dropped")


def victim_conn(server, pid: int, since: int) -> int:
    def find():
        for event in server.events(since):
            if (event.logged_as or event.kind) in ("SESSION_OPENED", "READER_JOINED") and event.fields["pid"] == pid:
                return event.conn
        return None

    return wait_until(find, what=f"the victim (pid {pid}) has a session")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # No copier: a restore here is the client's, whose every step is killed
    # (tests/test_copier.py kills readers waiting on the copier's restores).
    server = ServerProcess(tmp_path_factory.mktemp("crash"), "--host-capacity", str(CAPACITY), "--no-copier")
    commit_pattern(server, "sentinel", "sentinel")
    server.sentinel_hash = server.layout("sentinel").memory_layout_hash
    yield server
    server.kill()


def run_case(server: ServerProcess, lock: str, step: str, n: int) -> float:
    """One kill; returns the kill-to-grant time in seconds."""
    layout = f"{lock.lower()}.{step}.{n}"
    p0, p1, pv = f"{layout}/p0", f"{layout}/p1", f"{layout}/v"
    how = plan(lock, step)
    base = baseline(server)
    since = server.state().last_event_seq
    conns: list[RawConn] = []
    holder = victim = None
    try:
        if how["pre"] == "committed":
            commit_pattern(server, layout, p0)
        elif how["pre"] == "evicted":
            commit_pattern(server, layout, p0, "system")
            assert admin.evict(server.socket, layout).tier == "host"
        if how.get("holder") == "reader":
            holder = RawConn(server.socket)
            assert holder.call(m.HandshakeRequest("RO", None, layout)).granted_lock_type == "RO"
        elif how.get("holder") == "raw-writer":
            holder = RawConn(server.socket)
            assert holder.call(m.HandshakeRequest("RW", None, layout)).granted_lock_type == "RW"
        elif how.get("holder") == "writer":
            holder = GMSClientMemoryManager(server.socket, layout=layout)
            holder.connect("RW")
            build(holder, p1)
        waiting_before = server.state().waiting

        victim = spawn("victim.py", server.socket, layout, lock, step, pv, CAPACITY)
        ready = json.loads(read_line(victim))
        assert ready.get("ready") == step, ready
        # The server is at the step too (a victim can say "ready" before its request lands).
        conn = None
        if step == "connected":
            wait_until(lambda: server_figures(server)["fds"] > base["fds"], what="the victim's connection")
        else:
            if step == "waiting":
                wait_until(lambda: server.state().waiting == waiting_before + 1, what="the victim queued")
            conn = victim_conn(server, victim.pid, since)
            if step == "mid-allocate":
                wait_until(lambda: any(e.kind == "ALLOCATION_OOM_WAIT" and e.conn == conn
                                       for e in server.events(since)), what="the victim's OOM wait")
            elif step == "commit-sent":
                wait_until(lambda: server.layout(layout).committed, what="the victim's commit")

        if how["next"] == "queued":
            nxt = RawConn(server.socket)
            conns.append(nxt)
            nxt.send(m.HandshakeRequest(how["next_lock"], None, layout))
            queued = waiting_before + (step == "waiting") + 1
            wait_until(lambda: server.state().waiting == queued, what="the next client queued")
            assert not nxt.readable(0.05), "the next client must wait for the victim"

        t0 = time.perf_counter()
        os.kill(victim.pid, signal.SIGKILL)
        if how.get("holder") in ("writer", "raw-writer"):
            # Release the lock once the victim is gone (the kernel closes its
            # socket before the parent can reap it): it must not be granted.
            victim.wait(10)
        if how.get("holder") == "writer":
            holder.commit()  # the live queued reader gets the layout
        elif how.get("holder") == "raw-writer":
            holder.close()  # aborts: the live queued RW_OR_RO builds
        if how["next"] == "queued":
            response, _ = nxt.recv(timeout=30)
        else:
            nxt = RawConn(server.socket)
            conns.append(nxt)
            response = nxt.call(m.HandshakeRequest("RO", 30_000, layout), timeout=30)
        granted_after = time.perf_counter() - t0
        victim.wait(10)
        assert response.success, response
        assert response.granted_lock_type == ("RW" if how["outcome"] == "abort" else "RO"), response

        # The lock state is the seed's; every handle the victim held is back.
        live = len(conns) + (how.get("holder") == "reader")
        wait_until(lambda: server.state().sessions == live, what="the victim's session closed")
        row = server.layout(layout)
        events = server.events(since)
        mine = [e.kind for e in events if conn is not None and e.conn == conn]
        gpu, host = base["handles"], base["host_handles"]
        if how["outcome"] == "abort":
            assert (row.state, row.allocation_count, row.memory_layout_hash) == ("RW", 0, ""), row
            if step != "waiting":
                assert "RW_ABORT" in mine, mine
        elif how["outcome"] == "restore":
            assert response.restore and row.tier == "restoring", (response, row)
            assert "RESTORE_ABORTED" in mine, mine
            gpu, host = gpu + len(SIZES), host + len(SIZES)
        else:
            seed = pv if how["outcome"] == "stays-victim" else p1 if how["outcome"] == "stays-p1" else p0
            assert row.committed and row.memory_layout_hash == expected_hash(seed), row
            assert "RW_ABORT" not in mine, mine
            gpu += len(SIZES)
        if step == "waiting":
            granted = {"RW_CONNECT", "RO_CONNECT", "READER_JOINED", "RESTORE_CLAIMED"}
            assert not granted & set(mine), f"the dead waiter was granted: {mine}"
        if step == "mid-allocate":
            gave_up = [e for e in events if e.kind == "ALLOCATION_OOM_GAVE_UP" and e.conn == conn]
            assert gave_up and gave_up[0].fields["reason"] == "disconnect", gave_up
        if step == "commit-partial":
            assert "CONNECTION_DROPPED" in mine, mine
        state = server.state()
        assert (state.server_handle_count, state.host_handle_count) == (gpu, host), (state, gpu, host)

        # The committed bytes, byte for byte, to a fresh reader.
        for conn_ in conns:
            conn_.close()
        if holder is not None:
            holder.close()
            holder = None
        if how["outcome"] == "abort":
            wait_until(lambda: server.state().sessions == 0, what="the next client gone")
            commit_pattern(server, layout, p1)
        assert read_back(server, layout) == len(SIZES)
        assert read_back(server, "sentinel") == len(SIZES)
        assert server.layout("sentinel").memory_layout_hash == server.sentinel_hash

        # Back to the baseline once the layout is dropped.
        drop_layout(server, layout)
        settle(server, base)
        return granted_after
    finally:
        if victim is not None and victim.poll() is None:
            victim.kill()
            victim.wait()
        for conn_ in conns:
            conn_.close()
        if holder is not None:
            holder.close()


@pytest.mark.parametrize("lock,step", CASES, ids=[f"{lock}-{step}" for lock, step in CASES])
def test_sigkill_at_every_step(server, lock, step):
    grants = [run_case(server, lock, step, n) for n in range(ROUNDS)]
    figures = summary_ms(grants)
    record("crash", f"{lock} {step}", kills=len(grants), errors=0,
           over_target=sum(g * 1000 > GRANT_TARGET_MS for g in grants), **figures,
           grants_ms=[round(g * 1000, 3) for g in grants])
    assert figures["max_ms"] < GRANT_BOUND_MS, figures
    refold(server)


def test_crashes_on_several_layouts_at_once_leave_every_other_layout_intact(server):
    """Four victims on four layouts (a writer building, a reader mapped, a
    restorer mid-restore, a writer queued behind a reader) die at once; two
    more layouts, committed, are never touched.  Each layout ends as the seed
    says, every byte of every committed layout is intact, handles and fds
    are back."""
    base = baseline(server)
    names = {k: f"multi.{k}" for k in ("build", "read", "restore", "queued", "quiet1", "quiet2")}
    for key in ("read", "queued", "quiet1", "quiet2"):
        commit_pattern(server, names[key], f"{names[key]}/p0")
    commit_pattern(server, names["restore"], f"{names['restore']}/p0", "system")
    assert admin.evict(server.socket, names["restore"]).tier == "host"
    hashes = {k: server.layout(n).memory_layout_hash for k, n in names.items() if k != "build"}
    holder = RawConn(server.socket)
    assert holder.call(m.HandshakeRequest("RO", None, names["queued"])).success
    plan = [("build", "RW", "metadata-put"), ("read", "RO", "reader-mapped"),
            ("restore", "RO", "restoring"), ("queued", "RW", "waiting")]
    victims = []
    try:
        for key, lock, step in plan:
            victim = spawn("victim.py", server.socket, names[key], lock, step, f"{names[key]}/v", CAPACITY)
            victims.append(victim)
            assert json.loads(read_line(victim)).get("ready") == step
        wait_until(lambda: server.state().waiting == 1, what="the queued writer")
        for victim in victims:
            os.kill(victim.pid, signal.SIGKILL)
        for victim in victims:
            victim.wait(10)
        holder.close()
        wait_until(lambda: server.state().sessions == 0, what="every victim's session gone")
        state = server.state()
        assert state.layout(names["build"]).state == "EMPTY"
        assert state.layout(names["restore"]).tier == "host"
        for key, layout_hash in hashes.items():
            assert state.layout(names[key]).memory_layout_hash == layout_hash, key
            assert read_back(server, names[key]) == len(SIZES), key
        assert read_back(server, "sentinel") == len(SIZES)
        for name in names.values():
            drop_layout(server, name)
        settle(server, base)
        refold(server)
        record("crash", "four layouts at once", kills=len(victims), errors=0,
               layouts_intact=len(hashes) + 1)
    finally:
        for victim in victims:
            if victim.poll() is None:
                victim.kill()
                victim.wait()
        holder.close()
