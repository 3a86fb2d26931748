"""A node in every state a hand-over must carry, built by folding events; and its images.

``python -m tests.handover_fixtures N`` wrote ``tests/fixtures/state_vN.bin``
once, with version N of the hand-over format (version 1 before issue 21's
bounds, version 2 with them, version 3 with a metadata entry's own charge,
issue 48, version 4 with the disk tier, issue 52, version 5 with a snapshot kept through a
rebuild, issue 60); each is frozen: every later server must read it
back to exactly the node ``rich_image(N)`` builds (``test_handover.py``).  Do
not regenerate one when the format changes: add a version, and a reader for
the old one.
"""

from __future__ import annotations

import sys
from pathlib import Path

from gms.fsm import compute_layout_hash
from gms.fsm.events import (
    AllocationCreated,
    HostCopyCreated,
    LayoutEvicted,
    MetadataPut,
    RestoreClaimed,
    RestoreLoading,
    RoConnect,
    RwCommit,
    RwConnect,
    ServerStarted,
    SessionOpened,
    SnapshotSaved,
)
from gms.handover.image import ConnImage, PendingImage, ProtocolImage, ServerInfo, StateImage
from gms.store import EventLog
from gms.wire import messages as m
from gms.wire.codec import encode_body

MiB = 1 << 20
FIXTURES = {version: Path(__file__).parent / "fixtures" / f"state_v{version}.bin" for version in (1, 2, 3, 4, 5)}
FIXTURE = FIXTURES[1]  # the previous version: what a take-over from an older server reads
# The allocations of the fixture's node: (layout, id, size, aligned).
ALLOCATIONS = [
    ("weights", "w0", 3 * MiB, 4 * MiB),
    ("weights", "w1", 1 * MiB, 2 * MiB),
    ("cold", "c0", 2 * MiB, 2 * MiB),
    ("warm", "h0", 2 * MiB, 2 * MiB),
    ("kv", "k0", 5 * MiB, 6 * MiB),
]
PARKED = [("parked", "p0", 2 * MiB, 2 * MiB)]  # version 4: a layout on the disk tier (no memory)
REBUILT = [("rebuilt", "r0", 1 * MiB, 2 * MiB)]  # version 5: committed again, its earlier snapshot kept


def _publish(
    log: EventLog, conn: int, name: str, tenant: str, residency: str, host_copies: bool, persist: bool = False,
    save: bool = True,
) -> None:
    log.extend([SessionOpened(conn, tenant, 1000, 1000, 100 + conn, "RW", layout=name), RwConnect(conn, layout=name)])
    for slot, (layout, allocation_id, size, aligned) in enumerate(a for a in ALLOCATIONS + PARKED + REBUILT if a[0] == name):
        log.extend([
            AllocationCreated(conn, allocation_id, size, aligned, "weights", slot, layout=name),
            MetadataPut(conn, f"{allocation_id}.t", allocation_id, 0, b"meta-" + allocation_id.encode(), layout=name),
        ])
        if host_copies:
            log.append(HostCopyCreated(conn, allocation_id, layout=name))
    state = log.state.layout(name)
    digest = compute_layout_hash(state.allocations.values(), state.metadata.values())
    log.extend([RwCommit(conn, digest, residency, persist, layout=name)])
    from gms.fsm.events import SessionClosed

    log.append(SessionClosed(conn, layout=name))
    if persist and save:
        file = f"{digest[:24]}-{conn:016x}.gsnap"
        log.append(SnapshotSaved(0, digest, state.held_bytes + 4096, file, layout=name))


