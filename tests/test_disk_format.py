"""The disk tier's pure parts: the snapshot file's layout and manifest, and the
rules of its events (issue 52).  No server, no copier: the server-level tests
are tests/test_disk_tier.py."""

from __future__ import annotations

import zlib

import attrs
import msgpack
import pytest

from gms.disk import format as fmt
from gms.fsm import (
    InvalidArgument,
    NotEvictable,
    Rejection,
    StaleLayout,
    StateViolation,
    check_invariants,
    fold_all,
)
from gms.fsm.effects import may_make_room, released_memory
from gms.fsm.events import (
    AllocationCreated,
    LayoutDeleted,
    LayoutEvicted,
    LayoutLost,
    LayoutRecovered,
    MetadataPut,
    ResidencySet,
    RestoreAborted,
    RestoreClaimed,
    RestoreLoading,
    RwAbort,
    RwCommit,
    RwConnect,
    ServerStarted,
    SessionClosed,
    SessionOpened,
    SnapshotFailed,
    SnapshotSaved,
    SnapshotSetAside,
)
from gms.fsm.layout_hash import compute_layout_hash
from gms.fsm.queries import reverting, snapshot_rows, unsaved
from gms.fsm.releases import MemoryTier
from gms.fsm.state import Tier

MiB = 1 << 20
FILE = "ab" * 12 + "-" + "0" * 15 + "1.gsnap"


def manifest(**changes) -> fmt.Manifest:
    allocations = (("a0", 3 * MiB, 4 * MiB, "weights", 0), ("a1", 100, 4096, "weights", 1))
    extents = fmt.plan([a[2] for a in allocations], 2 * MiB)
    base = fmt.Manifest("llama", "f" * 64, "team", allocations, (("k", "a0", 0, b"\x00v"),),
                        tuple(attrs.evolve(e, crc=n) for n, e in enumerate(extents)), 2 * MiB, 123)
    return attrs.evolve(base, **changes)



@pytest.mark.parametrize("size", [0, 1, 4095, 5 * 1024 + 3, 3 * MiB + 17])
def test_the_checksum_is_zlibs_crc32_so_either_reads_the_others_files(size):
    """gms.checksum is zlib-ng's crc32 (a dependency: a bare install that lacks it falls back
    to the slower standard library's, and this says so); the same polynomial as zlib's."""
    import os

    from gms import checksum

    data = os.urandom(size)
    assert checksum.crc32(data) == zlib.crc32(data)
    assert checksum.crc32(data, 0x1234) == zlib.crc32(data, 0x1234)
    assert checksum.crc32(memoryview(data)[1:]) == zlib.crc32(data[1:])
    assert checksum.IMPLEMENTATION == "zlib-ng", "zlib-ng is a dependency: pip install -e . brings it"

def test_extents_tile_each_allocation_in_chunks_at_aligned_offsets():
    extents = fmt.plan([5 * MiB, 4096, 3 * MiB], 2 * MiB)
    assert [(e.allocation, e.offset, e.file_offset, e.size) for e in extents] == [
        (0, 0, 0, 2 * MiB), (0, 2 * MiB, 2 * MiB, 2 * MiB), (0, 4 * MiB, 4 * MiB, MiB),
        (1, 0, 5 * MiB, 4096),
        (2, 0, 5 * MiB + 4096, 2 * MiB), (2, 2 * MiB, 7 * MiB + 4096, MiB),
    ]
    assert all(e.file_offset % fmt.ALIGN == 0 for e in extents)
    assert fmt.plan([100, 100], 4096)[1].file_offset == 4096, "an odd size still starts the next aligned"
    with pytest.raises(ValueError):
        fmt.plan([MiB], 1000)


