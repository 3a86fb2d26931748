"""The keeper's base in parts: a state image it can replace a part at a time.

A keeper keeps a *base* (the state at some point) and the log entries after
it.  Replacing the base whole costs a copy of the state in the server (the
encoding) and a second one in the keeper (the old base stays until the new
one is whole), each time: a tenant churning its metadata made the daemon
hold three to five times what it stored (issue 32).  So the base is kept as
*parts*, opaque bytes under keys, and a new base sends only the parts that
changed since the last one; the keeper takes the others from the base it
has.  What a new base costs is then about what changed, which the log
entries since the last one already carried.

The parts of a state image (of :data:`STATE_VERSION`, without connections:
the keeper's image has none):

* ``head``: ``[b"gms-journal", 1, {"version", "body", "layouts"}]``: the
  image's body with no layouts, and ``[name, buckets]`` per layout;
* ``l:<name>``: the layout's head (everything but its metadata column);
* ``m:<name>:<buckets>:<i>``: the metadata entries whose key hashes to
  bucket ``i`` (in no order).  A layout has ``buckets`` of them, a power of
  two chosen so that each holds about :data:`BUCKET_BYTES`; the count is
  kept until the layout's metadata grows or shrinks fourfold.

:class:`PartWriter` (the server's side) knows what changed from the log
entries it has sent since the last base: a metadata entry put or deleted
changes its bucket, any event on a layout its head, and an event that may
change a layout's metadata in bulk (a writer clearing it, an abort, an
eviction, a loss) every bucket of it.  :func:`decode_parts` puts a base back
together, whatever the number of buckets.  Buckets group keys by CRC-32, the
same in every process (format 2; format 1 used Python's ``hash``, which is
not): so a server handed a keeper's base in parts (a restart) sends only what
changed since that base as its first one (:meth:`PartWriter.adopt`), where a
200,000-entry layout re-sent whole cost its restart 0.3 s.
"""

from __future__ import annotations

import zlib

import attrs
import msgpack
from immutables import Map

from ..store import LogEntry
from .image import (
    STATE_VERSION,
    ImageError,
    StateImage,
    image_body,
    layout_head,
    read_body,
    with_metadata,
)

MAGIC = b"gms-journal"
FORMAT = 2  # what this server writes: buckets by CRC-32
READABLE_FORMATS = (1, 2)  # what it reads (1: buckets by the writer's own hash)
HEAD = "head"
BUCKET_BYTES = 1 << 20
MAX_BUCKETS = 1 << 12

# Events that change a layout's metadata only through their own key (the
# metadata events) or not at all.  Any other event on a layout (a writer's
# grant clears it, an abort or an eviction drops it, a lost layout goes)
# makes every bucket of it new.
_METADATA_EVENTS = frozenset({"METADATA_PUT", "METADATA_DELETED"})
_KEEPS_METADATA = frozenset({
    "ALLOCATION_CREATED", "ALLOCATION_FREED", "RW_COMMIT", "RO_CONNECT", "RO_DISCONNECT", "HOST_COPY_CREATED",
    "RESIDENCY_SET", "RESTORE_CLAIMED", "RESTORE_LOADING", "RESTORE_FINISHED", "RESTORE_ABORTED",
    "SESSION_OPENED", "SESSION_CLOSED", "ALLOCATION_OOM_WAIT", "ALLOCATION_OOM_GAVE_UP", "LOCK_TIMEOUT",
    "SESSION_REFUSED", "LAYOUT_REVOKED", "CONNECTION_DROPPED", "READER_JOINED", "READER_LEFT",
})
_EVERY = None  # every bucket of a layout changed

_pack = msgpack.Packer(use_bin_type=True).pack


def _unpack(data: bytes) -> object:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def bucket_count(metadata_bytes: int, kept: int | None) -> int:
    """Buckets for a layout's metadata: ``kept`` while each still holds between a
    quarter and four times :data:`BUCKET_BYTES`, else a power of two near one each."""
    if kept is not None and kept * BUCKET_BYTES // 4 <= metadata_bytes <= kept * BUCKET_BYTES * 4:
        return kept
    if kept == 1 and metadata_bytes <= BUCKET_BYTES * 4:
        return 1
    count = 1
    while count * BUCKET_BYTES < metadata_bytes and count < MAX_BUCKETS:
        count *= 2
    return count


def _bucket(key: str, count: int) -> int:
    return zlib.crc32(key.encode("utf-8", "surrogatepass")) & (count - 1)


def layout_part(name: str) -> str:
    return f"l:{name}"


def bucket_part(name: str, count: int, index: int) -> str:
    return f"m:{name}:{count}:{index}"


