"""Event log throughput: append+fold rate, replay time, bytes per event.

The workload is what a busy server logs: writers building model-shaped
layouts (allocations, metadata puts and deletes, frees with cascades, a
commit that hashes the layout), then bursts of readers coming and going.

    python bench/event_log.py            # 1 M events
    python bench/event_log.py --quick    # 100 k events
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import time
import tracemalloc
from collections.abc import Iterator

from _common import cpu_name, print_table, write_json

from gms.fsm import Event, decide_commit, decide_free
from gms.fsm.events import (
    AllocationCreated,
    MetadataDeleted,
    MetadataPut,
    RoConnect,
    RoDisconnect,
    RwConnect,
)
from gms.store import EventLog

ALLOCATIONS_PER_BUILD = 64
KEYS_PER_BUILD = 256
READERS_PER_BUILD = 100
MiB = 1 << 20


def cycles(shadow: EventLog) -> Iterator[list[Event]]:
    """Batches of one build/commit/read cycle after another.

    Decisions read ``shadow``, which the consumer has brought up to date by the
    time the generator resumes.
    """
    conn = 0
    while True:
        conn += 1
        writer = conn
        ids = [f"{writer:x}-{i}" for i in range(ALLOCATIONS_PER_BUILD)]
        yield [RwConnect(writer)]
        yield [
            AllocationCreated(writer, alloc_id, 64 * MiB - 1, 64 * MiB, "weights", slot)
            for slot, alloc_id in enumerate(ids)
        ]
        yield [
            MetadataPut(writer, f"layer.{k}.weight", ids[k % len(ids)], 4096 * (k // len(ids)), b"%064d" % k)
            for k in range(KEYS_PER_BUILD)
        ]
        yield [MetadataDeleted(writer, f"layer.{k}.weight") for k in range(8)]
        for alloc_id in ids[-4:]:
            yield decide_free(shadow.state, writer, alloc_id)
        yield decide_commit(shadow.state, writer)
        readers = range(conn + 1, conn + 1 + READERS_PER_BUILD)
        conn += READERS_PER_BUILD
        yield [RoConnect(r) for r in readers]
        yield [RoDisconnect(r) for r in readers]


def workload(total: int) -> Iterator[Event]:
    shadow = EventLog(retain=0)
    emitted = 0
    for batch in cycles(shadow):
        for event in batch:
            if emitted == total:
                return
            shadow.append(event)
            yield event
            emitted += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--quick", action="store_true", help="100 k events")
    parser.add_argument("--json", default="bench/results/event_log.json")
    args = parser.parse_args()
    total = 100_000 if args.quick else args.events

    events = list(workload(total))
    gc.collect()

    log = EventLog(retain=None)
    start = time.perf_counter()
    for event in events:
        log.append(event)
    append_s = time.perf_counter() - start

    start = time.perf_counter()
    replayed = log.replay()
    replay_s = time.perf_counter() - start
    assert replayed == log.state

    bounded = EventLog(retain=100_000)
    start = time.perf_counter()
    for event in events:
        bounded.append(event)
    bounded_s = time.perf_counter() - start
    assert bounded.replay() == bounded.state == log.state

    del events, log, bounded, replayed
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    measured = EventLog(retain=None)
    for event in workload(min(total, 200_000)):
        measured.append(event)
    bytes_per_event = (tracemalloc.get_traced_memory()[0] - base) / measured.last_seq
    tracemalloc.stop()

    results = {
        "events": total,
        "append_fold_events_per_s": total / append_s,
        "append_fold_bounded_events_per_s": total / bounded_s,
        "replay_s": replay_s,
        "replay_events_per_s": total / replay_s,
        "bytes_per_event": bytes_per_event,
        "cpu": cpu_name(),
        "python": platform.python_version(),
        "cores_used": 1,
        "host_cores": os.cpu_count(),
    }
    print_table(
        f"event log, {total:,} events, one core of {results['cpu']}",
        [
            ("append + fold (retain all)", f"{results['append_fold_events_per_s']:,.0f} events/s"),
            ("append + fold (retain 100 k)", f"{results['append_fold_bounded_events_per_s']:,.0f} events/s"),
            (f"replay {total:,} events", f"{replay_s:.2f} s"),
            ("bytes per event (incl. event)", f"{bytes_per_event:,.0f} B"),
        ],
    )
    write_json(args.json, results)


if __name__ == "__main__":
    main()