def test_a_manifest_reads_back_as_written_and_the_trailer_finds_it():
    m = manifest()
    at = m.data_bytes
    tail = fmt.encode(m, at)
    size = at + len(tail)
    version, where, length, crc = fmt.read_trailer(tail, size)
    assert (version, where, length) == (1, at, len(tail) - fmt.TRAILER.size)
    assert fmt.decode(tail[:length], version, crc) == m
    assert fmt.names_it(m, fmt.file_name("llama", "f" * 64, 123))
    assert not fmt.names_it(m, fmt.file_name("llama", "f" * 64, 124))
    body = fmt.encode(attrs.evolve(m, residency="system"), at)[: -fmt.TRAILER.size]
    assert fmt.decode(body, 1, zlib.crc32(body)).residency == "system"
    # A manifest from before the residency was kept: unpinned.
    raw = msgpack.unpackb(tail[:length])
    del raw["residency"]
    older = msgpack.packb(raw, use_bin_type=True)
    assert fmt.decode(older, 1, zlib.crc32(older)).residency == "unpinned"


@pytest.mark.parametrize("damage", ["magic", "version", "length", "crc", "extents", "types"])
def test_a_damaged_manifest_or_trailer_is_refused_by_name(damage):
    m = manifest()
    at = m.data_bytes
    tail = bytearray(fmt.encode(m, at))
    size = at + len(tail)
    body_len = len(tail) - fmt.TRAILER.size
    if damage == "magic":
        tail[body_len] ^= 1
    elif damage == "version":
        tail[body_len + 8] = 7
    elif damage == "length":
        size += 4096  # the file is longer than the trailer says
    elif damage == "crc":
        tail[3] ^= 1
    if damage in ("extents", "types"):
        bad = attrs.evolve(m, extents=m.extents[1:]) if damage == "extents" else attrs.evolve(m, owner=7)
        tail = bytearray(fmt.encode(bad, at))
        size = at + len(tail)
    expected = fmt.UnsupportedSnapshot if damage == "version" else fmt.CorruptSnapshot
    with pytest.raises(expected):
        version, where, length, crc = fmt.read_trailer(bytes(tail), size)
        fmt.decode(bytes(tail[:length]), version, crc)


def test_a_manifest_whose_sizes_do_not_fit_its_file_is_refused_before_it_is_planned():
    """Issue 60: a crafted manifest (a valid crc) with a 1 TiB allocation in 4 KiB chunks
    OOM-killed the server at every cold start: the plan (2^28 extents) was built first."""
    m = manifest()
    at = m.data_bytes
    huge = attrs.evolve(m, allocations=(("a0", 1 << 40, 1 << 40, "w", 0),), chunk_bytes=4096, extents=m.extents[:1])
    body = fmt.encode(huge, at)[: -fmt.TRAILER.size]
    with pytest.raises(fmt.CorruptSnapshot, match="need 1099511627776 bytes of data"):
        fmt.decode(body, 1, zlib.crc32(body), data_end=at)
    with pytest.raises(fmt.CorruptSnapshot, match="extents do not cover"):  # the file's own size unknown
        fmt.decode(body, 1, zlib.crc32(body))
    body = fmt.encode(m, at)[: -fmt.TRAILER.size]
    assert fmt.decode(body, 1, zlib.crc32(body), data_end=at) == m
    with pytest.raises(fmt.CorruptSnapshot):  # a data region longer than its allocations
        fmt.decode(body, 1, zlib.crc32(body), data_end=at + fmt.ALIGN)


# -- the rules of the disk tier's events ----------------------------------------------------


def started(disk_budget=64 * MiB, quota=None, disk_quota=None):
    return [
        ServerStarted(0, 256 * MiB, None, None, {"team": quota}, {}, layout="",
                      tenant_limits={"team": {"disk_quota": disk_quota}}, disk_budget_bytes=disk_budget),
    ]


