"""Tenants for real: distinct uids, known to the server only from the kernel's peer credentials.

These run as root: each tenant is a child process with its own uid (a pod, in
production), mapped to a tenant by the operator's policy file.
"""

from __future__ import annotations

import os
import signal

import pytest

import gms
from gms.client.admin import evict, revoke
from gms.wire import messages as m

from .helpers import (
    MiB,
    RawConn,
    ServerProcess,
    build_layout,
    connect_as,
    wait_until,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as other uids")

TEAM_A, TEAM_B, OPS, STRANGER = 24001, 24002, 24003, 24999
POLICY = f"""
[[tenant]]
name = "team-a"
uids = [{TEAM_A}]
quota = "8MiB"
write = ["a-*"]
read = ["shared"]

[[tenant]]
name = "team-b"
uids = [{TEAM_B}]
write = ["b-*", "shared"]

[[tenant]]
name = "ops"
uids = [{OPS}]
quota = 0
admin = true
"""


@pytest.fixture
def tenanted(backend, shared_tmp):
    (shared_tmp / "policy.toml").write_text(POLICY)
    server = ServerProcess(
        shared_tmp, "--policy", str(shared_tmp / "policy.toml"), "--socket-mode", "666", backend=backend
    )
    yield server
    server.kill()


def test_a_uid_with_no_tenant_is_refused_at_handshake(tenanted):
    conn = connect_as(tenanted.socket, STRANGER)
    response = conn.handshake("RO", layout="shared")
    assert response.code == "PERMISSION_DENIED" and f"uid {STRANGER}" in response.error
    (refused,) = [e for e in tenanted.events() if e.kind == "SESSION_REFUSED"]
    assert refused.fields["uid"] == STRANGER
    assert tenanted.state().sessions == 0


def test_a_quota_is_a_typed_error_that_names_the_bytes_and_keeps_the_session(tenanted):
    conn = connect_as(tenanted.socket, TEAM_A)
    assert conn.handshake("RW", layout="a-model").tenant == "team-a"
    assert isinstance(conn.call(m.AllocateRequest(6 * MiB, "w")), m.AllocateResponse)
    refused = conn.call(m.AllocateRequest(4 * MiB, "w"))
    assert (refused.code, refused.scope, refused.used, refused.asked, refused.quota) == (
        "QUOTA_EXCEEDED", "tenant", 6 * MiB, 4 * MiB, 8 * MiB,
    )
    assert isinstance(conn.call(m.AllocateRequest(2 * MiB, "w")), m.AllocateResponse), "the session goes on"
    assert tenanted.state().tenant("team-a").used_bytes == 8 * MiB


def test_a_session_narrows_its_limit_but_never_widens_it(tenanted):
    conn = connect_as(tenanted.socket, TEAM_A)
    wide = conn.handshake("RW", layout="a-kv", limit_bytes=16 * MiB)
    assert wide.code == "INVALID_ARGUMENT" and "never widen" in wide.error
    assert conn.handshake("RW", layout="a-kv", limit_bytes=2 * MiB).success
    conn.call(m.AllocateRequest(2 * MiB, "kv"))
    refused = conn.call(m.AllocateRequest(1, "kv"))
    assert (refused.code, refused.scope, refused.quota) == ("QUOTA_EXCEEDED", "session", 2 * MiB)


def test_a_tenant_cannot_reach_another_tenants_layout(tenanted):
    owner = connect_as(tenanted.socket, TEAM_B)
    owner.handshake("RW", layout="b-model")
    (allocation,) = build_layout(owner, sizes=(2 * MiB,))
    owner.call(m.CommitRequest())

    intruder = connect_as(tenanted.socket, TEAM_A)
    for lock in ("RO", "RW", "RW_OR_RO"):
        response = intruder.handshake(lock, layout="b-model")
        assert response.code == "PERMISSION_DENIED", (lock, response)
    # Its own session covers only its own layout: another layout's ids are unknown there.
    assert intruder.handshake("RW", layout="a-model").success
    for request in (m.ExportAllocationRequest(allocation.allocation_id),
                    m.FreeAllocationRequest(allocation.allocation_id),
                    m.ExportHostCopiesRequest([allocation.allocation_id])):
        intruder.send(request)
        response, fds = intruder.recv()
        assert response.code == "UNKNOWN_ALLOCATION" and fds == []
    assert tenanted.layout("b-model").state == "COMMITTED"


def test_a_reader_only_tenant_gets_ro_for_rw_or_ro_and_sees_only_its_share(tenanted):
    writer = connect_as(tenanted.socket, TEAM_B)
    writer.handshake("RW", layout="shared")
    build_layout(writer, sizes=(2 * MiB,))
    writer.call(m.CommitRequest())
    writer.close()
    reader = connect_as(tenanted.socket, TEAM_A)
    assert reader.handshake("RW_OR_RO", layout="shared").granted_lock_type == "RO"
    view = connect_as(tenanted.socket, TEAM_A).call(m.GetRuntimeStateRequest())
    assert [row.name for row in view.layouts] == ["shared"]  # not b-*: team-a may not read them
    assert [row.name for row in view.tenants] == ["team-a"]
    stranger = connect_as(tenanted.socket, STRANGER).call(m.GetRuntimeStateRequest())
    assert stranger.code == "PERMISSION_DENIED"


def hold_allocations_as(uid: int, path: str, count: int) -> int:
    """A child process of ``uid`` that takes RW and ``count`` allocations, then waits
    to be killed; returns its pid once it holds them all."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the tenant's process
        try:
            os.close(ready_r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            conn = RawConn(path)
            conn.handshake("RW", layout="b-scratch")
            for _ in range(count):
                conn.call(m.AllocateRequest(64 << 10, "scratch"))
            os.write(ready_w, b"x")
            signal.pause()
        finally:
            os._exit(1)
    os.close(ready_w)
    assert os.read(ready_r, 1) == b"x"
    os.close(ready_r)
    return pid


def test_a_crash_frees_the_tenants_bytes_at_once(tenanted):
    pid = hold_allocations_as(TEAM_B, tenanted.socket, 100)
    try:
        state = tenanted.state()
        assert state.layout("b-scratch").allocation_count == 100 and state.tenant("team-b").used_bytes > 0
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    wait_until(lambda: tenanted.state().tenant("team-b").used_bytes == 0, what="the tenant's bytes freed")
    state = tenanted.state()
    assert (state.server_handle_count, state.tenant("team-b").sessions, state.layouts) == (0, 0, [])


def test_admin_verbs_are_for_admins_only(tenanted):
    holder = connect_as(tenanted.socket, TEAM_B)
    holder.handshake("RW", layout="b-kv")
    build_layout(holder, sizes=(2 * MiB,))
    for uid in (TEAM_A, TEAM_B, STRANGER):
        for request in (m.RevokeRequest("b-kv"), m.DeleteRequest("b-kv")):
            response = connect_as(tenanted.socket, uid).call(request)
            assert response.code == "PERMISSION_DENIED", (uid, request)
    assert connect_as(tenanted.socket, OPS).call(m.RevokeRequest("b-kv")).sessions == 1  # a policy admin
    assert holder.closed_by_peer()
    wait_until(lambda: tenanted.state().tenant("team-b").used_bytes == 0, what="the writer's bytes released")
    # Root (this process) is an admin too; the aborted build left no layout.
    assert revoke(tenanted.socket, "b-kv", missing_ok=True) == 0
    with pytest.raises(gms.GMSServerError, match="no layout"):
        evict(tenanted.socket, "b-kv")
