"""The disk tier (issue 52) on the host backend, as users run gms: under its keeper.

A reboot is simulated as the issue says: every gms process stopped (SIGTERM to
the keeper, or SIGKILL to the whole tree: keeper, server, spare, copier), then
``gms serve`` started again on the same socket and folders.  What must hold:
a layout committed to persist comes back committed, with the same hash and
the same bytes, on the disk tier, and its first reader (``RW_OR_RO`` too)
restores it; a snapshot that does not read back is refused and its layout
dropped, never served; a save that cannot be made fails the save, not the
commit; a kill in the middle of a save or a restore loses nothing that was
whole.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from gms import GMSClientMemoryManager, RequestedLockType
from gms.client.admin import evict
from gms.disk import format as fmt
from gms.errors import GMSServerError, GMSUsageError, LockTimeoutError, SnapshotNotServedError

from .helpers import ServerProcess, state_or_none, wait_until

MiB = 1 << 20
_STARTED: list[ServerProcess] = []


@pytest.fixture(autouse=True)
def _no_server_outlives_its_test():
    yield
    while _STARTED:
        server = _STARTED.pop()
        if server.proc.poll() is None:
            server.kill()


def serve(
    tmp_path, *args: str, socket_path: str | None = None, env: dict | None = None, backend: str = "host",
    keeper: bool = True,
) -> ServerProcess:
    """``gms serve`` as users run it (its keeper on, unless ``keeper`` says), killed after the test if still up."""
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        server = ServerProcess(
            tmp_path, *args, socket_path=socket_path or str(tmp_path / "gms.sock"), keeper=keeper, backend=backend,
        )
        _STARTED.append(server)
        return server
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def publish(path: str, layout: str = "weights", sizes=(5 * MiB, 3 * MiB), persist=True, residency=None):
    """Commit a layout of random bytes; its hash and contents."""
    writer = GMSClientMemoryManager(path, layout=layout)
    try:
        writer.connect(RequestedLockType.RW)
        contents = []
        for n, size in enumerate(sizes):
            va = writer.create_mapping(size=size, tag="weights")
            data = os.urandom(size)
            writer.write(va, data)
            contents.append(data)
            writer.metadata_put(f"tensor.{n}", writer.mappings[-1].allocation_id, n, b"meta%d" % n)
        writer.commit(residency, persist=persist)
        return writer.get_memory_layout_hash(), contents
    finally:
        writer.close()


def read(path: str, layout: str = "weights", lock=RequestedLockType.RW_OR_RO):
    """(granted lock, hash, contents) as a reader sees the layout."""
    reader = GMSClientMemoryManager(path, layout=layout)
    try:
        reader.connect(lock)
        granted = reader.granted_lock_type
        if granted.value == "RW":
            return granted, None, []
        handles = reader.list_handles()
        vas = reader.create_mappings([h.allocation_id for h in handles])
        return granted, reader.get_memory_layout_hash(), [reader.read(va, h.size) for va, h in zip(vas, handles)]
    finally:
        reader.close()


def saved(server: ServerProcess, layout: str = "weights") -> str:
    """Once the layout's snapshot is saved: its file's path."""
    wait_until(lambda: server.layout(layout).disk_bytes > 0, timeout=30, what=f"{layout}'s snapshot\n{server.log}")
    files = [n for n in os.listdir(server.state().disk_dir) if n.endswith(fmt.SUFFIX)]
    mine = [n for n in files if n.startswith(fmt.file_name(layout, server.layout(layout).memory_layout_hash, 0)[:24])]
    return os.path.join(server.state().disk_dir, max(mine))


def reboot(server: ServerProcess, tmp_path, how: str = "stop", **options) -> ServerProcess:
    """Every gms process gone, then gms serve again with the same socket and folders."""
    if how == "stop":
        assert server.stop() == 0
    else:
        server.kill()
    return serve(tmp_path, socket_path=server.socket, **options)


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_persisted_layout_outlives_every_gms_process_and_comes_back_whole(tmp_path, how):
    server = serve(tmp_path)
    layout_hash, contents = publish(server.socket)
    publish(server.socket, "scratch", persist=False)
    path = saved(server)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert server.state().disk_used_bytes == os.path.getsize(path) == server.layout().disk_bytes

    server = reboot(server, tmp_path, how)
    row = server.layout()
    assert (row.state, row.tier, row.memory_layout_hash, row.gpu_bytes) == ("COMMITTED", "disk", layout_hash, 0)
    assert row.residency == "device", "the residency it was committed with"
    assert server.layout("scratch").state == "EMPTY", "only what was committed to persist outlives the node"
    granted, again, got = read(server.socket)  # an engine asking RW_OR_RO: it imports instead of loading
    assert (granted.value, again) == ("RO", layout_hash) and got == contents
    # (a probe whose first request a loaded machine delayed past its deadline is dropped: not this story)
    kinds = [kind for kind in server.kinds() if kind != "CONNECTION_DROPPED"]
    assert kinds[:4] == ["LAYOUT_RECOVERED", "RESTORE_CLAIMED", "RESTORE_LOADING", "RESTORE_FINISHED"], kinds
    assert (server.layout().tier, server.layout().restores) == ("device", 1)
    assert read(server.socket, lock=RequestedLockType.RO)[2] == contents, "a second reader imports what is there"
    server.stop()


def test_a_node_that_comes_back_with_snapshots_is_up_once_its_copier_is(tmp_path):
    """Its first readers restore, and each restore waits for the copier: the node says it
    serves only once the copier runs, so a restore timed from the connect is the restore
    (the copier's start was a quarter of a 1 GiB one on 2 cores, docs/performance.md)."""
    server = serve(tmp_path)
    publish(server.socket)
    saved(server)
    server = reboot(server, tmp_path)
    assert server.state().copier == "running"
    server.stop()


@pytest.mark.parametrize("bound", ["--gpu-budget", "--host-capacity"])
def test_restore_at_start_puts_what_fits_on_the_gpu_before_serving(tmp_path, bound):
    """``--restore-at-start``: after a reboot the server restores the layouts it
    recovered, as their first reader would (its own session, the layout's
    owner), before it serves: readers import at once.  A layout the GPU budget
    (or the device itself: the host backend's capacity) has no room for stays
    on disk; nothing is evicted for a warm-up."""
    server = serve(tmp_path)
    # Unpinned: each could be evicted for the other's room (to its snapshot); a warm-up must not.
    first_hash, first = publish(server.socket, "a", sizes=(6 * MiB,), residency="unpinned")
    publish(server.socket, "b", sizes=(6 * MiB,), residency="unpinned")
    saved(server, "a")
    saved(server, "b")
    assert server.stop() == 0

    server = serve(tmp_path, "--restore-at-start", bound, str(10 * MiB), socket_path=server.socket)
    a, b = server.layout("a"), server.layout("b")
    assert (a.tier, a.restores, a.state, a.memory_layout_hash) == ("device", 1, "COMMITTED", first_hash)
    assert (b.tier, b.gpu_bytes) == ("disk", 0), "b does not fit beside a: it stays on disk"
    events = server.events()
    opened = [e for e in events if e.kind == "SESSION_OPENED"]
    # The server's own sessions, before any client's (under the capacity, b's too: it found no room and left).
    assert {e.fields["pid"] for e in opened} == {server.state().pid} and opened[0].layout == "a"
    assert [e.kind for e in events if e.layout == "a"] == [
        "LAYOUT_RECOVERED", "SESSION_OPENED", "RESTORE_CLAIMED", "RESTORE_LOADING", "RESTORE_FINISHED",
        "RO_DISCONNECT",
    ]
    granted, again, got = read(server.socket, "a", lock=RequestedLockType.RO)
    assert (granted.value, again, got) == ("RO", first_hash, first)
    assert server.layout("a").restores == 1, "the reader imported: no second restore"
    server.stop()


def flip_bit(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def test_a_snapshot_whose_bytes_changed_on_disk_is_refused_and_its_layout_dropped(tmp_path):
    server = serve(tmp_path)
    publish(server.socket)
    path = saved(server)
    server.stop()
    flip_bit(path, 5 * MiB + 1234)  # in the second allocation's bytes
    server = serve(tmp_path)
    assert server.layout().tier == "disk", "the manifest reads: recovered, the bytes are checked as they are read"
    with pytest.raises(GMSServerError) as refused:
        read(server.socket, lock=RequestedLockType.RO)
    assert refused.value.code == "SNAPSHOT_UNREADABLE" and "dropped" in refused.value.message, server.log
    events = server.events()
    failed = [e for e in events if e.kind == "SNAPSHOT_FAILED"]
    assert failed and "checksum" in failed[0].fields["reason"], failed
    assert [e.kind for e in events if e.kind in ("RESTORE_ABORTED", "LAYOUT_LOST")] == ["RESTORE_ABORTED", "LAYOUT_LOST"]
    assert server.layout().state == "EMPTY"
    wait_until(lambda: not os.path.exists(path), what="the bad snapshot removed")
    granted, _, _ = read(server.socket)
    assert granted.value == "RW", "the next engine builds it again"
    server.stop()


@pytest.mark.parametrize("damage", ["truncated", "manifest", "trailer", "other-version"])
def test_a_snapshot_that_does_not_read_is_set_aside_at_start_and_never_served(tmp_path, damage):
    """A torn or damaged file is renamed out of the way; one of another format
    version (a gms of after a downgrade wrote it) is left where it is, for a gms
    that reads it: never served here either."""
    server = serve(tmp_path)
    publish(server.socket)
    path = saved(server)
    size = os.path.getsize(path)
    server.stop()
    with open(path, "r+b") as f:
        if damage == "truncated":
            f.truncate(size - 4096)
        elif damage == "manifest":
            f.seek(size - fmt.TRAILER.size - 10)
            f.write(b"\xff")
        elif damage == "trailer":
            f.seek(size - fmt.TRAILER.size)
            f.write(b"not-gms!")
        else:
            f.seek(size - fmt.TRAILER.size + 8)
            f.write((99).to_bytes(4, "little"))
    server = serve(tmp_path)
    assert server.layout().state == "EMPTY"
    if damage == "other-version":
        assert os.path.exists(path) and not os.path.exists(path + ".corrupt"), "left for a gms that reads it"
        assert "format version 99" in server.log and "left as it is" in server.log
    else:
        assert not os.path.exists(path) and os.path.exists(path + ".corrupt"), "kept aside for the operator"
        assert "set aside" in server.log
    (aside,) = [e for e in server.events() if e.kind == "SNAPSHOT_SET_ASIDE"]  # in the history, not only the log
    assert aside.fields["file"] == os.path.basename(path) and aside.fields["reason"], aside.fields
    assert aside.fields["aside"] == ("" if damage == "other-version" else os.path.basename(path) + ".corrupt")
    assert read(server.socket)[0].value == "RW"
    server.stop()


def test_a_save_the_disk_budget_refuses_fails_the_save_not_the_commit(tmp_path):
    server = serve(tmp_path, "--disk-budget", "4MiB")
    layout_hash, contents = publish(server.socket)
    failed = wait_until(lambda: [e for e in server.events() if e.kind == "SNAPSHOT_FAILED"], what="the failed save")
    assert "disk_budget" in failed[0].fields["reason"] and "the commit stands" in failed[0].fields["reason"], failed
    granted, again, got = read(server.socket)
    assert (granted.value, again, got) == ("RO", layout_hash, contents)
    assert server.layout().disk_bytes == 0 and server.state().disk_used_bytes == 0
    assert not [n for n in os.listdir(server.state().disk_dir)], "nothing half written is left"
    server.stop()


def test_a_file_the_kernel_refuses_to_grow_fails_the_save_and_says_why(tmp_path):
    """RLIMIT_FSIZE on the server: a real EFBIG where a full disk gives ENOSPC, on
    the same path (the room is reserved before a byte is copied).  7 MiB: room
    for the host backend's memfds (6 and 4 MiB), not for the 10 MiB snapshot."""
    import resource

    server = serve(tmp_path)
    resource.prlimit(server.server_pid(), resource.RLIMIT_FSIZE, (7 * MiB, 7 * MiB))
    layout_hash, _ = publish(server.socket)
    failed = wait_until(lambda: [e for e in server.events() if e.kind == "SNAPSHOT_FAILED"], what="the failed save")
    assert "too large" in failed[0].fields["reason"].lower(), failed
    assert server.layout().memory_layout_hash == layout_hash and server.layout().state == "COMMITTED"
    assert not os.listdir(server.state().disk_dir)
    server.stop()


def test_a_kill_in_the_middle_of_a_save_loses_no_commit_and_leaves_no_snapshot(tmp_path):
    """The copier stops itself once one extent of a save is written (40 MiB: two
    extents); the whole tree is then killed.  The next start sweeps the
    temporary file and recovers nothing half saved."""
    server = serve(tmp_path, env={"GMS_COPIER_STOP_AFTER": "save:1"})
    publish(server.socket, sizes=(40 * MiB,))
    folder = server.state().disk_dir
    wait_until(lambda: any(n.endswith(".tmp") for n in os.listdir(folder)), what="the save under way")
    server.kill()
    assert any(n.endswith(".tmp") for n in os.listdir(folder))
    server = serve(tmp_path)
    assert server.layout().state == "EMPTY" and not os.listdir(folder)
    server.stop()


def test_a_copier_killed_in_the_middle_of_a_save_leaves_the_commit_and_the_save_is_tried_again(tmp_path):
    server = serve(tmp_path, env={"GMS_COPIER_STOP_AFTER": "save:1"})
    layout_hash, contents = publish(server.socket, sizes=(40 * MiB,))
    copier = wait_until(lambda: server.state().copier_pid, what="the copier")
    wait_until(lambda: open(f"/proc/{copier}/stat").read().rsplit(")", 1)[1].split()[0] == "T",
               what="the copier stopped half way")
    os.kill(copier, signal.SIGKILL)
    # The next copier inherits the hook too: it stops after one extent again, and is killed again.
    wait_until(lambda: [e for e in server.events() if e.kind == "SNAPSHOT_FAILED"], what="the failed save")
    assert server.layout().state == "COMMITTED", "the commit stands"
    failed = [e.fields["reason"] for e in server.events() if e.kind == "SNAPSHOT_FAILED"]
    assert "tried again" in failed[0], failed
    server.stop()


def test_an_unpinned_commit_to_persist_is_evicted_for_its_snapshot_only_once_that_is_saved(tmp_path):
    """Another layout needs its room under --gpu-budget while its save is half done (the
    copier stopped after one of two extents): the allocation waits and the commit stays;
    once the copier goes on and the save lands, it leaves the GPU for its snapshot and
    the allocation gets the room.  Evicted before, the commit its writer was told
    persists would have been lost."""
    server = serve(tmp_path, "--gpu-budget", "64MiB", env={"GMS_COPIER_STOP_AFTER": "save:1"})
    layout_hash, contents = publish(server.socket, sizes=(40 * MiB,), residency="unpinned")
    copier = wait_until(lambda: server.state().copier_pid, what="the copier")
    wait_until(lambda: open(f"/proc/{copier}/stat").read().rsplit(")", 1)[1].split()[0] == "T",
               what="the copier stopped half way through the save")
    import threading

    other = threading.Thread(target=publish, args=(server.socket, "other", (40 * MiB,)))
    other.start()
    other.join(1.5)
    assert other.is_alive(), "the allocation waits for room"
    row = server.layout()
    assert (row.state, row.tier, row.memory_layout_hash, row.disk_bytes) == ("COMMITTED", "device", layout_hash, 0)
    os.kill(copier, signal.SIGCONT)
    other.join(30)
    assert not other.is_alive()
    row = server.layout()
    assert (row.state, row.tier, row.memory_layout_hash) == ("COMMITTED", "disk", layout_hash) and row.disk_bytes
    assert server.layout("other").state == "COMMITTED"
    kinds = server.kinds()
    assert kinds.index("SNAPSHOT_SAVED") < kinds.index("LAYOUT_EVICTED"), kinds
    server.stop()


def test_a_kill_in_the_middle_of_a_restore_loses_nothing(tmp_path):
    server = serve(tmp_path)
    layout_hash, contents = publish(server.socket, sizes=(40 * MiB,))
    saved(server)
    server.stop()
    server = serve(tmp_path, env={"GMS_COPIER_STOP_AFTER": "load:1"})
    copier = wait_until(lambda: server.state().copier_pid, what="the copier")
    reader = GMSClientMemoryManager(server.socket, layout="weights")
    import threading

    outcome = []

    def connect():
        try:
            reader.connect(RequestedLockType.RO)
            outcome.append("granted")
        except GMSServerError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=connect)
    thread.start()
    wait_until(lambda: open(f"/proc/{copier}/stat").read().rsplit(")", 1)[1].split()[0] == "T",
               what="the copier stopped half way through the restore")
    os.kill(copier, signal.SIGKILL)
    thread.join(30)
    reader.close()
    assert outcome and isinstance(outcome[0], GMSServerError) and outcome[0].code == "SNAPSHOT_UNREADABLE", outcome
    assert "ask again" in outcome[0].message
    wait_until(lambda: server.layout().tier == "disk", what="the layout back on disk only")
    server = reboot(server, tmp_path, "kill")
    granted, again, got = read(server.socket)
    assert (granted.value, again, got == contents) == ("RO", layout_hash, True)
    server.stop()


def test_a_new_commit_replaces_the_snapshot_and_an_unpinned_layout_is_evicted_to_disk(tmp_path):
    server = serve(tmp_path)
    publish(server.socket)
    first = saved(server)
    layout_hash, contents = publish(server.socket, residency="unpinned")
    second = saved(server)
    assert first != second
    wait_until(lambda: not os.path.exists(first), what="the replaced snapshot removed")
    done = evict(server.socket, "weights")
    assert done.tier == "disk" and server.layout().gpu_bytes == 0
    granted, again, got = read(server.socket, lock=RequestedLockType.RO)
    assert (granted.value, again, got == contents) == ("RO", layout_hash, True)
    assert [k for k in server.kinds() if k.startswith(("LAYOUT_EVICTED", "RESTORE"))][-4:] == [
        "LAYOUT_EVICTED", "RESTORE_CLAIMED", "RESTORE_LOADING", "RESTORE_FINISHED",
    ]
    server.stop()




def test_of_two_snapshots_of_one_layout_the_later_is_recovered_and_the_other_removed(tmp_path):
    server = serve(tmp_path)
    publish(server.socket)
    first = saved(server)
    kept = tmp_path / "first.copy"
    shutil.copy(first, kept)
    layout_hash, contents = publish(server.socket)  # the same structure: the same hash, a file of its own
    second = saved(server)
    wait_until(lambda: not os.path.exists(first), what="the replaced snapshot removed")
    server.stop()
    shutil.copy(kept, first)  # as a crash between the new save and the old one's release leaves them
    server = serve(tmp_path, socket_path=server.socket)
    granted, again, got = read(server.socket, lock=RequestedLockType.RO)
    assert (granted.value, again, got == contents) == ("RO", layout_hash, True)
    wait_until(lambda: not os.path.exists(first), what="the older snapshot removed")
    assert os.path.exists(second)
    server.stop()

def test_a_full_host_tier_spills_its_saved_layouts_to_disk_and_they_come_back(tmp_path):
    server = serve(tmp_path, "--host-budget", "16MiB")  # one layout's host copies (10 MiB aligned), not two
    old_hash, old = publish(server.socket, "old", residency="system")
    saved(server, "old")
    assert evict(server.socket, "old").tier == "host"
    publish(server.socket, "unsaved", sizes=(MiB,), residency="system", persist=False)
    assert evict(server.socket, "unsaved").tier == "host"
    new_hash, new = publish(server.socket, "new", residency="system")
    # Room for the new layout's host copies: the saved one went to disk, the unsaved one stayed.
    assert (server.layout("old").tier, server.layout("old").host_bytes) == ("disk", 0)
    assert server.layout("unsaved").tier == "host"
    spilled = [e for e in server.events() if e.kind == "LAYOUT_SPILLED"]
    assert [(e.fields["layout"], e.fields["reason"]) for e in spilled] == [("old", "host budget")]
    granted, again, got = read(server.socket, "old", lock=RequestedLockType.RO)
    assert (granted.value, again, got == old) == ("RO", old_hash, True)
    # Back on the GPU without a host copy: evicted again, its snapshot holds it.
    assert evict(server.socket, "old").tier == "disk"
    assert read(server.socket, "new", lock=RequestedLockType.RO)[1:] == (new_hash, new)
    # A full host tier with nothing saved to spill refuses as before.
    with pytest.raises(GMSServerError) as refused:
        publish(server.socket, "more", sizes=(7 * MiB,), residency="system", persist=False)
    assert refused.value.code == "HOST_MEMORY_EXHAUSTED"
    server.stop()

def test_a_tenant_policy_persists_by_default_and_its_disk_quota_bounds_it(tmp_path):
    uid = os.getuid()
    policy = tmp_path / "policy.toml"
    policy.write_text(
        f'[[tenant]]\nname = "team"\nuids = [{uid}]\nwrite = ["*"]\nadmin = true\npersist = true\n'
        'disk_quota = "12MiB"\n'
    )
    server = serve(tmp_path, "--policy", str(policy))
    publish(server.socket, "small", persist=None)
    saved(server, "small")
    publish(server.socket, "big", persist=None)
    failed = wait_until(lambda: [e for e in server.events() if e.kind == "SNAPSHOT_FAILED"], what="the refusal")
    assert failed[0].fields["layout"] == "big" and "disk_quota" in failed[0].fields["reason"]
    publish(server.socket, "no", persist=False)
    assert server.state().tenant("team").disk_bytes == server.layout("small").disk_bytes
    server.stop()
    # The policy no longer names the owner: its snapshot stays on disk for a start that does.
    policy.write_text(f'[[tenant]]\nname = "other"\nuids = [{uid}]\nwrite = ["*"]\nadmin = true\n')
    server = serve(tmp_path, "--policy", str(policy))
    assert server.layout("small").state == "EMPTY" and "left on disk" in server.log
    assert len(os.listdir(server.state().disk_dir)) == 1
    server.stop()
    # Named, but not to write that layout (issue 60: a snapshot's owner was taken on its
    # word): checked as its writer would have been.
    policy.write_text(f'[[tenant]]\nname = "team"\nuids = [{uid}]\nwrite = ["other-*"]\nadmin = true\n')
    server = serve(tmp_path, "--policy", str(policy))
    assert server.layout("small").state == "EMPTY" and "may not write it" in server.log
    assert len(os.listdir(server.state().disk_dir)) == 1
    server.stop()


def test_a_server_without_a_disk_tier_refuses_to_persist_and_says_so(tmp_path):
    server = serve(tmp_path, "--no-disk-tier")
    with pytest.raises(GMSServerError) as refused:
        publish(server.socket)
    assert refused.value.code == "STATE_VIOLATION" and "no disk tier" in refused.value.message
    assert server.state().disk_budget_bytes == 0
    server.stop()


def test_a_disk_folder_others_may_write_is_refused(tmp_path):
    folder = tmp_path / "open"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    with pytest.raises(AssertionError, match="not this server's alone"):
        ServerProcess(tmp_path, "--disk-dir", str(folder), socket_path=str(tmp_path / "gms.sock"))


# -- a restart is the same node (issue 59) -------------------------------------------------

SETTINGS = ("--disk-budget", "100MiB", "--gpu-budget", "200MiB", "--host-budget", "300MiB",
            "--max-metadata-bytes", "64MiB")


def _node(state) -> tuple:
    """What ``gms status --json`` says of a node's configuration."""
    return (state.disk_budget_bytes, state.disk_dir, state.budget_bytes, state.host_budget_bytes,
            state.capacity_bytes, state.max_metadata_bytes)


@pytest.mark.parametrize("path", ["sigkill", "sigkill-no-spare", "gms-restart", "sigterm-server", "take-over"])
def test_every_restart_keeps_the_disk_tier_and_every_setting(tmp_path, path):
    """One restart once turned the disk tier off for good: the resumed node's event
    carried no disk budget.  After each way a server is replaced, the node is the
    same node (budgets, disk tier) and a commit to persist is saved."""
    server = serve(tmp_path, *SETTINGS, *(["--no-spare"] if path == "sigkill-no-spare" else []))
    before = _node(server.state())
    assert before[0] == 100 * MiB
    layout_hash, _ = publish(server.socket)
    saved(server)
    old = server.server_pid()
    if path == "take-over":
        new = serve(tmp_path, *SETTINGS, "--take-over", socket_path=server.socket)
        wait_until(lambda: server.proc.poll() is not None, timeout=30, what="the old keeper's exit")
        server = new
    elif path == "gms-restart":
        os.kill(server.pid, signal.SIGHUP)  # what `gms restart` sends the keeper
    else:
        os.kill(old, signal.SIGTERM if path == "sigterm-server" else signal.SIGKILL)
    wait_until(lambda: (s := state_or_none(server.socket)) is not None and s.pid != old, timeout=30,
               what=f"the next server\n{server.log}")
    assert _node(server.state()) == before, "a restart is the same node"
    assert server.layout().memory_layout_hash == layout_hash
    second_hash, _ = publish(server.socket, "second")
    saved(server, "second")
    assert server.layout("second").memory_layout_hash == second_hash


def test_a_failed_save_is_tried_again_and_lands_once_the_disk_takes_it(tmp_path):
    """Once, a save that failed was never tried again: a layout committed to persist
    was gone after a reboot though the disk had room by then.  RLIMIT_FSIZE on the
    server stands for a full disk; lifted, the next try saves (within the backoff)."""
    import resource

    server = serve(tmp_path)
    hard = resource.prlimit(server.server_pid(), resource.RLIMIT_FSIZE)[1]
    resource.prlimit(server.server_pid(), resource.RLIMIT_FSIZE, (7 * MiB, hard))  # the soft limit: liftable
    layout_hash, contents = publish(server.socket)
    failed = wait_until(lambda: [e for e in server.events() if e.kind == "SNAPSHOT_FAILED"], what="the failed save")
    assert "tried again in 1 s" in failed[0].fields["reason"], failed
    time.sleep(3.5)  # two more tries fail the same way: said once
    assert len([e for e in server.events() if e.kind == "SNAPSHOT_FAILED"]) == 1
    row = server.layout()  # waiting to be saved, and why: in gms status, its metrics and the history
    assert row.save_error == failed[0].fields["reason"] and row.disk_bytes == 0
    waiting = gms_cli("status", "--socket", server.socket).stdout
    assert "waiting: " in waiting, waiting
    resource.prlimit(server.server_pid(), resource.RLIMIT_FSIZE, (hard, hard))
    saved(server)  # the next try (at most 8 s after the last) lands
    assert server.layout().memory_layout_hash == layout_hash and server.layout().save_error == ""
    server = reboot(server, tmp_path)
    assert read(server.socket)[2] == contents, "what was committed to persist outlives the node"
    server.stop()


def test_a_snapshot_the_log_never_took_is_superseded_by_the_next_writer_of_its_layout(tmp_path):
    """Once, a snapshot a cold start refused (its owner gone from the policy) stayed
    unknown to the log; the layout was written again (not to persist), and a later
    cold start whose policy took the old snapshot served it: an older version over
    a newer one.  Now a writer's grant on the layout supersedes such files, also
    after a restart of the server in between."""
    uid = os.getuid()
    policy = tmp_path / "policy.toml"
    team = f'[[tenant]]\nname = "team"\nuids = [{uid}]\nwrite = ["*"]\nadmin = true\npersist = true\n'
    policy.write_text(team)
    server = serve(tmp_path, "--policy", str(policy))
    publish(server.socket, "weights", persist=None)
    saved(server)
    server.stop()
    policy.write_text(f'[[tenant]]\nname = "other"\nuids = [{uid}]\nwrite = ["*"]\nadmin = true\n')
    server = serve(tmp_path, "--policy", str(policy))
    assert server.layout().state == "EMPTY" and "left on disk" in server.log
    (left,) = [e for e in server.events() if e.kind == "SNAPSHOT_SET_ASIDE"]
    assert left.layout == "weights" and "may not write" in left.fields["reason"], left
    with pytest.raises(SnapshotNotServedError) as told:  # its reader is told at once, not kept waiting for ever
        GMSClientMemoryManager(server.socket, layout="weights").connect(RequestedLockType.RO)
    assert told.value.reason == left.fields["reason"], told.value
    old = server.server_pid()
    os.kill(server.pid, signal.SIGHUP)  # a restart between: the next server finds the file again
    wait_until(lambda: (s := state_or_none(server.socket)) is not None and s.pid != old, what="the next server")
    folder = server.state().disk_dir
    assert len(os.listdir(folder)) == 1
    publish(server.socket, "weights", persist=False)  # version 2, not to persist
    wait_until(lambda: not os.listdir(folder), what="the superseded snapshot gone")
    server.stop()
    policy.write_text(team)
    server = serve(tmp_path, "--policy", str(policy))
    assert server.layout().state == "EMPTY", "version 1 never comes back over version 2"
    server.stop()


def test_a_save_stamp_passes_every_snapshot_in_the_folder_whatever_the_clock(tmp_path):
    """A save made while the clock is behind must still win over older snapshots at
    the next cold start (of two, the higher stamp is kept): stamps never go back."""
    import time as _time

    from gms.disk.store import DiskStore

    folder = tmp_path / "disk"
    folder.mkdir(mode=0o700)
    ahead = _time.time_ns() + 86_400 * 10**9  # a snapshot saved while the clock was a day ahead
    (folder / fmt.file_name("weights", "h" * 64, ahead)).write_bytes(b"")
    store = DiskStore(str(folder))
    try:
        first = store.next_stamp()
        assert ahead < first < store.next_stamp()
    finally:
        store.close()


def test_a_fifo_named_like_a_snapshot_is_set_aside_not_waited_on(tmp_path):
    """Issue 60: a FIFO named ``*.gsnap`` in the folder hung the cold start (opening it waits for a writer)."""
    server = serve(tmp_path)
    folder = server.state().disk_dir
    server.stop()
    fifo = os.path.join(folder, fmt.file_name("weights", "f" * 64, 1))
    os.mkfifo(fifo, 0o600)
    server = serve(tmp_path)  # would time out waiting for the FIFO's writer
    assert server.layout().state == "EMPTY" and os.path.exists(fifo + ".corrupt")
    assert "not a regular file" in server.log
    server.stop()


def gms_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gms", *args], capture_output=True, text=True, timeout=60)


def test_gms_snapshots_lists_the_persisted_layouts_and_gms_delete_removes_one_for_good(tmp_path):
    """Issue 63: a verb lists persisted layouts and one deletes them (before, a
    snapshot could only be removed by hand, behind the log's back)."""
    server = serve(tmp_path)
    layout_hash, _ = publish(server.socket)
    publish(server.socket, "scratch", persist=False)
    path = saved(server)
    listed = gms_cli("snapshots", "--socket", server.socket, "--json")
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(r["layout"], r["disk_bytes"], r["memory_layout_hash"]) for r in rows] == [
        ("weights", os.path.getsize(path), layout_hash)
    ], listed
    assert "1 snapshots" in gms_cli("snapshots", "--socket", server.socket).stdout

    reader = GMSClientMemoryManager(server.socket, layout="weights")
    reader.connect(RequestedLockType.RO)
    held = gms_cli("delete", "weights", "--socket", server.socket)
    assert held.returncode == 1 and "NOT_EVICTABLE" in held.stderr, held
    assert os.path.exists(path) and server.layout().state == "RO", "refused: nothing lost"
    reader.close()
    wait_until(lambda: server.layout().state == "COMMITTED", what="the reader gone")

    done = gms_cli("delete", "weights", "--socket", server.socket)
    assert done.returncode == 0 and "deleted" in done.stdout, done
    assert server.layout().state == "EMPTY" and server.state().disk_used_bytes == 0
    wait_until(lambda: not os.path.exists(path), what="the snapshot removed")
    assert "LAYOUT_DELETED" in server.kinds()
    assert gms_cli("snapshots", "--socket", server.socket, "--json").stdout == ""
    ghost = gms_cli("delete", "ghost", "--socket", server.socket)
    assert ghost.returncode == 1 and "UNKNOWN_LAYOUT" in ghost.stderr, ghost
    assert server.layout("scratch").state == "COMMITTED", "the other layout is untouched"

    server = reboot(server, tmp_path)
    assert server.layout().state == "EMPTY", "a deleted layout does not come back at a reboot"
    server.stop()