def built(persist=True, residency="device", name="llama"):
    events = [SessionOpened(1, "team", 1000, 1000, 1, "RW", layout=name), RwConnect(1, layout=name),
              AllocationCreated(1, "a0", 3 * MiB, 4 * MiB, "weights", 0, layout=name),
              MetadataPut(1, "k", "a0", 0, b"v", layout=name)]
    state = fold_all(started() + events).layout(name)
    digest = compute_layout_hash(state.allocations.values(), state.metadata.values())
    return events + [RwCommit(1, digest, residency, persist, layout=name), SessionClosed(1, layout=name)], digest


def test_a_snapshot_is_saved_only_of_a_layout_committed_to_persist_with_its_hash():
    events, digest = built(persist=False)
    node = fold_all(started() + events)
    assert unsaved(node) == []
    with pytest.raises(StateViolation, match="not committed to persist"):
        fold_all([SnapshotSaved(0, digest, 5 * MiB, FILE, layout="llama")], node)
    events, digest = built()
    node = fold_all(started() + events)
    assert unsaved(node) == ["llama"]
    with pytest.raises(StaleLayout):
        fold_all([SnapshotSaved(0, "0" * 64, 5 * MiB, FILE, layout="llama")], node)
    with pytest.raises(InvalidArgument, match="file name"):
        fold_all([SnapshotSaved(0, digest, 5 * MiB, "../../etc/passwd", layout="llama")], node)
    node = fold_all([SnapshotSaved(0, digest, 5 * MiB, FILE, layout="llama")], node)
    check_invariants(node)
    assert (node.disk_bytes, node.tenants["team"].disk_bytes, unsaved(node)) == (5 * MiB, 5 * MiB, [])
    with pytest.raises(StateViolation, match="has a snapshot"):
        fold_all([SnapshotSaved(0, digest, 5 * MiB, FILE, layout="llama")], node)


@pytest.mark.parametrize("budget, quota, limit", [(4 * MiB, None, "disk_budget"), (None, 4 * MiB, "disk_quota")])
def test_the_disk_budget_and_a_tenants_disk_quota_bound_its_snapshots(budget, quota, limit):
    events, digest = built()
    node = fold_all([ServerStarted(0, 256 * MiB, None, None, {"team": None}, {}, layout="",
                                   tenant_limits={"team": {"disk_quota": quota}}, disk_budget_bytes=budget)] + events)
    with pytest.raises(Rejection) as refused:
        fold_all([SnapshotSaved(0, digest, 5 * MiB, FILE, layout="llama")], node)
    assert refused.value.limit == limit


def test_a_server_without_a_disk_tier_refuses_a_commit_that_persists():
    events, _ = built()
    with pytest.raises(StateViolation, match="no disk tier"):
        fold_all(started(disk_budget=0) + events)


def test_an_unpinned_saved_layout_is_evicted_to_disk_restored_from_it_and_a_writer_drops_it():
    events, digest = built(residency="unpinned")
    node = fold_all(started() + events + [SnapshotSaved(0, digest, 5 * MiB, FILE, layout="llama")])
    node = fold_all([LayoutEvicted(0, "admin", layout="llama")], node)
    layout = node.layout("llama")
    assert (layout.tier.value, node.gpu_bytes, node.disk_bytes) == ("disk", 0, 5 * MiB)
    reader = [SessionOpened(2, "team", 1000, 1000, 2, "RO", layout="llama"), RestoreClaimed(2, layout="llama"),
              RestoreLoading(2, layout="llama")]
    restoring = fold_all(reader, node)
    assert restoring.gpu_bytes == 4 * MiB
    aborted = fold_all([RestoreAborted(2, layout="llama")], restoring)
    assert (aborted.layout("llama").tier.value, aborted.gpu_bytes) == ("disk", 0), "back on disk, nothing half served"
    check_invariants(aborted)
    writer = [SessionOpened(3, "team", 1000, 1000, 3, "RW", layout="llama")]
    before = fold_all(writer, node)
    released = released_memory(before, RwConnect(3, layout="llama"))
    assert released == [], "a writer's grant keeps the snapshot until a newer one is whole"
    rebuilding = fold_all([RwConnect(3, layout="llama")], before)
    assert (rebuilding.disk_bytes, rebuilding.layout("llama").kept_file) == (5 * MiB, FILE)