class PartWriter:
    """What a server sent as parts, and what changed since."""

    def __init__(self) -> None:
        self._state = None  # the NodeState of the last base (None: none yet, or forgotten)
        self._buckets: dict[str, int] = {}  # layout -> its bucket count in the last base
        self._changed: dict[str, set[str] | None] = {}  # layout -> keys changed since (None: every bucket)
        # An adopted base's rebuilt state: a layout whose metadata is not that very one
        # changed in a way never noted here, so every bucket of it is sent.
        self._rebuilt = None

    def note(self, entries: list[LogEntry]) -> None:
        """Log entries sent since the last base (their layouts, their keys)."""
        changed = self._changed
        for entry in entries:
            event = entry.event
            name = event.layout
            if not name:
                continue
            kind = event.KIND
            if kind in _METADATA_EVENTS:
                keys = changed.get(name, set())
                if keys is not _EVERY:
                    keys.add(event.key)
                    changed[name] = keys
            elif kind not in _KEEPS_METADATA:
                changed[name] = _EVERY

    def forget(self) -> None:
        """The next base is written whole (a new keeper, or a base that did not finish)."""
        self._state, self._buckets, self._changed, self._rebuilt = None, {}, {}, None

    def adopt(self, kept: KeptBase) -> None:
        """The keeper holds ``kept`` (another server's base, this node rebuilt from it
        and its tails): the next base sends what differs from it, the tails' keys
        and any layout whose metadata is not the rebuilt one (the state is
        immutable: the same object, the same entries)."""
        self._state, self._buckets, self._changed, self._rebuilt = kept.state, dict(kept.buckets), {}, kept.rebuilt
        self.note(list(kept.tails))

    def parts(self, image: StateImage) -> tuple[dict[str, bytes], list[str]]:
        """The parts of ``image`` that changed since the last base (all of them
        the first time), and the keys of every part of it."""
        steps = self.steps(image)
        out = {name: data for name, data in steps if name is not None}
        return out, steps.keys

    def steps(self, image: StateImage) -> Steps:
        """:meth:`parts` a step at a time: (key, bytes) per changed part, and
        (None, None) between layouts and buckets, where a caller may let other
        work run (the state is immutable: ``image`` stays what it was).  The
        base is then taken as sent: what is noted from here on is change since
        ``image``."""
        return Steps(self, image)

    def walk(self, image: StateImage, keys: list[str]):
        """The generator behind :class:`Steps`: each part's key appended to ``keys``."""
        state = image.state
        old = self._state
        changed, self._changed = self._changed, {}
        keys.append(HEAD)
        rows = []
        buckets: dict[str, int] = {}
        for name, layout in sorted(state.layouts.items()):
            before = None if old is None else old.layouts.get(name)
            kept = self._buckets.get(name) if before is not None else None
            count = buckets[name] = bucket_count(layout.metadata_bytes, kept)
            rows.append([name, count])
            head = layout_part(name)
            keys.append(head)
            if before is not layout:
                yield head, _pack(layout_head(layout))
            names = [bucket_part(name, count, i) for i in range(count)]
            keys += names
            if before is not None and count == kept and layout.metadata is before.metadata:
                continue  # no bucket changed
            dirty = changed.get(name, _EVERY) if before is not None and count == kept else _EVERY
            rebuilt = None if self._rebuilt is None else self._rebuilt.layouts.get(name)
            if self._rebuilt is not None and (rebuilt is None or rebuilt.metadata is not layout.metadata):
                dirty = _EVERY
            wanted = range(count) if dirty is _EVERY else {_bucket(key, count) for key in dirty}
            if not wanted:
                continue
            grouped: dict[int, list] = {i: [] for i in wanted}
            for n, (key, entry) in enumerate(layout.metadata.items()):
                members = grouped.get(_bucket(key, count))
                if members is not None:
                    members.append(entry)
                if n % 4096 == 4095:
                    yield None, None
            for i, entries in grouped.items():  # (in no order: the reader files them by key)
                yield names[i], _pack(entries)
            yield None, None
        bare = attrs.evolve(state, layouts=Map())
        body = image_body(StateImage(STATE_VERSION, image.server, image.last_seq, image.next_conn, bare))
        yield HEAD, _pack([MAGIC, FORMAT, {"version": STATE_VERSION, "body": body, "layouts": rows}])
        self._state, self._buckets, self._rebuilt = state, buckets, None


class Steps:
    """The changed parts of one base, in order; ``keys`` (every part's) once done."""

    def __init__(self, writer: PartWriter, image: StateImage) -> None:
        self.keys: list[str] = []
        self._writer = writer
        self._image = image

    def __iter__(self):
        keys: list[str] = []
        yield from self._writer.walk(self._image, keys)
        self.keys = keys


@attrs.frozen
class KeptBase:
    """A base the keeper holds in parts and the node a server rebuilt from it
    (``gms.server.restart``: a restart): the base's state and each layout's
    bucket count, the tails' log entries, the state after them."""

    state: object  # NodeState
    buckets: dict[str, int]
    tails: tuple[LogEntry, ...] = ()
    rebuilt: object = None  # NodeState


def decode_parts(parts: dict) -> StateImage:
    """The image a keeper's parts make up (ImageError if they do not)."""
    return _decode(parts)[0]


def decode_kept(parts: dict) -> tuple[StateImage, dict[str, int] | None]:
    """:func:`decode_parts`, and each layout's bucket count (None where the buckets
    are not this format's: the next base is sent whole)."""
    image, fmt, head = _decode(parts)
    return image, ({name: count for name, count in head["layouts"]} if fmt == FORMAT else None)


def _decode(parts: dict) -> tuple[StateImage, int, dict]:
    try:
        magic, fmt, head = _unpack(parts[HEAD])
    except Exception as exc:  # missing, or not the journal's head
        raise ImageError(f"the journal has no readable head: {exc!r}") from None
    if magic != MAGIC or fmt not in READABLE_FORMATS:
        raise ImageError(f"not a gms journal head (format {fmt!r})")
    try:
        body = head["body"]
        layouts = []
        for name, count in head["layouts"]:
            rows = []
            for i in range(count):
                rows += _unpack(parts[bucket_part(name, count, i)])
            layouts.append(with_metadata(_unpack(parts[layout_part(name)]), rows))
        body["node"]["layouts"] = layouts
        version = head["version"]
    except (KeyError, TypeError, ValueError) as exc:
        raise ImageError(f"the journal's parts do not make up a state: {exc!r}") from None
    return read_body(version, body), fmt, head


__all__ = ["KeptBase", "PartWriter", "bucket_count", "decode_kept", "decode_parts"]