@pytest.mark.parametrize("others", [False, True])
def test_gms_stop_purge_removes_the_snapshots_and_folders_and_nothing_else(tmp_path, others):
    """Issue 63: `gms stop` leaves the disk tier (that is its point); `--purge`
    removes it too, and the socket's folder once empty, but never a file gms did
    not make."""
    run = tmp_path / "run"
    run.mkdir()
    server = serve(tmp_path, socket_path=str(run / "gms.sock"))
    publish(server.socket)
    saved(server)
    disk_dir = server.state().disk_dir
    if others:
        (run / "notes.txt").write_text("a user's")
        with open(os.path.join(disk_dir, "notes.txt"), "w") as f:
            f.write("a user's")
    out = gms_cli("stop", "--purge", "--socket", server.socket)
    assert out.returncode == 0, out
    if others:
        assert os.listdir(disk_dir) == ["notes.txt"] and os.listdir(run) == ["gms.disk", "notes.txt"], out.stdout
        assert "kept it for what else is there: notes.txt" in out.stdout
    else:
        assert not run.exists(), out.stdout
        assert f"removed {disk_dir} and its 1 snapshot files" in out.stdout


@pytest.mark.parametrize("step, how, keeper", [
    ("granted", "kill", True), ("built", "kill", True), ("committed", "kill", True), ("saved", "kill", True),
    ("built", "stop", True), ("granted", "stop", False),
])
def test_a_node_that_dies_in_a_rebuild_comes_back_with_the_last_whole_snapshot_or_the_new_one(
    tmp_path, step, how, keeper,
):
    """Issue 60: a writer's RW_CONNECT clears the committed layout (the seed's rule)
    but not its snapshot, which stays until the new commit's is whole.  Every gms
    process killed (or stopped) at each step of a rebuild: the next cold start
    serves version 1 whole, or version 2 whole once its snapshot was; never neither.
    (The stop of a server without a keeper let the kept file go: the model-based
    machine found it.)"""
    server = serve(tmp_path, keeper=keeper)
    v1 = publish(server.socket, sizes=(5 * MiB,))
    first = saved(server)
    writer = GMSClientMemoryManager(server.socket, layout="weights")
    writer.connect(RequestedLockType.RW)
    row = server.layout()
    assert (row.state, row.disk_bytes, row.kept_bytes) == ("RW", 0, os.path.getsize(first)), "kept, still charged"
    assert server.state().disk_used_bytes == os.path.getsize(first)
    v2 = (None, [os.urandom(40 * MiB)])
    if step != "granted":
        va = writer.create_mapping(size=40 * MiB, tag="weights")
        writer.write(va, v2[1][0])
        writer.metadata_put("tensor.0", writer.mappings[-1].allocation_id, 0, b"meta0")
    if step in ("committed", "saved"):
        writer.commit(persist=True)
        v2 = (writer.get_memory_layout_hash(), v2[1])
    if step == "saved":
        wait_until(lambda: server.layout().disk_bytes > 0, what="version 2's snapshot")
        wait_until(lambda: not os.path.exists(first), what="version 1's snapshot released once 2's is whole")
    server = reboot(server, tmp_path, how, keeper=keeper)
    writer.abort()
    granted, layout_hash, contents = read(server.socket)
    assert granted.value == "RO", "never neither: the layout comes back from a whole snapshot"
    if step == "saved":
        assert (layout_hash, contents) == v2
    elif step == "committed":
        assert (layout_hash, contents) in (v1, v2), "version 1, or version 2 if its save was whole in time"
    else:
        assert (layout_hash, contents) == v1
    files = [n for n in os.listdir(server.state().disk_dir) if n.endswith(fmt.SUFFIX)]
    wait_until(lambda: len([n for n in os.listdir(server.state().disk_dir) if n.endswith(fmt.SUFFIX)]) == 1,
               what=f"one snapshot left of {files}")
    server.stop()


