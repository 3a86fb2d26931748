"""Security: who can reach the socket, who is let in, the caps, no code from
data, and no fd outside the layout a lock covers.

Identities are real: as root the suite forks a child, drops it to an unused
uid (setgid/setuid), lets it connect, and takes the socket back, so the
server sees that uid in SO_PEERCRED.  Those tests skip when not run as root.
"""

from __future__ import annotations

import ast
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gms import GMSClientMemoryManager
from gms.client import admin
from gms.errors import GMSServerError, RequestTooLargeError
from gms.wire import messages as m

from ..helpers import RawConn, ServerProcess, dropped, kill_tree, wait_until
from .common import connect_as, is_root, open_dir, record, stop, unused_uid
from .test_crash import commit_pattern
from .test_fuzz import memfd_allocation_id

GMS = Path(__file__).resolve().parents[2] / "gms"
needs_root = pytest.mark.skipif(not is_root(), reason="needs root to connect as other uids")


def raw(sock) -> RawConn:
    return RawConn.from_socket(sock)


@pytest.fixture
def servers():
    started: list[ServerProcess] = []

    def start(*args: str, folder: Path | None = None) -> ServerProcess:
        server = ServerProcess(folder or open_dir(), *args)
        started.append(server)
        return server

    yield start
    for server in started:
        stop(server)


# -- who can reach the socket ---------------------------------------------------------


def test_socket_and_folder_modes(servers, tmp_path):
    server = servers()
    assert stat.S_IMODE(os.stat(server.socket).st_mode) == 0o600
    shared = servers("--socket-mode", "660")
    assert stat.S_IMODE(os.stat(shared.socket).st_mode) == 0o660
    # A folder the server makes for its socket is never writable by others,
    # whatever the umask it runs under (tests/test_server_lifecycle.py checks 000).
    nested = tmp_path / "x" / "y" / "gms.sock"
    old = os.umask(0o002)
    try:
        made = subprocess.Popen([sys.executable, "-m", "gms", "serve", "--backend", "host",
                                 "--socket", str(nested), "--log-level", "warning"])
    finally:
        os.umask(old)
    try:
        wait_until(nested.exists, timeout=30, what="the socket in new folders")
        for folder in (nested.parent, nested.parent.parent):
            assert stat.S_IMODE(folder.stat().st_mode) == 0o755, oct(folder.stat().st_mode)
    finally:
        kill_tree(made.pid)  # the keeper and its server (which would start another keeper)
        made.wait()
    record("security", "socket and folder modes", checked="0600 default, --socket-mode 660, folders <= 0755", errors=0)


@needs_root
def test_another_uid_cannot_connect_unless_the_operator_allows_it(servers):
    uid = unused_uid()
    private = servers()
    with pytest.raises(PermissionError):
        connect_as(private.socket, uid)
    opened = servers("--socket-mode", "666")
    conn = raw(connect_as(opened.socket, uid))
    response = conn.call(m.HandshakeRequest("RO", 0, "weights"))
    assert isinstance(response, m.HandshakeResponse), response  # let in (no policy: one tenant)
    conn.close()
    wait_until(lambda: opened.state().sessions == 0, what="session closed")
    opened_events = [e for e in opened.events() if e.kind == "SESSION_OPENED"]
    assert opened_events[-1].fields["uid"] == uid, "identity from SO_PEERCRED"
    record("security", "another uid: socket mode", refused_at_0600=1, let_in_at_0666=1, errors=0)


