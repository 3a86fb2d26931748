"""The hand-over as data, without servers: the state image and its versions, the
fd frames, a connection frozen and thawed, the keeper's store, a log that
goes on from another's, and what a resume records."""

from __future__ import annotations

import os
import socket
import threading

import msgpack
import pytest

from gms.fsm import (
    BudgetExceeded,
    InvariantViolation,
    Limits,
    StateViolation,
    check_invariants,
    decide_resume,
    fold_all,
    released_memory,
)
from gms.fsm.events import LayoutFellToDisk, LayoutLost, RwAbort, ServerResumed
from gms.handover import frames
from gms.handover.image import (
    READABLE_VERSIONS,
    STATE_VERSION,
    ImageError,
    UnsupportedVersion,
    decode_entries,
    decode_image,
    encode_entries,
    encode_image,
    image_version,
)
from gms.handover.words import Say
from gms.keeper.store import Store
from gms.store import EventLog, Snapshot
from gms.store.log import after_loss
from gms.wire import messages as m
from gms.wire.codec import encode
from gms.wire.connection import NEED_DATA, ServerConnection

from .handover_fixtures import FIXTURES, replay_saved, rich_image, rich_log

MiB = 1 << 20


# -- the image and its versions -------------------------------------------------------


def test_the_image_round_trips_every_kind_of_layout_session_and_wait():
    image = rich_image()
    again = decode_image(encode_image(image))
    assert again == image
    check_invariants(again.state)
    assert encode_image(again) == encode_image(image), "the encoding is deterministic"


@pytest.mark.parametrize("version", sorted(FIXTURES))
def test_a_frozen_image_of_every_version_still_reads_back_to_its_node(version):
    """tests/fixtures/state_v<N>.bin was written by version N and never again: whatever
    the current version, a server reads it (version 1: the previous state version's test)."""
    data = FIXTURES[version].read_bytes()
    assert image_version(data) == version and version in READABLE_VERSIONS
    image = decode_image(data)
    assert _as_today(image) == _as_today(rich_image(version))
    check_invariants(image.state)
    weights = image.state.layout("weights")
    assert (sorted(weights.allocations), weights.readers, weights.committed) == (["w0", "w1"], {4}, True)
    assert image.state.layout("warm").restorer == 5 and image.state.layout("kv").writer == 6
    assert [c.pending.kind if c.pending else None for c in image.conns] == [None, None, "allocate", "lock", "lock", None]
    if version == STATE_VERSION:
        assert encode_image(image) == data, "the current version writes today what it wrote then"


def _as_today(image):
    """The image with each connection's request in service re-encoded as this
    version encodes it (a request gains optional fields: the fixture's bytes,
    written before, lack them; the request is the same)."""
    import attrs

    from gms.wire import decode
    from gms.wire.codec import encode_body

    def today(conn):
        serving = conn.protocol.serving
        if serving:
            serving = encode_body(decode(serving))
        return attrs.evolve(conn, protocol=attrs.evolve(conn.protocol, serving=serving))

    return attrs.evolve(image, conns=tuple(today(c) for c in image.conns))


def test_a_version_1_node_reads_with_its_counts_and_no_bounds():
    """Version 1 came before issue 21: its tenants had no metadata quota or layout
    bound (None: unbounded until the new server's SERVER_RESUMED sets them), and
    the counts those bounds keep are recounted from the layouts and sessions."""
    state = decode_image(FIXTURES[1].read_bytes()).state
    default, team = state.tenants["default"], state.tenants["team"]
    assert (default.metadata_quota, default.max_layouts, team.metadata_quota, team.max_layouts) == (None,) * 4
    assert dict(default.layout_refs) == {"weights": 2, "kv": 2}, "owned, plus a writer's session each"
    assert dict(team.layout_refs) == {"cold": 1, "warm": 1}
    assert state.metadata_bytes == default.metadata_bytes + team.metadata_bytes > 0
    assert state.limits.max_metadata_bytes is None and state.limits.max_layouts == 16
    assert state == rich_log(1).state, "exactly what folding the same events gives today"


def test_a_version_this_server_does_not_read_is_refused_naming_both():
    body = msgpack.packb([b"gms-state", 99, b"whatever"])
    with pytest.raises(UnsupportedVersion, match=r"version 99.*reads version\(s\) 1, 2"):
        decode_image(body)
    with pytest.raises(UnsupportedVersion):
        encode_image(rich_image(), 99)