def rich_log(version: int = 5) -> EventLog:
    """Every kind of layout and session a take-over meets; from version 2 on, with
    issue 21's bounds (a node metadata bound, tenants' metadata quotas and layouts);
    from version 3 on, with a charge per metadata entry; from version 4 on, a disk
    tier (a budget, a tenant's disk quota, a snapshot, a layout on disk only); from
    version 5 on, a layout committed again whose new snapshot is not saved yet (the
    earlier one kept)."""
    log = EventLog(retain=None)
    limits: dict = {"max_layouts": 16}
    tenant_limits: dict = {}
    if version >= 2:
        limits.update(max_metadata_bytes=MiB, tenant_metadata_quota=64 << 10, tenant_max_layouts=8)
        tenant_limits = {"default": {"metadata_quota": 64 << 10, "max_layouts": 8},
                         "team": {"metadata_quota": 4096, "max_layouts": 3}}
    if version >= 3:
        limits.update(metadata_entry_bytes=16)
    disk = version >= 4
    if disk:
        tenant_limits["team"]["disk_quota"] = 16 * MiB
    log.append(ServerStarted(0, 64 * MiB, 48 * MiB, 32 * MiB, {"default": None, "team": 40 * MiB},
                             limits, backend="host", device=0, device_uuid="host-0", layout="",
                             tenant_limits=tenant_limits, disk_budget_bytes=256 * MiB if disk else 0))
    _publish(log, 1, "weights", "default", "device", host_copies=False, persist=disk)
    _publish(log, 2, "cold", "team", "system", host_copies=True)
    _publish(log, 3, "warm", "team", "system", host_copies=True)
    log.extend([LayoutEvicted(0, "admin", layout="cold"), LayoutEvicted(0, "budget", layout="warm")])
    if disk:
        _publish(log, 9, "parked", "team", "unpinned", host_copies=False, persist=True)
        log.append(LayoutEvicted(0, "budget", layout="parked"))
    if version >= 5:
        _publish(log, 10, "rebuilt", "default", "device", host_copies=False, persist=True)
        _publish(log, 11, "rebuilt", "default", "device", host_copies=False, persist=True, save=False)
    # A reader of weights; a restorer half-way through warm; a writer building kv;
    # a writer queued behind the reader; a reader queued behind the restore.
    log.extend([SessionOpened(4, "default", 1000, 1000, 104, "RO", layout="weights"), RoConnect(4, layout="weights")])
    log.extend([
        SessionOpened(5, "team", 1000, 1000, 105, "RO", layout="warm"), RestoreClaimed(5, layout="warm"),
        RestoreLoading(5, layout="warm"),
    ])
    log.extend([
        SessionOpened(6, "default", 1000, 1000, 106, "RW", layout="kv", limit_bytes=32 * MiB),
        RwConnect(6, layout="kv"),
        AllocationCreated(6, "k0", 5 * MiB, 6 * MiB, "kv", 0, layout="kv"),
    ])
    log.append(SessionOpened(7, "default", 1000, 1000, 107, "RW", layout="weights"))
    log.append(SessionOpened(8, "team", 1000, 1000, 108, "RO", layout="warm"))
    return log


def _protocol(state: str, serving: object = None, buffered: bytes = b"", requests: int = 1) -> ProtocolImage:
    return ProtocolImage(
        state=state, handshaken=state == "IDLE", requests=requests, buffered=buffered, eof=False, one_shot=False,
        serving=encode_body(serving) if serving is not None else b"",
    )


def rich_image(version: int = 5) -> StateImage:
    log = rich_log(version)
    half_frame = bytes.fromhex("0000002a") + b"\x83"  # a client's next request, 5 bytes of it
    conns = (
        ConnImage(4, _protocol("IDLE", buffered=half_frame, requests=3)),
        ConnImage(5, _protocol("IDLE", requests=2)),
        ConnImage(6, _protocol("SERVING", m.AllocateRequest(64 * MiB, "kv"), requests=4),
                  PendingImage("allocate")),
        ConnImage(7, _protocol("SERVING", m.HandshakeRequest("RW", 30_000, "weights")),
                  PendingImage("lock", requested="RW", timeout_left_ms=12_345)),
        ConnImage(8, _protocol("SERVING", m.HandshakeRequest("RO", None, "warm")),
                  PendingImage("lock", requested="RO")),
        ConnImage(9, _protocol("IDLE", requests=0), first_request_left_ms=7_500 if version >= 2 else None),
    )
    return StateImage(
        version=version,
        server=ServerInfo(pid=4242, backend="host", device=0, device_uuid="host-0", host_tier=True),
        last_seq=log.last_seq,
        next_conn=12 if version >= 5 else 10,
        state=log.state,
        conns=conns,
        queues=(("weights", (7,)), ("warm", (8,))),
    )


if __name__ == "__main__":
    from gms.handover.image import encode_image

    version = int(sys.argv[1])
    path = FIXTURES[version]
    if path.exists() and "--force" not in sys.argv:
        raise SystemExit(f"{path} is frozen: a new format is a new version, not a new fixture")
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(encode_image(rich_image(version), version))  # only the current version can be written
    print(f"wrote {path} ({path.stat().st_size} bytes)")


def saved_journal(folder, entries: list, cut: int) -> str:
    """Save ``entries`` (numbered from 1) as a server saves a journal that did
    not rebuild: a base image of the first ``cut``, then the rest.  Its path."""
    from gms.fsm import fold_all
    from gms.handover.image import STATE_VERSION, encode_entries, encode_image
    from gms.server.restart.resume import save_journal

    state = fold_all(entry.event for entry in entries[:cut])
    base = encode_image(StateImage(STATE_VERSION, ServerInfo(1, "host", 0, "host-0", True), cut, 9, state))
    return save_journal(str(folder), "host-0", base, [encode_entries(entries[cut:])], "a test")


def replay_saved(folder, entries: list, cut: int):
    """:func:`saved_journal`, read back as `gms replay` does."""
    from gms.operator.postmortem import replay_rows

    with open(saved_journal(folder, entries, cut)) as lines:
        return replay_rows(lines)
