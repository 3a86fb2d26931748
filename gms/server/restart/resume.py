"""A server that starts from another's node: the state rebuilt, the memory adopted, the resume recorded.

Two ways in, one way through:

* ``restart``: the keeper hands back the dead server's journal (a base image
  and the log entries after it) and every fd it kept.  :func:`rebuild` folds
  the entries over the image with the pure core, keeping their numbers, and
  checks every invariant; a journal that does not rebuild is
  :class:`Unreplayable` (the caller saves it with :func:`save_journal` and
  starts empty, saying so).
* ``take-over``: a live server hands over its image (state, sessions, queues)
  and fds; the log goes on from the image.

Then :func:`resume_core` adopts the memory (each fd checked by its backend,
without a CUDA context; the state's allocations with no fd, or whose fd no
longer imports, are *lost*; fds the state does not name are closed) and
records what the pure core decides (``gms.fsm.resume``): ``SERVER_RESUMED``,
the dead sessions' disconnects after a crash, ``LAYOUT_LOST`` for layouts
with memory gone (``LAYOUT_FELL_TO_DISK`` where a snapshot holds one).  A
take-over that finds memory lost is refused instead: the old server still
serves it whole.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from collections.abc import Iterable

import attrs

from ...cuda import DeviceInfo
from ...fsm import (
    InvariantViolation,
    MemoryTier,
    Rejection,
    check_invariants,
    decide_resume,
    held_memory,
)
from ...fsm.events import ServerResumed, resumed_from
from ...handover.image import (
    ImageError,
    ServerInfo,
    StateImage,
    decode_entries,
    decode_image,
    encode_image,
)
from ...handover.journal import KeptBase, decode_kept, decode_parts
from ...operator.postmortem import event_row
from ...store import EventLog, Snapshot
from ...store.prior import Prior, batches
from ...system import files
from ...system.cyclegc import paused
from ..service.core import ServiceCore
from ..tiers.chunk_book import parse_chunk_name
from ..tiers.table import Kept
from .mirror import split_key

# Restarts and take-overs are rare and each line matters: not under "gms.server",
# whose repeated lines are rate-limited (gms.server.edge.ratelimit).
log = logging.getLogger("gms.server.restart")


class Unreplayable(Exception):
    """A handed journal that does not rebuild into a valid state."""


class TakeOverRefused(Exception):
    """This server will not take the running one's place (it serves on)."""


class Unresumable(Exception):
    """This server cannot serve the node its keeper kept (another device, a
    configuration that cannot hold it): it leaves it to the keeper, which keeps
    every fd and its journal and starts another server later."""


@attrs.frozen
class Handed:
    """A node to go on with: its image and log, its memory's fds by key
    (``gpu:<id>``, ``host:<id>`` or ``host:<id>/<offset>/<length>`` for a
    chunk of a copy of several) and, for a take-over, each connection's socket."""

    mode: str  # "restart" or "take-over"
    image: StateImage
    log: EventLog
    next_conn: int
    fds: dict  # key -> fd
    old_pid: int
    reason: str
    conn_fds: dict = attrs.field(factory=dict)  # conn -> socket fd
    whole: bool = False  # a restart whose journal the last server left whole: numbers go on with no gap
    kept_seq: int = 0  # the last event its keeper has (the journal's): the ones after go to it as history
    kept: KeptBase | None = None  # the keeper's base in parts, this node's start: the first base sends what differs

    def close_conn_fds(self) -> None:
        """The clients' sockets not handed to sessions (a take-over refused late)."""
        for fd in self.conn_fds.values():
            os.close(fd)
        self.conn_fds.clear()


def decode_base(base: bytes | dict) -> StateImage:
    """A keeper's base: an image, or its parts (``gms.handover.journal``)."""
    return decode_parts(base) if isinstance(base, dict) else decode_image(base)


def rebuild(
    base: bytes | dict, tails: Iterable[bytes], *, retain: int | None, max_bytes: int | None = None,
    history: Iterable = (),
) -> tuple[StateImage, EventLog, int, KeptBase | None]:
    """(image, log, next conn, the base as the keeper keeps it) from a keeper's
    journal; raises Unreplayable.  ``history``: the keeper's batches before its
    base, shown in the log's history, never folded (one that is not well formed
    is left out)."""
    try:
        with paused():
            image, buckets = decode_kept(base) if isinstance(base, dict) else (decode_image(base), None)
            entries = [entry for tail in tails for entry in decode_entries(tail)]
            prior = Prior(batches(history, image.last_seq + 1), decode_entries)
            log_ = EventLog.resumed(Snapshot(image.last_seq, image.state), entries, retain=retain,
                                    max_bytes=max_bytes, prior=prior)
            check_invariants(log_.state)
    except (ImageError, ValueError, Rejection, InvariantViolation) as exc:
        raise Unreplayable(f"{type(exc).__name__}: {exc}") from exc
    next_conn = max([image.next_conn] + [entry.event.conn + 1 for entry in entries])
    kept = None if buckets is None else KeptBase(image.state, buckets, tuple(entries), log_.state)
    return image, log_, next_conn, kept