def test_bytes_that_are_no_image_or_a_broken_one_are_refused():
    for junk in (b"", b"\x00\x01", msgpack.packb([b"other", 1, b""]), msgpack.packb({"a": 1})):
        with pytest.raises(ImageError):
            decode_image(junk)
    for version in READABLE_VERSIONS:
        broken = msgpack.packb([b"gms-state", version, msgpack.packb({"server": [1]})])
        with pytest.raises(ImageError, match=f"version-{version} state image that does not parse"):
            decode_image(broken)
    with pytest.raises(UnsupportedVersion):
        encode_image(rich_image(1), 1)  # an older version is read, never written


def test_log_entries_travel_with_their_numbers_times_and_every_field():
    log = rich_log()
    entries = list(log.entries())
    assert decode_entries(encode_entries(entries)) == entries
    with pytest.raises(ImageError, match="cannot read"):
        decode_entries(msgpack.packb([[1, 0, 0, "NO_SUCH_EVENT", {}]]))


# -- a log that goes on ---------------------------------------------------------------


def test_a_resumed_log_goes_on_with_the_next_number_and_replays():
    log = rich_log()
    entries = list(log.entries())
    cut = 20
    snapshot_state = fold_all(e.event for e in entries[:cut])
    resumed = EventLog.resumed(Snapshot(cut, snapshot_state), entries[cut:], retain=None)
    assert resumed.state == log.state and resumed.first_seq == cut + 1 and resumed.last_seq == log.last_seq
    assert resumed.entry(cut + 1) == entries[cut], "numbers and times kept"
    (appended,) = resumed.extend([RwAbort(6, layout="kv")])
    assert appended.seq == log.last_seq + 1
    assert resumed.replay() == resumed.state
    with pytest.raises(ValueError, match="cannot follow"):
        EventLog.resumed(Snapshot(cut, snapshot_state), entries[cut + 1 :])


def test_a_journal_across_a_restarts_gap_rebuilds_and_replays(tmp_path):
    """A restart after a crash numbers past its gap (gms.store.log): the next
    server rebuilds that journal, and `gms replay` reads it, gap and all."""
    log = rich_log()
    cut, last = 20, log.last_seq
    log.skip_lost()
    log.extend(decide_resume(log.state, _resumed(log.state, follows_seq=last)))
    entries = list(log.entries())
    assert entries[-len(log.since(last)) - 1].seq == last and log.since(last)[0].seq == after_loss(last)
    base = fold_all(e.event for e in entries[:cut])
    rebuilt = EventLog.resumed(Snapshot(cut, base), entries[cut:], retain=None)
    assert (rebuilt.state, rebuilt.last_seq) == (log.state, log.last_seq)
    replayed = replay_saved(tmp_path, entries, cut)
    assert (replayed.state, replayed.last_seq) == (log.state, log.last_seq)


# -- what a resume records -------------------------------------------------------------


def _resumed(state, mode="restart", **changes) -> ServerResumed:
    config = dict(
        capacity_bytes=state.capacity_bytes, budget_bytes=state.budget_bytes,
        host_budget_bytes=state.host_budget_bytes, quotas={"default": None, "team": 40 * MiB},
        limits=state.limits.as_dict(),
        tenant_limits={name: {"metadata_quota": t.metadata_quota, "max_layouts": t.max_layouts}
                       for name, t in state.tenants.items()},
    )
    config.update(changes)
    return ServerResumed(0, mode, 4242, "SIGKILL", 2, layout="", **config)


def test_a_restart_disconnects_every_dead_session_in_order_and_keeps_the_committed_node():
    state = rich_log().state
    events = decide_resume(state, _resumed(state))
    kinds = [(e.KIND, e.conn) for e in events]
    assert kinds == [
        ("SERVER_RESUMED", 0), ("READER_LEFT", 4), ("RESTORE_ABORTED", 5),
        ("SESSION_CLOSED", 5), ("RW_ABORT", 6), ("SESSION_CLOSED", 6), ("SESSION_CLOSED", 7), ("SESSION_CLOSED", 8),
    ]
    after = fold_all(events, state)
    check_invariants(after)
    assert sorted(after.layouts) == ["cold", "parked", "rebuilt", "warm", "weights"], "the build is dropped"
    assert after.layout("warm").tier.value == "host", "a half-done restore goes back to the host tier"
    for name in ("cold", "warm", "weights"):
        before, now = state.layout(name), after.layout(name)
        assert (now.allocations, now.metadata, now.layout_hash, now.residency) == (
            before.allocations, before.metadata, before.layout_hash, before.residency,
        )


