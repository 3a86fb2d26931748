"""The keeper's base in parts (gms.handover.journal), without processes.

Each base is made the keeper's way: the parts the writer says changed, every
other part taken from the base before.  After each step it must decode to
exactly the live state: a change the writer failed to notice would leave a
stale part behind and fail here.
"""

from __future__ import annotations

import msgpack
import pytest

from gms.fsm.events import AllocationCreated, MetadataDeleted, MetadataPut
from gms.handover import journal
from gms.handover.image import STATE_VERSION, ImageError, ServerInfo, StateImage
from gms.handover.journal import HEAD, PartWriter, bucket_count, decode_parts
from gms.store import EventLog, Snapshot

from .fsm_events import aborted, committed, opened, started, writer

INFO = ServerInfo(1, "host", 0, "host-0", True)


class Keeper:
    """The keeper's side of the parts (gms.keeper.store, in short)."""

    def __init__(self) -> None:
        self.parts: dict[str, bytes] = {}
        self.sent: list[int] = []  # bytes each base sent

    def base(self, changed: dict, keys: list[str]) -> None:
        self.parts = {key: changed[key] if key in changed else self.parts[key] for key in keys}
        self.sent.append(sum(map(len, changed.values())))


class Node:
    def __init__(self) -> None:
        self.log = EventLog()
        self.writer = PartWriter()
        self.keeper = Keeper()

    def record(self, events) -> None:
        folded = self.log.fold(list(events))
        self.writer.note(self.log.store(folded))

    def check(self) -> None:
        image = StateImage(STATE_VERSION, INFO, self.log.last_seq, 9, self.log.state)
        self.keeper.base(*self.writer.parts(image))
        assert decode_parts(self.keeper.parts) == image


def put(conn: int, key: str, value: bytes, layout: str = "w") -> MetadataPut:
    return MetadataPut(conn, key, "a0", 0, value, layout=layout)


def test_a_base_sends_what_changed_and_decodes_to_the_live_state(monkeypatch):
    monkeypatch.setattr(journal, "BUCKET_BYTES", 4096)  # a few entries a bucket: many buckets
    node = Node()
    node.record([started(), *writer(1)])
    node.record([AllocationCreated(1, "a0", 4096, 4096, "w", 0, layout="w")])
    node.record(put(1, f"k{i:03}", bytes([i]) * 1000) for i in range(64))
    node.check()
    whole = node.keeper.sent[-1]
    assert sum(key.startswith("m:w:") for key in node.keeper.parts) >= 16, "the metadata in many buckets"

    node.record([put(1, "k007", b"x" * 1000)])  # one entry replaced: one bucket again, and the heads
    node.check()
    assert node.keeper.sent[-1] < whole // 4

    node.record([MetadataDeleted(1, "k008", layout="w"), put(1, "new", b"y" * 1000)])
    node.check()
    node.record(committed(node.log.state, 1))
    node.check()
    node.check()  # nothing changed: the head alone
    assert node.keeper.sent[-1] < whole // 8

    # A writer clears it: every bucket is new (no entry of the old layout is left behind).
    node.record([*writer(2), AllocationCreated(2, "a0", 4096, 4096, "w", 0, layout="w"), put(2, "only", b"z")])
    node.check()
    assert len(node.keeper.parts) < 8, "a layout of one entry in one bucket"

    # It grows: the bucket count changes, and the base follows.
    node.record(put(2, f"g{i:03}", b"g" * 1000) for i in range(200))
    node.check()
    node.record(MetadataDeleted(2, f"g{i:03}", layout="w") for i in range(190))
    node.check()
    node.record(committed(node.log.state, 2))
    node.check()

    # A writer takes it and leaves: the layout goes, and its parts with it.
    node.record([*writer(3), *aborted(3)])
    node.check()
    assert list(node.keeper.parts) == [HEAD]


