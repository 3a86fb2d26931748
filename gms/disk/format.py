"""A layout's snapshot file: its bytes, then its manifest, then a trailer.  Pure.

::

    [allocation 0's bytes][allocation 1's bytes]...   each at an offset aligned to ALIGN
    [manifest: msgpack]                               at an ALIGN-aligned offset
    [trailer: TRAILER.size bytes]                      magic, version, where the manifest is, its crc32

The data region comes first and every extent starts on an ``ALIGN`` boundary,
so the copier reads and writes it with ``O_DIRECT`` (large aligned transfers,
no page cache in the way).  Each extent (at most ``chunk_bytes`` of one
allocation) carries its own crc32, checked as it is read back: a flipped bit
anywhere refuses the restore, and the layout is dropped, never served.

The manifest says what the file is: the layout's name and hash, who owns it,
its allocations and metadata exactly as the event log holds them, and the
extents.  It is trusted no more than a client: decoding checks every field's
type, and the layout it describes is checked by the rules again
(``LAYOUT_RECOVERED``), its hash recomputed.  A file whose trailer or
manifest does not read (torn, truncated, another format) raises
:class:`CorruptSnapshot`; one of a version this code does not read raises
:class:`UnsupportedSnapshot`.
"""

from __future__ import annotations

import hashlib
import struct

import attrs
import msgpack

from ..checksum import crc32

MAGIC = b"gms-snap"
VERSION = 1  # what this code writes
READABLE = (1,)  # what it reads
ALIGN = 4096  # O_DIRECT's alignment on every file system gms meets (and a page)
CHUNK_BYTES = 32 << 20  # one checksum, one copier transfer
TRAILER = struct.Struct("<8sIIQQI4x")  # magic, version, flags, manifest offset, manifest length, manifest crc32
SUFFIX = ".gsnap"
MAX_MANIFEST_BYTES = 1 << 30  # the node's metadata bound is far below; a bigger one is not ours


class SnapshotError(Exception):
    """A snapshot that cannot be used."""


class CorruptSnapshot(SnapshotError):
    """Torn, truncated, or its bytes do not match their checksums."""


class UnsupportedSnapshot(SnapshotError):
    """Written in a format version this code does not read."""


@attrs.frozen
class Extent:
    """``size`` bytes of allocation ``allocation`` (its index in the manifest) at
    ``offset``, stored at ``file_offset``; ``crc``: their crc32 (0 until saved)."""

    allocation: int
    offset: int
    file_offset: int
    size: int
    crc: int = 0


@attrs.frozen
class Manifest:
    name: str
    layout_hash: str
    owner: str
    allocations: tuple[tuple, ...]  # (id, size, aligned size, tag, slot), in slot order
    metadata: tuple[tuple, ...]  # (key, allocation id, offset, value)
    extents: tuple[Extent, ...]
    chunk_bytes: int = CHUNK_BYTES
    # The save's stamp: the wall clock, or past every snapshot the folder has held
    # (DiskStore.next_stamp): of two snapshots of one layout, the higher wins.
    saved_ns: int = 0
    version: int = VERSION
    residency: str = "unpinned"  # the layout's at its save (older snapshots: unpinned)

    @property
    def data_bytes(self) -> int:
        """Where the data region ends (the manifest starts here)."""
        return max((align_up(e.file_offset + e.size) for e in self.extents), default=0)


def align_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def file_name(name: str, layout_hash: str, saved_ns: int) -> str:
    """A snapshot's file name: a digest of the layout and hash it holds (a layout
    name may hold any character a file name must not), then when it was saved
    (a layout rebuilt with the same structure hashes the same: each save is a
    file of its own, never one a release of the last may remove)."""
    return f"{hashlib.sha256(f'{name}@{layout_hash}'.encode()).hexdigest()[:24]}-{saved_ns:016x}{SUFFIX}"


def stamp_of(file: str) -> int | None:
    """The save stamp a snapshot's file name carries (set-aside names too); None if none.  Pure."""
    base = file[: file.index(SUFFIX)] if SUFFIX in file else ""
    digest, _, stamp = base.rpartition("-")
    if len(digest) != 24 or len(stamp) != 16:
        return None
    try:
        return int(stamp, 16)
    except ValueError:
        return None


def names_it(manifest: Manifest, file: str) -> bool:
    """Whether ``file`` is the name a save of ``manifest`` gave its file."""
    return file == file_name(manifest.name, manifest.layout_hash, manifest.saved_ns)


def plan(sizes: list[int], chunk_bytes: int = CHUNK_BYTES) -> tuple[Extent, ...]:
    """The extents of allocations of ``sizes`` bytes, laid out one after another."""
    if chunk_bytes <= 0 or chunk_bytes % ALIGN:
        raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGN}")
    extents = []
    at = 0
    for index, size in enumerate(sizes):
        for offset in range(0, size, chunk_bytes):
            part = min(chunk_bytes, size - offset)
            extents.append(Extent(index, offset, at + offset, part))
        at = align_up(at + size)
    return tuple(extents)