def test_a_take_over_keeps_every_session_and_lock():
    state = rich_log().state
    (event,) = decide_resume(state, _resumed(state, "take-over"))
    after = fold_all([event], state)
    assert (after.sessions, after.layouts) == (state.sessions, state.layouts)


def test_memory_found_lost_drops_its_whole_layout_unless_its_snapshot_holds_it():
    state = rich_log().state
    events = decide_resume(state, _resumed(state), [("gpu", "w1"), ("host", "c0"), ("gpu", "k0")], "reset")
    gone = [e for e in events if isinstance(e, LayoutLost | LayoutFellToDisk)]
    assert [(e.KIND, e.layout, e.allocation_id, e.tier) for e in gone] == [
        ("LAYOUT_FELL_TO_DISK", "weights", "w1", "gpu"), ("LAYOUT_LOST", "cold", "c0", "host"),
    ], "weights is saved: its snapshot holds it; cold has none"
    after = fold_all(events, state)
    check_invariants(after)
    assert sorted(after.layouts) == ["parked", "rebuilt", "warm", "weights"], "parked is on disk only: no memory to lose"
    weights = after.layout("weights")
    before = state.layout("weights")
    assert (weights.tier.value, weights.committed, weights.gpu_bytes, weights.host_bytes) == ("disk", True, 0, 0)
    assert (weights.layout_hash, weights.disk_file, weights.metadata) == (
        before.layout_hash, before.disk_file, before.metadata)
    released = {(r.tier.value, r.allocation_id) for e in gone for r in released_memory(
        fold_all(events[: events.index(e)], state), e)}
    assert released == {("gpu", "w0"), ("gpu", "w1"), ("host", "c0")}, "the memory left goes; the snapshot stays"


def test_a_new_configuration_that_cannot_hold_the_node_is_refused_and_a_tenant_s_quota_is_applied():
    state = rich_log().state
    with pytest.raises(BudgetExceeded, match="more than the new GPU budget"):
        fold_all(decide_resume(state, _resumed(state, budget_bytes=MiB)), state)
    with pytest.raises(StateViolation, match="keeps no host tier"):
        fold_all(decide_resume(state, _resumed(state, host_budget_bytes=0)), state)
    lowered = fold_all(decide_resume(state, _resumed(state, quotas={"team": MiB})), state)
    check_invariants(lowered)  # applied, not refused (issue 48): the tenant holds what it held
    assert lowered.tenants["team"].used_bytes > MiB and lowered.tenants["team"].over_bounds == ("quota",)
    grown = fold_all(decide_resume(state, _resumed(state, quotas={"new": 5, "team": None}, budget_bytes=None)), state)
    assert grown.tenants["new"].quota_bytes == 5 and grown.tenants["team"].quota_bytes is None
    assert grown.tenants["default"].quota_bytes is None, "a tenant the new policy drops keeps its entry"
    with pytest.raises(InvariantViolation):
        fold_all([_resumed(state)])  # never the first event