def test_a_second_layout_untouched_costs_nothing():
    node = Node()
    node.record([started(), *writer(1, "big")])
    node.record([AllocationCreated(1, "a0", 4096, 4096, "w", 0, layout="big")])
    node.record(put(1, f"k{i}", b"v" * 1000, "big") for i in range(1000))
    node.record(committed(node.log.state, 1, "big"))
    node.record([opened(2, "small"), *writer(2, "small")[1:]])
    node.check()
    node.record([AllocationCreated(2, "a0", 4096, 4096, "w", 0, layout="small"), put(2, "s", b"s", "small")])
    node.check()
    assert node.keeper.sent[-1] < 64 << 10, "the big layout's megabyte was not sent again"


def test_bucket_counts_hold_until_the_metadata_grows_or_shrinks_fourfold():
    mib = journal.BUCKET_BYTES
    assert bucket_count(0, None) == 1 and bucket_count(3 * mib, None) == 4
    assert bucket_count(10 * mib, 4) == 4 and bucket_count(17 * mib, 4) == 32
    assert bucket_count(mib, 4) == 4 and bucket_count(mib - 1, 4) == 1


def test_parts_that_do_not_make_up_a_state_are_refused():
    node = Node()
    node.record([started(), *writer(1)])
    node.check()
    parts = dict(node.keeper.parts)
    del parts[next(key for key in parts if key.startswith("l:"))]
    with pytest.raises(ImageError):
        decode_parts(parts)
    with pytest.raises(ImageError):
        decode_parts({HEAD: b"junk"})


def restarted(node: Node, tails: list) -> Node:
    """A new server rebuilt from the keeper's parts and ``tails`` (events the keeper
    has after its base), as gms.server.restart.resume does, adopting that base."""
    image, buckets = journal.decode_kept(node.keeper.parts)
    assert buckets is not None, "this format's buckets are the same in every process"
    new = Node()
    new.keeper = node.keeper
    new.log = EventLog.resumed(Snapshot(image.last_seq, image.state), tails)
    new.writer.adopt(journal.KeptBase(image.state, buckets, tuple(tails), new.log.state))
    return new


def test_a_restarted_server_sends_what_differs_from_the_base_it_was_rebuilt_from(monkeypatch):
    monkeypatch.setattr(journal, "BUCKET_BYTES", 4096)
    node = Node()
    node.record([started(), *writer(1, "big")])
    node.record([AllocationCreated(1, "a0", 4096, 4096, "w", 0, layout="big")])
    node.record(put(1, f"k{i:03}", bytes([i]) * 1000, "big") for i in range(64))
    node.record([*writer(2, "kv"), AllocationCreated(2, "a0", 4096, 4096, "w", 0, layout="kv")])
    node.record(put(2, f"v{i:03}", b"v" * 1000, "kv") for i in range(16))
    node.check()
    whole = node.keeper.sent[-1]

    # The keeper's tails after its base: an entry of each layout replaced.  Then the
    # new server logs more before it attaches (a resume's events), noted nowhere:
    # here an entry of kv replaced in a bucket the tails did not touch.
    tails = node.log.store(node.log.fold([put(1, "k005", b"x" * 1000, "big"), put(2, "v001", b"x" * 1000, "kv")]))
    new = restarted(node, tails)
    new.log.store(new.log.fold([put(2, f"v{i:03}", b"y" * 1000, "kv") for i in range(2, 16)]))
    new.check()  # (kv's buckets all sent: its metadata is not the rebuilt one)
    assert new.keeper.sent[-1] < whole // 3, "big's untouched buckets stay the keeper's"

    # The adopted base is a base like any other from here on.
    new.record([put(1, "k006", b"y" * 1000, "big")])
    new.check()


def test_a_base_whose_buckets_may_differ_is_sent_whole():
    node = Node()
    node.record([started(), *writer(1)])
    node.check()
    magic, _, head = msgpack.unpackb(node.keeper.parts[HEAD], raw=False, strict_map_key=False)
    node.keeper.parts[HEAD] = msgpack.packb([magic, 1, head], use_bin_type=True)  # format 1: by hash()
    image, buckets = journal.decode_kept(node.keeper.parts)
    assert image == decode_parts(node.keeper.parts) and buckets is None
