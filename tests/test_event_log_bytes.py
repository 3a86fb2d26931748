"""The event log bounded by bytes: kept entries and what the snapshot keeps alive.

The bound is what the log's own accounting says (``EventLog.bytes``); the
accounting is checked against tracemalloc here, and the server's RSS against
the bound in tests/reliability/test_isolation.py.
"""

from __future__ import annotations

import gc
import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st

from gms.fsm.events import AllocationCreated, MetadataPut, RwConnect, SessionOpened
from gms.store import EventLog, replay
from gms.store.sizes import entry_bytes, pinned_bytes

from .fsm_events import aborted, committed, started

KiB, MiB = 1 << 10, 1 << 20


def build(conn: int, layout: str, values: list[bytes]) -> list:
    """A writer that allocates and puts one value per key."""
    alloc = f"{conn:032x}"
    events = [
        SessionOpened(conn, "default", 0, 0, 0, "RW", layout=layout),
        RwConnect(conn, layout=layout),
        AllocationCreated(conn, alloc, 4096, 2 * MiB, "w", 0, layout=layout),
    ]
    return events + [MetadataPut(conn, f"k{n}", alloc, 0, v, layout=layout) for n, v in enumerate(values)]


def test_an_entry_counts_its_payload():
    small = entry_bytes(SessionOpened(1, "default", 0, 0, 0, "RW", layout="w"))
    big = entry_bytes(MetadataPut(1, "key", "a" * 32, 0, b"v" * MiB, layout="w"))
    assert 256 < small < 300
    assert big >= MiB + 32 + 3 + 256