@needs_root
def test_a_policy_refuses_a_uid_with_no_tenant_and_holds_tenants_to_their_rights(servers, tmp_path):
    member, stranger = unused_uid(5100), unused_uid(5200)
    policy = tmp_path / "policy.toml"
    policy.write_text(
        f"""
[[tenant]]
name = "ops"
uids = [0]
write = ["*"]
admin = true

[[tenant]]
name = "team"
uids = [{member}]
write = ["team-*"]
read = ["shared"]
quota = "16MiB"
"""
    )
    server = servers("--socket-mode", "666", "--policy", str(policy))
    commit_pattern(server, "shared", "shared")

    conn = raw(connect_as(server.socket, stranger))
    response = conn.call(m.HandshakeRequest("RO", 0, "shared"))
    assert (type(response), response.code) == (m.ErrorResponse, "PERMISSION_DENIED"), response
    assert "no tenant" in response.error
    conn.close()
    refused = [e for e in server.events() if e.kind == "SESSION_REFUSED"]
    assert refused and refused[-1].fields["uid"] == stranger
    probe = raw(connect_as(server.socket, stranger))
    assert probe.call(m.GetRuntimeStateRequest()).code == "PERMISSION_DENIED", "probes too"
    probe.close()

    def member_call(request):
        conn = raw(connect_as(server.socket, member))
        try:
            return conn.call(request)
        finally:
            conn.close()

    assert member_call(m.HandshakeRequest("RW", 0, "team-a")).granted_lock_type == "RW"
    assert member_call(m.HandshakeRequest("RO", 0, "shared")).granted_lock_type == "RO"
    assert member_call(m.HandshakeRequest("RW", 0, "shared")).code == "PERMISSION_DENIED"
    assert member_call(m.HandshakeRequest("RO", 0, "other")).code == "PERMISSION_DENIED"
    for verb in (m.RevokeRequest("shared"), m.EvictRequest("shared"), m.PinRequest("shared")):
        response = member_call(verb)
        assert (type(response), response.code) == (m.ErrorResponse, "PERMISSION_DENIED"), verb
    assert admin.revoke(server.socket, "shared") == 0  # root is an admin
    # The quota: a session of the team may not take more than 16 MiB.
    conn = raw(connect_as(server.socket, member))
    assert conn.call(m.HandshakeRequest("RW", 0, "team-a")).success
    assert isinstance(conn.call(m.AllocateRequest(16 << 20, "w")), m.AllocateResponse)
    over = conn.call(m.AllocateRequest(2 << 20, "w"))
    assert (over.code, over.scope, over.quota) == ("QUOTA_EXCEEDED", "tenant", 16 << 20), over
    conn.close()
    wait_until(lambda: server.state().sessions == 0, what="sessions closed")
    assert server.layout("shared").committed
    record("security", "policy: uid without tenant, rights, admin, quota", errors=0,
           refused_handshakes=3, refused_admin_verbs=3)


# -- caps ---------------------------------------------------------------------------


def test_caps_are_enforced_with_clear_errors(servers):
    server = servers(
        "--max-frame-bytes", "64KiB", "--max-allocations", "3", "--max-metadata-keys", "4",
        "--max-metadata-value-bytes", "1KiB", "--host-capacity", "64MiB",
    )
    checked = 0
    with GMSClientMemoryManager(server.socket, layout="capped") as writer:
        writer.connect("RW")

        def refused(call, *args, match: str) -> None:
            nonlocal checked
            with pytest.raises(GMSServerError) as caught:
                call(*args)
            assert caught.value.code == "LIMIT_EXCEEDED", caught.value
            assert match in caught.value.message, caught.value.message
            checked += 1

        refused(writer.allocate_handle, (64 << 20) + 1, match="exceeds the 67108864-byte limit")
        refused(writer.allocate_handle, 1 << 20, "t" * 257, match="tag is longer than 256 bytes")
        ids = [writer.allocate_handle(1 << 20, "w")[0] for _ in range(3)]
        refused(writer.allocate_handle, 1 << 20, match="already holds 3 allocations")
        refused(writer.metadata_put, "k", ids[0], 0, b"v" * 1025, match="exceeds 1024")
        refused(writer.metadata_put, "k" * 1025, ids[0], 0, b"v", match="longer than 1024 bytes")
        for n in range(4):
            writer.metadata_put(f"k{n}", ids[0], 0, b"v")
        refused(writer.metadata_put, "k4", ids[0], 0, b"v", match="already holds 4 metadata keys")
    conn = RawConn(server.socket)
    conn.handshake("RW")
    response = conn.call(m.ExportAllocationsRequest(["x"] * 254))  # the client batches by 253
    assert response.code == "LIMIT_EXCEEDED" and "at most 253" in response.error, response
    conn.send(m.MetadataListRequest("p" * (64 << 10)))
    assert dropped(conn), "a frame over the cap drops the connection"
    drops = [e for e in server.events() if e.kind == "CONNECTION_DROPPED"]
    assert "exceeds 65536" in drops[-1].fields["reason"]
    with GMSClientMemoryManager(server.socket, layout="capped2") as writer:
        writer.connect("RW")
        with pytest.raises(RequestTooLargeError) as too_large:  # the handshake named the cap
            writer.metadata_list("p" * (64 << 10))
        assert too_large.value.limit == 64 << 10
        assert writer.is_connected and writer.metadata_list() == [], "refused before sending: the session goes on"
    record("security", "caps with clear errors", checked=checked + 2, errors=0)