def test_a_new_configuration_brings_its_metadata_and_layout_bounds():
    """Issue 21's bounds: the new server's replace the old one's (a version-1 node
    had none); bounds lowered under what the node holds are applied (issue 48)."""
    old = decode_image(FIXTURES[1].read_bytes()).state
    tenant_limits = {"default": {"metadata_quota": 4096, "max_layouts": 8}}
    after = fold_all(decide_resume(old, _resumed(old, tenant_limits=tenant_limits)), old)
    check_invariants(after)
    assert (after.tenants["default"].metadata_quota, after.tenants["default"].max_layouts) == (4096, 8)
    assert after.tenants["team"].metadata_quota is None, "a tenant the new limits do not name: unbounded"
    assert after.limits.max_metadata_bytes == old.limits.max_metadata_bytes
    state = rich_log().state
    lowered = fold_all(decide_resume(state, _resumed(state, limits={**state.limits.as_dict(), "max_metadata_bytes": 8})),
                       state)
    check_invariants(lowered)  # applied (issue 48): the node holds what it held, and cannot grow
    assert lowered.metadata_bytes == state.metadata_bytes > lowered.limits.max_metadata_bytes == 8
    # A new charge per metadata entry (an older server's node, none): every owner recounted.
    old_node = rich_log(2).state
    assert old_node.limits.metadata_entry_bytes == 0
    charged = fold_all(decide_resume(old_node, _resumed(old_node, limits=Limits().as_dict())), old_node)
    check_invariants(charged)
    entries = sum(len(layout.metadata) for layout in old_node.layouts.values())
    assert charged.metadata_bytes == old_node.metadata_bytes + entries * Limits().metadata_entry_bytes
    # A tenant's own bounds lowered under what it holds are applied (issue 48).
    small = {"team": {"metadata_quota": 8, "max_layouts": None}}
    after = fold_all(decide_resume(state, _resumed(state, tenant_limits=small)), state)
    check_invariants(after)
    assert after.tenants["team"].over_bounds == ("metadata_quota",)
    one = {"default": {"metadata_quota": None, "max_layouts": 1}}
    after = fold_all(decide_resume(state, _resumed(state, "take-over", tenant_limits=one)), state)
    check_invariants(after)
    assert after.tenants["default"].over_bounds == ("max_layouts",)
    # After a crash the dead writers' sessions close: default keeps only what it owns.
    two = {"default": {"metadata_quota": None, "max_layouts": 1}}
    after = fold_all(decide_resume(state, _resumed(state, tenant_limits=two)), state)
    check_invariants(after)
    assert dict(after.tenants["default"].layout_refs) == {"weights": 1, "rebuilt": 1}


# -- the connection object -------------------------------------------------------------


def test_a_connection_frozen_mid_wait_goes_on_where_it_stopped():
    conn = ServerConnection(1 << 20)
    conn.receive_data(encode(m.HandshakeRequest("RO", 500, "weights")))
    request = conn.next_request()
    nxt = encode(m.MetadataGetRequest("t0"))
    conn.receive_data(nxt[:7])  # read ahead while it waits: part of the next request
    frozen = conn.freeze()
    thawed = ServerConnection.thaw(1 << 20, frozen)
    assert thawed.serving == request and thawed.next_request() is NEED_DATA
    thawed.send(m.HandshakeResponse(True, True, "RO"))
    thawed.receive_data(nxt[7:])
    assert thawed.next_request() == m.MetadataGetRequest("t0")
    assert thawed.handshaken and thawed.requests == 2
    idle = ServerConnection.thaw(1 << 20, ServerConnection(1 << 20).freeze())
    assert idle.next_request() is NEED_DATA and idle.serving is None


# -- frames with fds ----------------------------------------------------------------------


def test_fds_ride_with_their_own_frame_in_batches_of_at_most_253():
    here, there = socket.socketpair()
    made = [os.memfd_create(f"t{i}") for i in range(600)]
    try:
        for i, fd in enumerate(made):
            os.ftruncate(fd, i + 1)
        def send() -> None:  # more than the socket buffers: a thread writes while we read
            frames.send_frame(here, "image", {"image": b"x" * 300_000})
            frames.send_fds(here, "fds", [(f"gpu:{i}", fd) for i, fd in enumerate(made)])
            frames.send_frame(here, "end")
            here.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=send)
        sender.start()
        reader = frames.FrameReader()
        got = [frames.recv_frame(there, reader) for _ in range(5)]
        sender.join()
        assert [f.kind for f in got] == ["image", "fds", "fds", "fds", "end"]
        assert [len(f.fds) for f in got] == [0, 253, 253, 94, 0]
        keyed = dict(zip((k for f in got for k in f.body.get("keys", [])), (fd for f in got for fd in f.fds)))
        assert [os.fstat(keyed[f"gpu:{i}"]).st_size for i in range(600)] == list(range(1, 601))
        with pytest.raises(frames.ChannelClosed):
            frames.recv_frame(there, reader)
        for f in got:
            f.close_fds()
    finally:
        for fd in made:
            os.close(fd)
        here.close()
        there.close()


def test_a_frame_cut_short_or_without_its_fds_breaks_the_channel():
    reader = frames.FrameReader()
    data = frames.encode_frame("hold", {"keys": ["a"]}, nfds=1)
    reader.feed(data)  # the fd never came
    with pytest.raises(frames.FrameError, match="announced 1 fds"):
        reader.next_frame()
    cut = frames.FrameReader()
    cut.feed(frames.encode_frame("events", {"entries": b"abc"})[:-2])
    assert cut.next_frame() is None
    cut.feed(b"")
    with pytest.raises(frames.FrameError, match="inside a frame"):
        cut.next_frame()