_WRITER = """
import sys, time
from gms import GMSClientMemoryManager, RequestedLockType
writer = GMSClientMemoryManager(sys.argv[1], layout="weights")
writer.connect(RequestedLockType.RW)
writer.create_mapping(size=3 << 20, tag="weights")
print("building", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("how", ["abort", "writer-killed", "gms-restart", "server-killed"])
def test_a_rebuild_that_ends_with_no_new_commit_brings_the_last_snapshot_back(tmp_path, how):
    """Issue 60: a writer's grant clears the committed layout but keeps its snapshot;
    a rebuild that then ends with no new commit (the writer aborts, dies, or the
    server is replaced under it) dropped that snapshot too: the node held nothing of a
    layout committed to persist.  Now the layout comes back from it, committed on the
    disk tier, its readers get version 1 whole, and the file is charged once."""
    server = serve(tmp_path)
    v1 = publish(server.socket, sizes=(5 * MiB,))
    first = saved(server)
    size = os.path.getsize(first)
    writer = None
    if how == "abort":
        writer = GMSClientMemoryManager(server.socket, layout="weights")
        writer.connect(RequestedLockType.RW)
        writer.create_mapping(size=3 * MiB, tag="weights")
    else:
        writer = subprocess.Popen([sys.executable, "-c", _WRITER, server.socket], stdout=subprocess.PIPE, text=True)
        assert writer.stdout.readline().strip() == "building"
    (listed,) = [json.loads(line) for line in gms_cli("snapshots", "--socket", server.socket, "--json").stdout.splitlines()]
    assert (listed["disk_bytes"], listed["kept_bytes"]) == (0, size), "gms snapshots: KEPT"
    old = server.server_pid()
    if how == "abort":
        writer.abort()
    elif how == "writer-killed":
        writer.kill()
    else:
        os.kill(server.pid if how == "gms-restart" else old, signal.SIGHUP if how == "gms-restart" else signal.SIGKILL)
        wait_until(lambda: (s := state_or_none(server.socket)) is not None and s.pid != old, timeout=30,
                   what=f"the next server\n{server.log}")
    wait_until(lambda: server.layout().state == "COMMITTED", what=f"the layout back from its snapshot\n{server.log}")
    row = server.layout()
    assert (row.tier, row.memory_layout_hash, row.disk_bytes, row.kept_bytes) == ("disk", v1[0], size, 0)
    assert server.state().disk_used_bytes == size, "the file is charged once"
    assert os.path.exists(first)
    kinds = server.kinds()
    assert kinds.index("LAYOUT_RECOVERED") > kinds.index("RW_ABORT"), kinds
    granted, layout_hash, contents = read(server.socket)  # an engine asking RW_OR_RO imports version 1
    assert (granted.value, (layout_hash, contents)) == ("RO", v1)
    if how != "abort":
        writer.kill()
        writer.wait()
    server = reboot(server, tmp_path)
    assert read(server.socket)[1:] == v1, "and after a reboot"
    server.stop()


def test_a_kept_snapshot_that_does_not_read_is_set_aside_when_the_rebuild_ends(tmp_path):
    """The snapshot kept through a rebuild is checked as at a cold start before it comes
    back: one truncated meanwhile is set aside, said in the history, and uncharged; the
    readers waiting for the rebuild's commit are told at once, and so is the next one."""
    server = serve(tmp_path)
    publish(server.socket, sizes=(5 * MiB,))
    first = saved(server)
    writer = GMSClientMemoryManager(server.socket, layout="weights")
    writer.connect(RequestedLockType.RW)
    os.truncate(first, os.path.getsize(first) // 2)
    told = []

    def queued_reader() -> None:  # waits for the rebuild's commit, no timeout of its own
        try:
            GMSClientMemoryManager(server.socket, layout="weights").connect(RequestedLockType.RO)
        except SnapshotNotServedError as exc:
            told.append(exc.reason)

    waiting = threading.Thread(target=queued_reader)
    waiting.start()
    wait_until(lambda: server.layout().waiting_readers > 0, what=f"the reader queued\n{server.log}")
    writer.abort()
    waiting.join(timeout=30)
    assert not waiting.is_alive(), "a reader nothing will grant is not kept waiting"
    assert len(told) == 1 and told[0].startswith("kept through a rebuild, does not read"), told
    aside = wait_until(lambda: [e for e in server.events() if e.kind == "SNAPSHOT_SET_ASIDE"], what="set aside")
    assert (aside[0].fields["file"], aside[0].layout) == (os.path.basename(first), "weights"), aside
    assert "kept through a rebuild, does not read" in aside[0].fields["reason"], aside
    assert os.path.exists(first + ".corrupt") and not os.path.exists(first)
    row = server.layout()
    assert (row.state, row.kept_bytes, server.state().disk_used_bytes) == ("EMPTY", 0, 0)
    assert row.unserved.startswith("kept through a rebuild, does not read"), row
    assert "not served: kept through a rebuild" in gms_cli("status", "--socket", server.socket).stdout
    reader = GMSClientMemoryManager(server.socket, layout="weights")  # told at once why nothing comes
    started = time.monotonic()
    with pytest.raises(SnapshotNotServedError, match="its last snapshot was not served, kept through a rebuild"):
        reader.connect(RequestedLockType.RO)
    assert time.monotonic() - started < 10, "answered, not kept till a timeout"
    timeouts = [e for e in server.events() if e.kind == "LOCK_TIMEOUT"]
    assert [e.fields["unserved"][:33] for e in timeouts] == ["kept through a rebuild, does not "] * 2, timeouts
    assert read(server.socket)[0].value == "RW", "nothing to import: the next engine builds it"
    assert server.layout().unserved == "", "a writer clears it"
    server.stop()


def test_a_rebuild_dropped_on_purpose_lets_the_kept_snapshot_go(tmp_path):
    """The kept snapshot goes, and its bytes leave the disk budget, when the rebuild
    commits asking for no snapshot (version 1 must never come back over version 2),
    or when its writer aborts with ``discard=True`` (a reader may not)."""
    server = serve(tmp_path)
    publish(server.socket, sizes=(5 * MiB,))
    first = saved(server)
    publish(server.socket, sizes=(5 * MiB,), persist=False)
    wait_until(lambda: not os.path.exists(first), what="the kept snapshot released by a commit asking for none")
    assert server.state().disk_used_bytes == 0
    server = reboot(server, tmp_path)
    assert server.layout().state == "EMPTY", "version 1 never comes back over version 2"
    publish(server.socket, sizes=(5 * MiB,))
    first = saved(server)
    reader = GMSClientMemoryManager(server.socket, layout="weights")
    reader.connect(RequestedLockType.RO)
    with pytest.raises(GMSUsageError, match="needs the RW lock"):
        reader.abort(discard=True)
    reader.close()
    writer = GMSClientMemoryManager(server.socket, layout="weights")
    writer.connect(RequestedLockType.RW)
    writer.abort(discard=True)
    wait_until(lambda: not os.path.exists(first), what="the kept snapshot discarded by its writer")
    assert (server.layout().state, server.state().disk_used_bytes) == ("EMPTY", 0)
    (aborted,) = [e for e in server.events() if e.kind == "RW_ABORT"]
    assert aborted.fields["discard"] is True
    assert "LAYOUT_RECOVERED" not in server.kinds()
    server.stop()


def test_set_aside_snapshots_are_bounded_the_newest_kept(tmp_path):
    """Issue 60: every cold start may set unreadable files aside; they were never
    removed.  The newest SET_ASIDE_KEPT (by the save stamp in their names) stay."""
    from gms.disk.store import SET_ASIDE_KEPT

    server = serve(tmp_path)
    folder = server.state().disk_dir
    server.stop()
    names = [fmt.file_name("weights", "e" * 64, stamp) for stamp in range(1, SET_ASIDE_KEPT + 3)]
    for name in names:
        with open(os.path.join(folder, name), "wb") as f:
            f.write(b"torn" * 1024)
    server = serve(tmp_path)
    left = sorted(n for n in os.listdir(folder) if n.endswith(".corrupt"))
    assert left == sorted(n + ".corrupt" for n in names[-SET_ASIDE_KEPT:]), left
    assert "older set-aside snapshots removed" in server.log
    server.stop()


def test_every_file_in_the_folder_counts_against_the_disk_budget(tmp_path):
    """Issue 60: set-aside and left-on-disk files were outside --disk-budget (128 MiB on
    disk against a 100 MiB budget).  They count as loose bytes now; a start or a save
    that needs their room removes them, set-aside ones first, the oldest first."""
    server = serve(tmp_path)
    folder = server.state().disk_dir
    server.stop()
    torn = [fmt.file_name("weights", "e" * 64, stamp) for stamp in (1, 2, 3)]
    for name in torn:  # three unreadable files of 4 MiB: set aside at the next start
        with open(os.path.join(folder, name), "wb") as f:
            f.write(os.urandom(4 * MiB))
    server = serve(tmp_path, "--disk-budget", "11MiB")
    state = server.state()
    assert state.disk_loose_bytes <= 11 * MiB, "a start keeps the folder under its budget"
    aside = sorted(n for n in os.listdir(folder) if n.endswith(".corrupt"))
    assert aside == [torn[1] + ".corrupt", torn[2] + ".corrupt"], "the oldest went first"
    assert state.disk_loose_bytes == 8 * MiB and "8.0 MiB set aside or left" in gms_cli(
        "status", "--socket", server.socket).stdout
    publish(server.socket, sizes=(5 * MiB,))  # 6 MiB aligned, and its manifest: one more set-aside file goes
    path = saved(server)
    state = server.state()
    assert state.disk_used_bytes == os.path.getsize(path)
    assert state.disk_used_bytes + state.disk_loose_bytes <= 11 * MiB
    assert sorted(n for n in os.listdir(folder) if n.endswith(".corrupt")) == [torn[2] + ".corrupt"]
    assert "removed (no layout holds it) to keep the folder under its budget" in server.log
    server.stop()


async def test_a_commit_waiting_to_be_saved_is_in_the_metrics_with_whether_it_failed(tmp_path):
    """gms_layout_unsaved (docs/operations.md): a server with no copier cannot save;
    the commit stands, waits, and says that its save failed."""
    import trio

    from gms.cuda.host import HostBackend
    from gms.server.config import ServerConfig
    from gms.server.server import Server
    from gms.wire import messages as m

    from .helpers import RawConn

    config = ServerConfig(socket_path=str(tmp_path / "gms.sock"), backend="host", copier=False,
                          disk_dir=str(tmp_path / "disk"))
    async with trio.open_nursery() as nursery:
        server = Server(config, backend=HostBackend(capacity=1 << 30), host_tier=HostBackend())
        await nursery.start(server.serve)
        writer = RawConn(config.socket_path)
        assert (await trio.to_thread.run_sync(writer.call, m.HandshakeRequest("RW", None, "weights"))).success
        assert (await trio.to_thread.run_sync(writer.call, m.CommitRequest("device", True))).success
        writer.close()
        with trio.fail_after(10):
            while not server.core.state.layout("weights").save_error:
                await trio.sleep(0.05)
        families = {f.name: f for f in server.metrics.registry.collect()}
        samples = [(s.labels, s.value) for s in families["gms_layout_unsaved"].samples]
        assert samples == [({"layout": "weights", "failing": "yes"}, 1)], samples
        assert "no copier" in server.core.state.layout("weights").save_error
        nursery.cancel_scope.cancel()