@settings(max_examples=60, deadline=None)
@given(
    rounds=st.integers(1, 60),
    value=st.integers(0, 64 * KiB),
    keys=st.integers(0, 6),
    commit=st.booleans(),
    max_kib=st.integers(64, 1024),
)
def test_the_log_stays_within_its_bytes_and_replays_exactly(rounds, value, keys, commit, max_kib):
    max_bytes = max_kib * KiB
    log = EventLog(retain=None, max_bytes=max_bytes, chunk_size=64)
    log.append(started())
    worst_batch = 0
    for n in range(1, rounds + 1):
        batch = build(n, f"l{n % 3}", [bytes([n % 256]) * value] * keys)
        log.extend(batch)
        worst_batch = max(worst_batch, sum(entry_bytes(e) for e in batch))
        ending = committed(log.state, n, f"l{n % 3}") if commit else aborted(n, f"l{n % 3}")
        log.extend(ending)
        chunk = max(max_bytes // 16, 64 * KiB)
        assert log.bytes <= max_bytes + chunk + worst_batch, (log.bytes, max_bytes)
    assert replay(log) == log.state
    kept = list(range(log.first_seq, log.last_seq + 1))
    assert [e.seq for e in log.entries()] == kept
    # Chunks close by bytes too, so their sizes differ: reads must find them anyway.
    assert all(log.entry(seq).seq == seq for seq in kept)
    for since in range(log.first_seq - 2, log.last_seq + 1, 7):
        assert [e.seq for e in log.since(since, 50)] == [s for s in kept if s > since][:50]


def test_the_snapshot_counts_the_metadata_only_it_keeps_alive():
    log = EventLog(retain=8, max_bytes=64 * MiB, chunk_size=4)  # cut by count: the snapshot moves on
    log.extend([started(), *build(1, "big", [b"x" * MiB] * 3)])
    log.extend(committed(log.state, 1, "big"))
    for n in range(2, 20):
        log.extend([SessionOpened(n, "default", 0, 0, 0, "RO", layout="big")])
    snapshot = log.snapshot.state
    assert "big" in snapshot.layouts and log.first_seq > 10, "the snapshot holds the committed metadata"
    assert pinned_bytes(snapshot, log.state) == 0, "the live state holds the same: nothing only the snapshot keeps"
    assert log.bytes < MiB, "nor do the kept events"
    # A writer rebuilds the layout: the old values now live only in the snapshot.
    log.extend([SessionOpened(99, "default", 0, 0, 0, "RW", layout="big"), RwConnect(99, layout="big")])
    assert pinned_bytes(snapshot, log.state) == 3 * (MiB + 2)
    seen = []
    for n in range(100, 112):  # a chunk boundary recounts it; the cut moving past the rebuild lets it go
        log.extend([SessionOpened(n, "default", 0, 0, 0, "RO", layout="other")])
        seen.append(log.bytes)
    assert max(seen) >= 3 * MiB and seen[-1] < MiB, seen


def test_a_value_put_over_and_over_stays_within_the_bound():
    """The attack of issue 21 on the log: 1 MiB values replaced without end."""
    log = EventLog(retain=None, max_bytes=8 * MiB)
    log.extend([started(), *build(1, "flood", [])])
    alloc = f"{1:032x}"
    for n in range(200):
        log.append(MetadataPut(1, "k", alloc, 0, bytes([n % 256]) * MiB, layout="flood"))
        assert log.bytes <= 8 * MiB + MiB // 2 + MiB + 512
    assert log.first_seq > 100
    assert replay(log) == log.state


def test_the_accounting_is_not_an_underestimate():
    """tracemalloc's count of what the kept log holds, against the log's own."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        log = EventLog(retain=None, max_bytes=None)
        log.append(started())
        for n in range(1, 2000):
            log.extend(build(n, f"l{n % 7}", [b"v" * 100] * 2))
            log.extend(aborted(n, f"l{n % 7}"))
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    counted = sum(entry_bytes(e.event) for e in log.entries())
    assert counted >= 0.8 * held, (counted, held)  # within a fifth: the bound means something
    assert counted <= 2.5 * held, (counted, held)  # and history is not given up for nothing


@settings(max_examples=40, deadline=None)
@given(rounds=st.integers(1, 40), value=st.integers(0, 32 * KiB), cut=st.integers(0, 400), max_kib=st.integers(64, 512))
def test_a_log_resumed_from_another_s_journal_holds_the_same_bound(rounds, value, cut, max_kib):
    """A restarted server's log (EventLog.resumed: a base image's snapshot and the
    entries after it) counts its entries as appended ones are counted, closes
    chunks and trims by the same rules, so it holds the same bound, then and
    after, and replays to the live state."""
    from gms.fsm import fold_all
    from gms.store import Snapshot

    max_bytes = max_kib * KiB
    original = EventLog(retain=None, chunk_size=32)  # all of it: the keeper's journal, say
    original.append(started())
    events = []
    for n in range(1, rounds + 1):
        events += build(n, f"l{n % 3}", [bytes([n % 256]) * value] * 2) + aborted(n, f"l{n % 3}")
    original.extend(events[: len(events) // 2])
    entries = list(original.entries())
    cut = min(cut, len(entries))
    base = Snapshot(cut, fold_all(e.event for e in entries[:cut]))
    resumed = EventLog.resumed(base, entries[cut:], retain=None, max_bytes=max_bytes, chunk_size=32)
    biggest = 256 + 32 + 2 * 32 * KiB  # an entry: a metadata value and its key

    def holds() -> None:
        kept = sum(entry_bytes(entry.event) for entry in resumed.entries())
        # The bound, one chunk past it, and what the snapshot keeps alive (3 layouts' values at most).
        assert kept <= resumed.bytes <= max_bytes + 32 * biggest + 3 * biggest
        assert replay(resumed) == resumed.state

    assert resumed.state == original.state and resumed.last_seq == original.last_seq
    kept = sum(entry_bytes(entry.event) for entry in resumed.entries())
    assert resumed.bytes == kept + pinned_bytes(resumed.snapshot.state, resumed.state), "counted from the start"
    holds()
    later = events[len(events) // 2 :]
    original.extend(later)
    resumed.extend(later)
    assert resumed.state == original.state
    holds()