# -- the keeper's store ----------------------------------------------------------------------


def _memfd() -> int:
    return os.memfd_create("keeper-test")


def test_the_keeper_keeps_what_the_server_says_and_hands_it_back():
    told = []
    store = Store(on_fd=lambda key, fd: told.append((key, fd is not None)))
    listener, a, b = _memfd(), _memfd(), _memfd()
    body, fds = store.handback()
    assert (body, fds) == ({"mode": "fresh", "features": ["parts"]}, [])
    store.apply(frames.Frame("hold", {"keys": ["listener", "gpu:a", "gpu:b"]}, (listener, a, b)))
    store.apply(frames.Frame("base", {"image": b"IMG", "keys": ["listener", "gpu:a", "gpu:b"]}))
    store.apply(frames.Frame("events", {"entries": b"E1"}))
    store.apply(frames.Frame("release", {"keys": ["gpu:b"]}))
    store.apply(frames.Frame("events", {"entries": b"E2"}))
    with pytest.raises(OSError):
        os.fstat(b)  # the keeper closed its copy
    assert store.apply(frames.Frame("ready", {})) == "ready"
    body, fds = store.handback()
    assert body["mode"] == "resume" and body["base"] == b"IMG" and body["tails"] == [b"E1", b"E2"]
    assert [k for k, _ in fds] == ["gpu:a", "listener"]
    store.apply(frames.Frame("base", {"image": b"IMG2", "keys": ["listener"]}))  # a base drops the rest
    assert sorted(store.fds) == ["listener"] and store.tails == []
    assert ("gpu:b", False) in told and ("gpu:a", False) in told
    assert store.apply(frames.Frame("stopping", {"why": "taken-over"})) is Say.STOPPING
    store.drop_node(keep_listener=False)
    store.retired = True
    assert store.handback() == ({"mode": "retired", "features": ["parts"]}, []) and not store.fds


def test_a_base_in_parts_replaces_only_what_changed_and_keeps_the_events_after_it():
    """gms.handover.journal: a base names every part, sends only the changed ones,
    and says how many of the events sent while it was made come after it."""
    store = Store()
    store.apply(frames.Frame("part", {"key": "head", "data": b"H1"}))
    store.apply(frames.Frame("part", {"key": "l:a", "data": b"A1"}))
    store.apply(frames.Frame("base", {"parts": ["head", "l:a"]}))
    store.apply(frames.Frame("events", {"entries": b"E1"}))
    store.apply(frames.Frame("part", {"key": "head", "data": b"H2"}))  # made while events went on
    store.apply(frames.Frame("events", {"entries": b"E2"}))
    store.apply(frames.Frame("part", {"key": "l:b", "data": b"B2"}))
    store.apply(frames.Frame("events", {"entries": b"E3"}))
    store.apply(frames.Frame("base", {"parts": ["head", "l:a", "l:b"], "tails": 2}))
    body, _ = store.handback()
    assert body["base"] == {"head": b"H2", "l:a": b"A1", "l:b": b"B2"}, "the unchanged part kept, the same bytes"
    assert body["tails"] == [b"E2", b"E3"], "events after the base kept, those before it dropped"
    store.apply(frames.Frame("part", {"key": "l:c", "data": b"C"}))
    store.apply(frames.Frame("events", {"entries": b"E4"}))
    # The server died while a base was on its way: the staged part is no base of anyone's.
    assert store.handback()[0]["base"] == {"head": b"H2", "l:a": b"A1", "l:b": b"B2"}
    with pytest.raises(ValueError, match="never sent"):
        store.apply(frames.Frame("base", {"parts": ["head", "l:zzz"]}))


def test_a_release_asked_to_be_acknowledged_is_said_once_its_fds_are_closed():
    store = Store()
    fd = _memfd()
    store.apply(frames.Frame("hold", {"keys": ["gpu:a"]}, (fd,)))
    assert store.apply(frames.Frame("release", {"keys": ["gpu:a"], "ack": True})) == "released"
    with pytest.raises(OSError):
        os.fstat(fd)
    assert store.apply(frames.Frame("release", {"keys": []})) is None


def test_a_take_over_s_node_stays_provisional_until_confirmed():
    store = Store()
    fd = _memfd()
    store.apply(frames.Frame("hold", {"keys": ["gpu:a"]}, (fd,)))
    store.apply(frames.Frame("base", {"image": b"IMG", "keys": ["gpu:a"], "provisional": 77}))
    assert store.handback()[0]["provisional"] == 77
    store.apply(frames.Frame("confirm", {}))
    assert "provisional" not in store.handback()[0]
    store.close()