FILE2 = "abababababababababababab-0000000000000002.gsnap"


def rebuild(node, conn=3, tenant="team", persist=True, commit=True):
    """A second writer rebuilds the layout the same way (same hash), committing or not."""
    events = [SessionOpened(conn, tenant, 1000, 1000, conn, "RW", layout="llama"), RwConnect(conn, layout="llama"),
              AllocationCreated(conn, "b0", 3 * MiB, 4 * MiB, "weights", 0, layout="llama"),
              MetadataPut(conn, "k", "b0", 0, b"v", layout="llama")]
    node = fold_all(events, node)
    if commit:
        layout = node.layout("llama")
        digest = compute_layout_hash(layout.allocations.values(), layout.metadata.values())
        node = fold_all([RwCommit(conn, digest, "device", persist, layout="llama")], node)
    check_invariants(node)
    return node


def disk_releases(node, event):
    return [r.allocation_id for r in released_memory(node, event) if r.tier is MemoryTier.DISK]


def test_the_last_whole_snapshot_is_kept_through_a_rebuild_until_a_newer_one_is_whole():
    """Issue 60: RW_CONNECT clears the committed layout (the seed's rule), but its
    snapshot stays on disk, charged to its saver, until the new commit's snapshot is
    whole: a node that dies at any step of a rebuild finds one whole snapshot."""
    events, digest = built()
    saved = fold_all(started() + events + [SnapshotSaved(0, digest, 5 * MiB, FILE, layout="llama")])
    building = rebuild(saved, commit=False)
    layout = building.layout("llama")
    assert (layout.kept_file, layout.kept_bytes, layout.kept_owner, layout.disk_bytes) == (FILE, 5 * MiB, "team", 0)
    assert (building.disk_bytes, building.tenants["team"].disk_bytes) == (5 * MiB, 5 * MiB), "still charged"
    committed = rebuild(saved)
    assert committed.layout("llama").kept_file == FILE, "kept while the new commit's save is pending"
    assert disk_releases(committed, SnapshotSaved(0, digest, 6 * MiB, FILE2, layout="llama")) == [FILE]
    after = fold_all([SnapshotSaved(0, digest, 6 * MiB, FILE2, layout="llama")], committed)
    check_invariants(after)
    assert (after.layout("llama").disk_file, after.layout("llama").kept_file, after.disk_bytes) == (FILE2, "", 6 * MiB)
    again = rebuild(committed, conn=4, commit=False)  # rebuilt again before that save: the last whole one stays
    assert again.layout("llama").kept_file == FILE
    # Dropped on purpose: a commit asking for no snapshot.
    writer = fold_all([SessionOpened(5, "team", 1000, 1000, 5, "RW", layout="llama"), RwConnect(5, layout="llama")],
                      saved)
    unasked = RwCommit(5, compute_layout_hash([], []), "device", False, layout="llama")
    assert disk_releases(writer, unasked) == [FILE]
    assert fold_all([unasked], writer).disk_bytes == 0