def save_journal(
    folder: str, label: str, base: bytes | dict | None, tails: Iterable[bytes], reason: str
) -> str:
    """Write a journal that did not rebuild where ``gms replay`` reads it: one
    JSON line per event, after a first line with the base image (hex) when
    there is one; what does not decode is kept as hex too.  Returns the path."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    name = f"gms-unreplayable-{label}-{stamp}-{os.getpid()}.jsonl"
    path = os.path.join(folder, name)
    # Every tenant's metadata is in it: readable by the daemon's user alone, and
    # never written through a link planted in the folder (gms.system.files).
    with files.write_new(folder, name, 0o600) as out:
        out.write(json.dumps({"kind": "GMS_JOURNAL", "reason": reason}) + "\n")
        if base is not None:
            try:
                image = decode_base(base)
            except ImageError:
                image = None
            # An image as one hex string: a base in parts is put back together first.
            data = encode_image(image) if isinstance(base, dict) and image is not None else base
            if isinstance(data, dict):  # parts that do not make up a state: each as it came
                row = {"kind": "STATE_PARTS", "parts": {key: part.hex() for key, part in data.items()}}
            else:
                row = {"kind": "STATE_IMAGE", "seq": image and image.last_seq, "image": data.hex()}
            out.write(json.dumps(row) + "\n")
        for tail in tails:
            try:
                entries = decode_entries(tail)
            except ImageError:
                out.write(json.dumps({"kind": "RAW_ENTRIES", "data": tail.hex()}) + "\n")
                continue
            for entry in entries:
                out.write(json.dumps(event_row(entry.seq, entry.wall_ns / 1e9, entry.event), default=_plain) + "\n")
    return path


def _plain(value):
    if isinstance(value, bytes):
        return value.hex()
    raise TypeError(f"cannot write {type(value).__name__}")


def check_compatible(server: ServerInfo, device: DeviceInfo) -> None:
    """Memory is only ever taken over by a server of the same device and backend."""
    if (server.backend, server.device_uuid) != (device.backend, device.uuid):
        raise TakeOverRefused(
            f"the state is of {server.backend} device {server.device_uuid}; this server serves "
            f"{device.backend} device {device.uuid}"
        )


async def adopt_memory(core: ServiceCore, handed: Handed) -> list[tuple[str, str, str]]:
    """Hold every fd the state names, each by its tier (``gms.server.tiers.table``:
    checked by its backend; a tier this node lacks loses it); close the others.
    Returns (tier, allocation id, why) for each allocation lost."""
    kept, unnamed = kept_by_tier(handed.fds, held_memory(handed.log.state))
    # Made, but no event names it: the server died in between (or it is not memory).
    for key, fd in unnamed:
        log.info("closing %s: no event of the handed state names it", key)
        os.close(fd)
    lost: list[tuple[str, str, str]] = []
    for tier, items in kept.items():
        store = core.ledger.tiers[tier]
        missing = [one.allocation_id for one in items if not one.parts]
        store.mark_lost(missing)  # (its release, when its layout goes, finds nothing held)
        lost += [(tier.value, i, "no fd was kept for it") for i in missing]
        lost += [(tier.value, i, why) for i, why in await store.adopt([one for one in items if one.parts])]
    return lost


def kept_by_tier(fds: dict[str, int], held: dict[tuple[str, str], int]) -> tuple[
        dict[MemoryTier, list[Kept]], list[tuple[str, int]]]:
    """The handed ``fds`` (``memory_key`` names) as what each tier held, by the
    state's ``held`` memory (an allocation with no fd: no parts); and the (key, fd)
    no event names.  A copy may come in several chunks, each named by where it
    lies in the copy (``gms.server.tiers.chunk_book.chunk_name``)."""
    parts: dict[tuple[str, str], list[tuple[int | None, int | None, int]]] = {}
    unnamed: list[tuple[str, int]] = []
    for key, fd in fds.items():
        tier, name = split_key(key)
        try:
            allocation_id, offset, size = parse_chunk_name(name)
        except ValueError:
            allocation_id = None  # not a name this server gives: closed as unnamed
        if (tier, allocation_id) in held:
            parts.setdefault((tier, allocation_id), []).append((offset, size, fd))
        else:
            unnamed.append((key, fd))
    kept: dict[MemoryTier, list[Kept]] = {}
    for (tier, allocation_id), size in held.items():
        kept.setdefault(MemoryTier(tier), []).append(Kept(allocation_id, size, tuple(parts.get((tier, allocation_id), ()))))
    return kept, unnamed


def resumed_event(core: ServiceCore, handed: Handed) -> ServerResumed:
    """This server's whole configuration (its SERVER_STARTED's), taking ``handed`` over."""
    return resumed_from(core.started_event, mode=handed.mode, old_pid=handed.old_pid, reason=handed.reason,
                        state_version=handed.image.version, follows_seq=core.ledger.log.last_seq)


async def resume_core(core: ServiceCore, handed: Handed) -> None:
    """Adopt the memory and record the resume; raises TakeOverRefused for a take-over
    that cannot go on (memory lost, the new configuration refused), Unresumable
    for a restart whose configuration cannot hold the node (nothing adopted)."""
    refusal = TakeOverRefused if handed.mode == "take-over" else Unresumable
    try:
        check_compatible(handed.image.server, core.device)
        # Judged before any fd is adopted: a refused restart leaves them all to the keeper.
        core.ledger.fold([resumed_event(core, handed)])
    except TakeOverRefused as refused:
        raise refusal(str(refused)) from None
    except Rejection as refused:  # the new configuration cannot hold the node
        raise refusal(refused.message) from None
    lost = await adopt_memory(core, handed)
    for tier, allocation_id, why in lost:
        log.error("%s memory of allocation %s is lost: %s", tier, allocation_id, why)
    if lost and handed.mode == "take-over":
        raise TakeOverRefused(f"{len(lost)} allocations did not adopt (first: {lost[0][2]})")
    events = decide_resume(
        core.state, resumed_event(core, handed), [(t, i) for t, i, _ in lost],
        reason=lost[0][2] if lost else "",
    )
    if handed.mode == "restart" and not handed.whole:  # a dead server's last events may never have reached the keeper
        core.ledger.log.skip_lost()
    try:
        core.ledger.record(events)
    except Rejection as refused:  # (judged above: only a loss could change it)
        raise refusal(refused.message) from None
    core.continue_conns(handed.next_conn)