# -- no code from data ------------------------------------------------------------------

# Turning data into code or objects: never, anywhere in gms/.
FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib", "jsonpickle"}
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__", "execfile", "input", "breakpoint",
                   "importlib.import_module", "torch.load", "yaml.load", "yaml.unsafe_load", "numpy.load", "np.load"}
# Running programs or loading native code: only where justified here.
GUARDED_PREFIXES = ("subprocess.", "os.system", "os.popen", "os.exec", "os.spawn", "os.posix_spawn",
                    "trio.run_process", "trio.lowlevel.open_process", "ctypes.CDLL", "ctypes.cdll")
JUSTIFIED = {
    ("torch/allocator.py", "subprocess.run"): "compiles the C shim gms ships, with the system compiler",
    ("torch/allocator.py", "ctypes.CDLL"): "loads that shim, built from gms's own source",
    ("failover/sets.py", "trio.lowlevel.open_process"): "starts the engine commands the operator configured",
    ("operator/supervisor.py", "trio.lowlevel.open_process"): "gms serve --devices: one `python -m gms serve` per GPU",
    ("keeper/spare.py", "trio.lowlevel.open_process"): "gms serve: the keeper starts `python -m gms serve` with its own words (the next server, or a spare)",
    ("server/tiers/copier_link.py", "trio.lowlevel.open_process"): "the server's copier: `python -m gms.copier`, on a socketpair",
    ("server/restart/startup.py", "subprocess.Popen"): "a server whose keeper died: `python -m gms keeper --adopt-fd` "
    "with the server's own words",
    ("cuda/host.py", "ctypes.CDLL"): "libc, for mmap/munmap at fixed addresses",
    ("system/heap.py", "ctypes.CDLL"): "libc (the process itself), for mallopt",
    ("cuda/vmm.py", "ctypes.CDLL"): "libnvidia-ml, for device memory figures",
}


def dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def code_from_data(source: str, where: str) -> list[tuple[str, str]]:
    """What a module does that turns data into code, or runs programs."""
    found = []
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.Import):
            found += [(where, a.name) for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
            found.append((where, node.module))
        elif isinstance(node, ast.Call):
            name = dotted(node.func)
            if name is None:
                continue
            if name in FORBIDDEN_CALLS or name.startswith(GUARDED_PREFIXES):
                found.append((where, name))
            if any(k.arg == "shell" for k in node.keywords):
                found.append((where, f"{name}(shell=...)"))
    return found


def test_no_pickle_eval_or_exec_anywhere_in_gms():
    files = sorted(GMS.rglob("*.py"))
    found = [f for path in files for f in code_from_data(path.read_text(), str(path.relative_to(GMS)))]
    unjustified = sorted(set(found) - set(JUSTIFIED))
    assert not unjustified, f"code from data (or a program run) in gms/, not justified: {unjustified}"
    stale = sorted(set(JUSTIFIED) - set(found))
    assert not stale, f"justified but gone (drop them from JUSTIFIED): {stale}"
    record("security", "no pickle/eval/exec in gms/", files=len(files), justified=len(JUSTIFIED),
           unjustified=0, errors=0)


def test_the_scan_finds_what_it_forbids():
    """The scan above is only worth something if it can fail."""
    bad = (
        "import pickle\nfrom marshal import loads\neval('1')\nexec(x)\nimport importlib\n"
        "importlib.import_module('x')\ntorch.load(f)\nsubprocess.run(a, shell=True)\n"
    )
    names = {what for _, what in code_from_data(bad, "bad.py")}
    assert names == {"pickle", "marshal", "eval", "exec", "importlib.import_module", "torch.load",
                     "subprocess.run", "subprocess.run(shell=...)"}, names


# -- no fd outside the layout a lock covers ----------------------------------------------


def test_a_client_never_gets_an_fd_of_another_layout(servers):
    server = servers("--no-copier")  # the restorer exports host copies itself (with a copier it gets none)
    commit_pattern(server, "a", "a")
    commit_pattern(server, "b", "b", residency="system")
    commit_pattern(server, "d", "d", residency="system")
    ids = {}
    for name in ("a", "b", "d"):
        conn = RawConn(server.socket)
        conn.call(m.HandshakeRequest("RO", 0, name))
        ids[name] = [x.allocation_id for x in conn.call(m.ListAllocationsRequest()).allocations]
        conn.close()
    assert admin.evict(server.socket, "d").tier == "host"
    attempts = 0

    def refused(conn: RawConn, request, *codes: str) -> None:
        nonlocal attempts
        conn.send(request)
        response, fds = conn.recv()
        for fd in fds:
            os.close(fd)
        assert fds == [], f"{request}: {len(fds)} fds of another layout"
        assert isinstance(response, m.ErrorResponse) and response.code in codes, (request, response)
        attempts += 1

    def own(conn: RawConn, request, allowed) -> int:
        conn.send(request)
        response, fds = conn.recv()
        try:
            assert fds and all(memfd_allocation_id(fd) in allowed for fd in fds), response
        finally:
            for fd in fds:
                os.close(fd)
        return len(fds)

    foreign = ids["b"][0]
    # A reader of a: b's ids are unknown to it, alone or mixed with its own.
    reader = RawConn(server.socket)
    reader.call(m.HandshakeRequest("RO", 0, "a"))
    refused(reader, m.ExportAllocationRequest(foreign), "UNKNOWN_ALLOCATION")
    refused(reader, m.ExportAllocationsRequest([ids["a"][0], foreign]), "UNKNOWN_ALLOCATION")
    refused(reader, m.ExportAllocationsRequest([foreign, ids["a"][1]]), "UNKNOWN_ALLOCATION")
    refused(reader, m.GetAllocationRequest(foreign), "UNKNOWN_ALLOCATION")
    refused(reader, m.ExportHostCopiesRequest([foreign]), "UNKNOWN_ALLOCATION", "MODE_VIOLATION")
    refused(reader, m.ExportHostCopiesRequest(ids["a"]), "MODE_VIOLATION")
    assert own(reader, m.ExportAllocationsRequest(ids["a"]), set(ids["a"])) == 2
    # A writer of c: b's ids (and their host copies) are unknown to it too.
    writer = RawConn(server.socket)
    writer.call(m.HandshakeRequest("RW", 0, "c"))
    mine = writer.call(m.AllocateRequest(1 << 20, "w")).allocation_id
    refused(writer, m.ExportAllocationRequest(foreign), "UNKNOWN_ALLOCATION")
    refused(writer, m.ExportHostCopiesRequest([foreign]), "UNKNOWN_ALLOCATION")
    refused(writer, m.ExportHostCopiesRequest([mine, foreign]), "UNKNOWN_ALLOCATION")
    refused(writer, m.MetadataPutRequest("k", foreign, 0, b"v"), "UNKNOWN_ALLOCATION")
    refused(writer, m.FreeAllocationRequest(foreign), "UNKNOWN_ALLOCATION")
    assert own(writer, m.ExportHostCopiesRequest([mine]), {mine}) == 1
    assert writer.call(m.FreeAllocationRequest(mine)).success
    refused(writer, m.ExportAllocationRequest(mine), "UNKNOWN_ALLOCATION")  # freed: gone
    # The restorer of d: b's device memory and host copies are unknown to it.
    restorer = RawConn(server.socket)
    assert restorer.call(m.HandshakeRequest("RO", 0, "d")).restore
    refused(restorer, m.ExportAllocationsRequest([foreign]), "UNKNOWN_ALLOCATION")
    refused(restorer, m.ExportHostCopiesRequest([foreign]), "UNKNOWN_ALLOCATION")
    refused(restorer, m.ExportHostCopiesRequest([ids["d"][0], foreign]), "UNKNOWN_ALLOCATION")
    assert own(restorer, m.ExportHostCopiesRequest(ids["d"]), set(ids["d"])) == 2
    # Before the handshake nothing at all.
    stranger = RawConn(server.socket)
    refused(stranger, m.ExportAllocationRequest(foreign), "NOT_CONNECTED")
    refused(stranger, m.ExportHostCopiesRequest([foreign]), "NOT_CONNECTED")
    for conn in (reader, writer, restorer, stranger):
        conn.close()
    wait_until(lambda: server.state().sessions == 0, what="sessions closed")
    assert server.layout("b").committed and server.layout("b").allocation_count == 2
    record("security", "fds never cross layouts", attempts=attempts, fds_leaked=0, errors=0)