def test_an_unpinned_commit_to_persist_leaves_the_gpu_for_its_snapshot_not_for_nothing():
    """Evicting it before its save lands would lose the commit its writer was told
    persists (and the snapshot kept from before with it): refused while the save may
    land, evictable to disk once it has; a save that failed lets it go as an
    unpinned layout (dropped, with the kept snapshot: never the older bytes back)."""
    events, digest = built()
    saved = fold_all(started() + events + [SnapshotSaved(0, digest, 5 * MiB, FILE, layout="llama")])
    unpinned = fold_all([ResidencySet(0, "unpinned", layout="llama")], rebuild(saved, persist=True))
    evicted = LayoutEvicted(0, "admin", layout="llama")
    with pytest.raises(NotEvictable, match="being saved"):
        fold_all([evicted], unpinned)
    assert may_make_room(SnapshotSaved(0, digest, 6 * MiB, FILE2, layout="llama"))
    on_disk = fold_all([SnapshotSaved(0, digest, 6 * MiB, FILE2, layout="llama"), evicted], unpinned)
    layout = on_disk.layout("llama")
    assert (layout.tier, layout.disk_file, layout.kept_file, layout.committed) == (Tier.DISK, FILE2, "", True)
    failed = SnapshotFailed(0, unpinned.layout("llama").layout_hash, "no space left on device", layout="llama")
    assert may_make_room(failed)
    gave_up = fold_all([failed], unpinned)
    assert FILE in disk_releases(gave_up, evicted)
    dropped = fold_all([evicted], gave_up)
    assert (dropped.disk_bytes, dropped.layout("llama").committed) == (0, False)


def test_a_rebuild_that_ends_with_no_new_commit_leaves_the_kept_snapshot_to_come_back():
    """Its writer gone (RW_ABORT) or its commit's memory lost (LAYOUT_LOST): the
    layout is EMPTY but its kept snapshot stays, charged, for the disk tier to bring
    back (LAYOUT_RECOVERED of that file: charged once) or to set aside (uncharged)."""
    events, digest = built()
    saved = fold_all(started() + events + [SnapshotSaved(0, digest, 5 * MiB, FILE, layout="llama")])
    allocations, metadata = snapshot_rows(saved.layout("llama"))
    back = LayoutRecovered(0, "team", digest, allocations, metadata, 5 * MiB, FILE, "device", layout="llama")
    lost = LayoutLost(0, "its memory is gone", "", "gpu", layout="llama")
    for name, ended in [("abort", [RwAbort(3, layout="llama")]), ("lost", [lost])]:
        building = rebuild(saved, commit=name == "lost")
        assert disk_releases(building, ended[0]) == [], name
        left = fold_all(ended, building)
        check_invariants(left)
        layout = left.layout("llama")
        assert (layout.lock_state.value, layout.kept_file, left.disk_bytes, left.tenants["team"].disk_bytes) == (
            "EMPTY", FILE, 5 * MiB, 5 * MiB), name
        assert reverting(left) == ["llama"]
        recovered = fold_all([back], left)
        check_invariants(recovered)
        layout = recovered.layout("llama")
        assert (layout.lock_state.value, layout.tier.value, layout.layout_hash, layout.disk_file, layout.kept_file) == (
            "COMMITTED", "disk", digest, FILE, ""), name
        assert (recovered.disk_bytes, recovered.tenants["team"].disk_bytes, reverting(recovered)) == (
            5 * MiB, 5 * MiB, []), "charged once"
        gone = fold_all([SnapshotSetAside(0, FILE, "does not read", FILE + ".corrupt", layout="llama")], left)
        check_invariants(gone)
        assert (gone.layout("llama").unserved, gone.disk_bytes, gone.tenants["team"].disk_bytes) == (
            "does not read", 0, 0), "uncharged; its readers are told why"
        again = fold_all([SessionOpened(9, "team", 1000, 1000, 9, "RW", layout="llama"),
                          RwConnect(9, layout="llama")], gone)
        assert again.layout("llama").unserved == "", "a writer clears it"
    discarded = RwAbort(3, True, layout="llama")  # the writer drops it on purpose (AbortRequest.discard)
    building = rebuild(saved, commit=False)
    assert disk_releases(building, discarded) == [FILE]
    gone = fold_all([discarded], building)
    assert ("llama" in gone.layouts, gone.disk_bytes, reverting(gone)) == (False, 0, [])
    other = fold_all([SnapshotSetAside(0, FILE2, "does not read", layout="llama")], left)
    assert other.layout("llama").kept_file == FILE, "another file set aside lets nothing go"
    deleted = fold_all([LayoutDeleted(0, 0, layout="llama")], rebuild(saved))
    assert (deleted.disk_bytes, "llama" in deleted.layouts) == (0, False), "an admin's delete: every copy"