def encode(manifest: Manifest, at: int) -> bytes:
    """The manifest and trailer as written at ``at`` (``data_bytes``)."""
    body = msgpack.packb(
        {
            "name": manifest.name,
            "layout_hash": manifest.layout_hash,
            "owner": manifest.owner,
            "allocations": [list(a) for a in manifest.allocations],
            "metadata": [list(m) for m in manifest.metadata],
            "extents": [[e.allocation, e.offset, e.file_offset, e.size, e.crc] for e in manifest.extents],
            "chunk_bytes": manifest.chunk_bytes,
            "saved_ns": manifest.saved_ns,
            "residency": manifest.residency,
        },
        use_bin_type=True,
    )
    return body + TRAILER.pack(MAGIC, manifest.version, 0, at, len(body), crc32(body))


def read_trailer(tail: bytes, file_size: int) -> tuple[int, int, int, int]:
    """(version, manifest offset, length, crc) from the file's last bytes."""
    if file_size < TRAILER.size or len(tail) < TRAILER.size:
        raise CorruptSnapshot(f"{file_size} bytes: shorter than a snapshot's trailer")
    magic, version, _flags, at, length, crc = TRAILER.unpack(tail[-TRAILER.size:])
    if magic != MAGIC:
        raise CorruptSnapshot("no snapshot trailer at the end (torn or not a snapshot)")
    if version not in READABLE:
        raise UnsupportedSnapshot(f"snapshot format version {version}; this gms reads {READABLE}")
    if length > MAX_MANIFEST_BYTES or at + length + TRAILER.size != file_size or at % ALIGN:
        raise CorruptSnapshot(f"the trailer places a {length}-byte manifest at {at} in a {file_size}-byte file")
    return version, at, length, crc


def decode(body: bytes, version: int, crc: int, data_end: int | None = None) -> Manifest:
    """The manifest; CorruptSnapshot for anything but a well-formed one.  ``data_end``:
    where the file's data region ends (the manifest's offset), which the
    allocations' sizes must fill exactly."""
    if crc32(body) != crc:
        raise CorruptSnapshot("the manifest does not match its checksum")
    try:
        raw = msgpack.unpackb(body, raw=False, strict_map_key=True)
        manifest = Manifest(
            name=_of(raw["name"], str),
            layout_hash=_of(raw["layout_hash"], str),
            owner=_of(raw["owner"], str),
            allocations=tuple(_row(a, (str, int, int, str, int)) for a in _of(raw["allocations"], list)),
            metadata=tuple(_row(m, (str, str, int, bytes)) for m in _of(raw["metadata"], list)),
            extents=tuple(Extent(*_row(e, (int,) * 5)) for e in _of(raw["extents"], list)),
            chunk_bytes=_of(raw["chunk_bytes"], int),
            saved_ns=_of(raw["saved_ns"], int),
            version=version,
            residency=_of(raw.get("residency", "unpinned"), str),
        )
    except (KeyError, TypeError, ValueError, msgpack.UnpackException) as exc:
        raise CorruptSnapshot(f"the manifest does not parse: {exc!r}"[:300]) from None
    _check_extents(manifest, data_end)
    return manifest


def _of(value, kind: type):
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"{type(value).__name__} where {kind.__name__} was expected")
    return value


def _row(row, kinds: tuple[type, ...]) -> tuple:
    if not isinstance(row, list) or len(row) != len(kinds):
        raise TypeError("a row of another shape")
    return tuple(_of(v, k) for v, k in zip(row, kinds))


def _check_extents(manifest: Manifest, data_end: int | None) -> None:
    """The extents cover every allocation's aligned bytes once, in order, inside the data region.
    Sizes and counts are checked by arithmetic before a plan is made: a forged
    1 TiB allocation in 4 KiB chunks would make 2^28 extents (the server was
    OOM-killed at every cold start, issue 60)."""
    chunk = manifest.chunk_bytes
    if chunk <= 0 or chunk % ALIGN or any(a[2] <= 0 for a in manifest.allocations):
        raise CorruptSnapshot("the manifest's sizes are not a snapshot's")
    end = 0
    for allocation in manifest.allocations:
        end = align_up(end + allocation[2])
    if data_end is not None and end != data_end:
        raise CorruptSnapshot(f"the manifest's allocations need {end} bytes of data, the file holds {data_end}")
    if sum(-(-a[2] // chunk) for a in manifest.allocations) != len(manifest.extents):
        raise CorruptSnapshot("the manifest's extents do not cover its allocations as a snapshot lays them out")
    expected = plan([a[2] for a in manifest.allocations], chunk)
    got = tuple(attrs.evolve(e, crc=0) for e in manifest.extents)
    if got != expected:
        raise CorruptSnapshot("the manifest's extents do not cover its allocations as a snapshot lays them out")