def test_the_image_carries_every_field_of_the_state():
    """A field added to a state class that the image does not carry would be
    lost at every take-over and restart: extend the format (a new version, a
    reader for this one) along with the class.  This test names what to do."""
    import attrs

    from gms.fsm import Limits, NodeState, SessionInfo, TenantState
    from gms.fsm.state import Allocation, LayoutState, MetadataEntry
    from gms.handover import image as codec

    body = codec._body_v4(rich_image())["node"]
    derived = {"keys_by_allocation"}  # rebuilt from the metadata on reading
    assert {f.name for f in attrs.fields(NodeState)} == set(body), "NodeState vs the image's node"
    # version 5: a "kept" row, a "save_error" and "unserved", each only where a layout has one
    kept = {"kept_file", "kept_bytes", "kept_owner", "save_error", "unserved"}
    rows = {row["name"]: row for row in body["layouts"]}
    assert {f.name for f in attrs.fields(LayoutState)} - derived - kept == set(rows["weights"])
    assert set(rows["rebuilt"]) == set(rows["weights"]) | {"kept"}
    unserved = LayoutState("torn", unserved="does not read: its manifest is torn")
    assert codec._read_layout_v1(codec.layout_head(unserved) | {"allocations": [], "metadata": []}) == unserved
    assert [f.name for f in attrs.fields(TenantState)] == [
        "name", "quota_bytes", "used_bytes", "sessions", "metadata_quota", "metadata_bytes", "max_layouts",
        "layout_refs", "disk_quota", "disk_bytes",
    ]
    assert len(body["tenants"][0]) == len(attrs.fields(TenantState))
    assert [f.name for f in attrs.fields(Limits)] == list(codec._LIMITS_V3)
    assert [f.name for f in attrs.fields(SessionInfo)] == [
        "layout", "tenant", "uid", "gid", "pid", "lock_type", "limit_bytes",
    ]
    assert [f.name for f in attrs.fields(Allocation)] == ["allocation_id", "size", "aligned_size", "tag", "layout_slot"]
    assert list(MetadataEntry._fields) == ["key", "allocation_id", "offset_bytes", "value"]


def test_a_tenant_sees_only_its_own_quotas_in_server_resumed():
    """As in SERVER_STARTED (issue 21's history filter): a new server's
    configuration names every tenant's quotas; a tenant is shown its own."""
    from gms.operator.policy import Policy, TenantPolicy
    from gms.server.service.probes import View
    from gms.store import LogEntry

    state = rich_log().state
    event = _resumed(state)
    team = TenantPolicy("team", uids=frozenset({1000}), read=("*",))
    row = View(team, Policy((team,))).history_row(LogEntry(7, 0, 0, event))
    assert row["quotas"] == {"team": 40 * MiB} and set(row["tenant_limits"]) == {"team"}
    assert set(View(None).history_row(LogEntry(7, 0, 0, event))["quotas"]) == {"default", "team"}


def test_the_frame_reader_takes_frames_of_every_size_however_the_bytes_come():
    """Small frames side by side, big ones read straight into a buffer of their
    own, in chunks of every size (the keeper's reads): each frame whole, in order."""
    sizes = [10, 70 << 10, 3, 200 << 10, 1, 1 << 20, 50, 0, 65 << 10, *[1000] * 600, 7]
    stream = b"".join(frames.encode_frame("events", {"entries": bytes([n % 251]) * size})
                      for n, size in enumerate(sizes))
    reader = frames.FrameReader()
    reader.feed(stream)  # all at once: hundreds of small frames, a buffer compacted as they go
    got = []
    while (frame := reader.next_frame()) is not None:
        got.append(frame.body["entries"])
    assert got == [bytes([n % 251]) * size for n, size in enumerate(sizes)]
    for chunk in (997, 4096, 65 << 10, 256 << 10, len(stream)):
        reader = frames.FrameReader()
        got = []
        at = 0
        while at < len(stream):
            space = reader.space()
            n = min(len(space), chunk, len(stream) - at)
            space[:n] = stream[at:at + n]
            reader.wrote(n)
            at += n
            while (frame := reader.next_frame()) is not None:
                got.append(frame.body["entries"])
        assert got == [bytes([n % 251]) * size for n, size in enumerate(sizes)], chunk