def test_a_kept_snapshot_stays_its_savers_charge_when_another_tenant_rebuilds():
    events, digest = built()
    node = fold_all([ServerStarted(0, 256 * MiB, None, None, {"team": None, "other": None}, {}, layout="",
                                   tenant_limits={"other": {"disk_quota": 6 * MiB}}, disk_budget_bytes=16 * MiB)]
                    + events + [SnapshotSaved(0, digest, 5 * MiB, FILE, layout="llama")])
    rebuilt = rebuild(node, tenant="other")
    assert (rebuilt.tenants["team"].disk_bytes, rebuilt.tenants["other"].disk_bytes) == (5 * MiB, 0)
    saved = fold_all([SnapshotSaved(0, digest, 6 * MiB, FILE2, layout="llama")], rebuilt)
    check_invariants(saved)
    assert (saved.tenants["team"].disk_bytes, saved.tenants["other"].disk_bytes, saved.disk_bytes) == (0, 6 * MiB, 6 * MiB)
    with pytest.raises(Rejection) as refused:  # the kept one is the saver's, not room in another's quota
        fold_all([SnapshotSaved(0, digest, 7 * MiB, FILE2, layout="llama")], rebuilt)
    assert refused.value.limit == "disk_quota"
    # The node's budget counts the kept snapshot as room the new one takes over.
    tight = fold_all([ServerStarted(0, 256 * MiB, None, None, {"team": None}, {}, layout="",
                                    tenant_limits={}, disk_budget_bytes=8 * MiB)] + events
                     + [SnapshotSaved(0, digest, 5 * MiB, FILE, layout="llama")])
    assert fold_all([SnapshotSaved(0, digest, 8 * MiB, FILE2, layout="llama")], rebuild(tight)).disk_bytes == 8 * MiB


def test_a_recovered_layout_is_the_committed_one_on_disk_and_checked_like_a_clients():
    events, digest = built()
    node = fold_all(started() + events)
    allocations, metadata = snapshot_rows(node.layout("llama"))
    recovered = LayoutRecovered(0, "team", digest, allocations, metadata, 5 * MiB, FILE, layout="llama")
    fresh = fold_all(started() + [recovered])
    check_invariants(fresh)
    layout = fresh.layout("llama")
    assert (layout.committed, layout.layout_hash, layout.tier.value, layout.residency.value) == (
        True, digest, "disk", "unpinned")
    assert (fresh.tenants["team"].used_bytes, fresh.gpu_bytes, fresh.disk_bytes) == (4 * MiB, 0, 5 * MiB)
    assert snapshot_rows(layout) == (allocations, metadata)
    for bad, error in [
        (attrs.evolve(recovered, layout_hash="0" * 64), "hash"),
        (attrs.evolve(recovered, owner="nobody"), "not configured"),
        (attrs.evolve(recovered, metadata=[["k", "zz", 0, b"v"]]), "outside"),
        (attrs.evolve(recovered, allocations=allocations * 2), "repeats"),
        (attrs.evolve(recovered, file="x.gsnap"), "file name"),
        (attrs.evolve(recovered, residency="sticky"), "residency"),
    ]:
        with pytest.raises(Rejection, match=error):
            fold_all(started() + [bad])
    with pytest.raises(Rejection, match="quota"):
        fold_all(started(quota=MiB) + [recovered])
    # Saved as system: it comes back system, with no host copy (its snapshot holds it).
    system = fold_all(started() + [attrs.evolve(recovered, residency="system")])
    check_invariants(system)
    assert (system.layout("llama").residency.value, dict(system.layout("llama").host_copies)) == ("system", {})
