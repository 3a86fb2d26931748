"""The state a server hands over: what it is, and its encoding, in one place.

A :class:`StateImage` is everything a new server needs besides the fds: the
node's state (``NodeState``), where the event log stands (``last_seq``) and
how connections are numbered (``next_conn``), who wrote it (``ServerInfo``)
and, for a live take-over, every connection's session (``ConnImage``: its
protocol object, a request it waits on) and the lock queues' order.  The
keeper's copy (its *base*) has no connections: a crash closes them.

The encoding is versioned and deterministic (tables in sorted order: the same
state encodes to the same bytes in any process).  ``encode_image`` writes
``[b"gms-state", version, body]`` (msgpack; the body msgpack again), so a
reader learns the version before it parses anything else, reads every
version in ``READABLE_VERSIONS`` and refuses the others with
:class:`UnsupportedVersion`, naming both.  Each version's body is spelled
out below field by field (not derived from the classes, so a change to a
state class cannot change the format behind the version's back), and each
has a frozen fixture every later server must still read
(``tests/fixtures/state_v<N>.bin``).  A server writes only the current
version; it reads the older ones, filling what they lack as their writers
had it (version 1 came before issue 21's bounds: its tenants and node read
as unbounded in metadata and layouts, and the counts those bounds keep are
recounted from the layouts and sessions it carries; versions 1 and 2 came
before a metadata entry was charged more than its bytes: their limits read
``metadata_entry_bytes`` 0, as their totals were counted).

Log entries travel to the keeper in the same terms (``encode_entries``): the
event's kind and its fields by name, so a reader fills defaults for fields
it has and an older writer did not.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable

import attrs
import msgpack
from immutables import Map

from ..fsm import EVENT_TYPES, Limits, NodeState, SessionInfo, TenantState
from ..fsm.state import Allocation, LayoutState, MetadataEntry, Residency, Tier
from ..store import LogEntry
from .words import Waiting

MAGIC = b"gms-state"
STATE_VERSION = 5  # what this server writes
READABLE_VERSIONS = (1, 2, 3, 4, 5)  # what it reads


class ImageError(ValueError):
    """Bytes that are not a state image this server can read."""


class UnsupportedVersion(ImageError):
    def __init__(self, version: object) -> None:
        readable = ", ".join(map(str, READABLE_VERSIONS))
        super().__init__(
            f"the state is in hand-over format version {version!r}; this server reads version(s) {readable}"
        )
        self.version = version


@attrs.frozen
class ServerInfo:
    """Who wrote the image: a server of which device, on which backend."""

    pid: int
    backend: str
    device: int
    device_uuid: str
    host_tier: bool


@attrs.frozen
class ProtocolImage:
    """A :class:`gms.wire.connection.ServerConnection` at a quiet point: its
    state, and the bytes read ahead that no request has been made of yet."""

    state: str
    handshaken: bool
    requests: int
    buffered: bytes
    eof: bool
    one_shot: bool
    serving: bytes = b""  # the request being served, as its wire body ("" when none)


@attrs.frozen
class PendingImage:
    """A request a connection waits on at the quiet point (the new server goes on with it).

    ``lock``: a handshake waiting for ``requested`` with ``timeout_left_ms``
    left (None: no limit); if it was granted while the server paused,
    ``granted`` (``RW``/``RO``) and ``restore`` say what.  ``restore``: a
    granted restore waiting for GPU memory.  ``allocate``: an allocation
    waiting for memory (made again from the start: nothing was created)."""

    kind: Waiting
    requested: str = ""
    timeout_left_ms: int | None = None
    granted: str = ""
    restore: bool = False


PENDING_KINDS = tuple(Waiting)


@attrs.frozen
class ConnImage:
    conn: int
    protocol: ProtocolImage
    pending: PendingImage | None = None
    # What is left of its first request's deadline (--handshake-timeout), for a
    # connection that has made none yet; None: it has (or, version 1, unknown).
    first_request_left_ms: int | None = None


@attrs.frozen
class StateImage:
    version: int
    server: ServerInfo
    last_seq: int
    next_conn: int
    state: NodeState
    conns: tuple[ConnImage, ...] = ()
    queues: tuple[tuple[str, tuple[int, ...]], ...] = ()  # per layout, the waiting conns in order


# -- version 1 ------------------------------------------------------------------


def _limits_v1(limits: Limits) -> dict:
    return limits.as_dict()


def metadata_rows(entries: Iterable[MetadataEntry]) -> list[MetadataEntry]:
    """Metadata entries as a layout's ``metadata`` column holds them, sorted by key:
    each a row [key, allocation id, offset, value] (a MetadataEntry is that tuple)."""
    return sorted(entries, key=_by_key)


_by_key = operator.itemgetter(0)


def _layout_v1(layout: LayoutState) -> dict:
    return with_metadata(layout_head(layout), metadata_rows(layout.metadata.values()))


def with_metadata(head: dict, rows: list[list]) -> dict:
    """A layout head and its metadata column, in the order the formats write them."""
    body = {}
    for key, value in head.items():
        body[key] = value
        if key == "allocations":
            body["metadata"] = rows
    return body


# The image's word for each tier: the first is "gpu" in every version (users call it
# "device" since 2026-12), so images stay as they were, a server of before reads one of
# today, and the frozen fixtures of each version still read and write back the same.
_TIER_WORDS = {Tier.GPU: "gpu"}
_TIERS_READ = {word: tier for tier, word in _TIER_WORDS.items()}


def layout_head(layout: LayoutState) -> dict:
    """A layout as version 1 and 2 write it, but for its ``metadata`` column
    (the keeper's journal keeps that in parts of its own: ``gms.handover.journal``)."""
    head = {
        "name": layout.name,
        "writer": layout.writer,
        "readers": sorted(layout.readers),
        "committed": layout.committed,
        "allocations": [
            [a.allocation_id, a.size, a.aligned_size, a.tag, a.layout_slot]
            for a in sorted(layout.allocations.values(), key=lambda a: a.layout_slot)
        ],
        "metadata_bytes": layout.metadata_bytes,
        "layout_hash": layout.layout_hash,
        "next_layout_slot": layout.next_layout_slot,
        "held_bytes": layout.held_bytes,
        "owner": layout.owner,
        "residency": layout.residency.value,
        "tier": _TIER_WORDS.get(layout.tier, layout.tier.value),
        "restorer": layout.restorer,
        "host_copies": sorted([k, v] for k, v in layout.host_copies.items()),
        "host_bytes": layout.host_bytes,
        "persist": layout.persist,  # (version 4: the disk tier; absent before, read as none)
        "disk_bytes": layout.disk_bytes,
        "disk_file": layout.disk_file,
        "last_use": layout.last_use,
        "loads": layout.loads,
        "restores": layout.restores,
        "evictions": layout.evictions,
    }
    if layout.kept_file:  # (version 5: a snapshot kept through a rebuild; only where there is one)
        head["kept"] = [layout.kept_file, layout.kept_bytes, layout.kept_owner]
    if layout.save_error:  # (version 5: why its save waits; only where one failed)
        head["save_error"] = layout.save_error
    if layout.unserved:  # (version 5: why its snapshot was not served; only where one was not)
        head["unserved"] = layout.unserved
    return head


def _node_v1(node: NodeState) -> dict:
    return {
        "started": node.started,
        "capacity_bytes": node.capacity_bytes,
        "budget_bytes": node.budget_bytes,
        "host_budget_bytes": node.host_budget_bytes,
        "limits": _limits_v1(node.limits),
        "layouts": [_layout_v1(layout) for _, layout in sorted(node.layouts.items())],
        "sessions": [
            [conn, s.layout, s.tenant, s.uid, s.gid, s.pid, s.lock_type, s.limit_bytes]
            for conn, s in sorted(node.sessions.items())
        ],
        "tenants": [[t.name, t.quota_bytes, t.used_bytes, t.sessions] for _, t in sorted(node.tenants.items())],
        "gpu_bytes": node.gpu_bytes,
        "host_bytes": node.host_bytes,
        "tick": node.tick,
    }


def _conn_v1(conn: ConnImage) -> dict:
    p = conn.protocol
    out = {
        "conn": conn.conn,
        "protocol": [p.state, p.handshaken, p.requests, p.buffered, p.eof, p.one_shot, p.serving],
        "pending": None,
    }
    if conn.pending is not None:
        w = conn.pending
        out["pending"] = [Waiting(w.kind).value, w.requested, w.timeout_left_ms, w.granted, w.restore]
    return out


def _body_v1(image: StateImage) -> dict:
    s = image.server
    return {
        "server": [s.pid, s.backend, s.device, s.device_uuid, s.host_tier],
        "last_seq": image.last_seq,
        "next_conn": image.next_conn,
        "node": _node_v1(image.state),
        "conns": [_conn_v1(c) for c in image.conns],
        "queues": [[layout, list(conns)] for layout, conns in image.queues],
    }


def _read_layout_v1(d: dict) -> LayoutState:
    allocations = Map({
        i: Allocation(allocation_id=i, size=size, aligned_size=aligned, tag=tag, layout_slot=slot)
        for i, size, aligned, tag, slot in d["allocations"]
    })
    ids = {i: i for i in allocations}  # each entry shares its allocation's id string (not one per entry)
    entries = [MetadataEntry(key, ids.get(i, i), offset, value) for key, i, offset, value in d["metadata"]]
    metadata = Map(zip(map(_by_key, entries), entries))
    keys: dict[str, dict[str, None]] = {}
    if not d["committed"]:  # a writer's layout: its index (a committed one keeps none, see LayoutState)
        for key, allocation_id, _, _ in entries:
            keys.setdefault(allocation_id, {})[key] = None
    return LayoutState(
        name=d["name"],
        writer=d["writer"],
        readers=frozenset(d["readers"]),
        committed=d["committed"],
        allocations=allocations,
        metadata=metadata,
        keys_by_allocation=Map({k: Map(v) for k, v in keys.items()}),
        metadata_bytes=d["metadata_bytes"],
        layout_hash=d["layout_hash"],
        next_layout_slot=d["next_layout_slot"],
        held_bytes=d["held_bytes"],
        owner=d["owner"],
        residency=Residency(d["residency"]),
        tier=_TIERS_READ.get(d["tier"]) or Tier(d["tier"]),
        restorer=d["restorer"],
        host_copies=Map({k: v for k, v in d["host_copies"]}),
        host_bytes=d["host_bytes"],
        persist=d.get("persist", False),
        disk_bytes=d.get("disk_bytes", 0),
        disk_file=d.get("disk_file", ""),
        **_read_kept(d.get("kept")),
        save_error=d.get("save_error", ""),
        unserved=d.get("unserved", ""),
        last_use=d["last_use"],
        loads=d["loads"],
        restores=d["restores"],
        evictions=d["evictions"],
    )


def _read_kept(row: list | None) -> dict:
    if row is None:
        return {}
    file, size, owner = row
    return {"kept_file": file, "kept_bytes": size, "kept_owner": owner}


def _read_node_v1(d: dict) -> NodeState:
    layouts = [_read_layout_v1(layout) for layout in d["layouts"]]
    return NodeState(
        started=d["started"],
        capacity_bytes=d["capacity_bytes"],
        budget_bytes=d["budget_bytes"],
        host_budget_bytes=d["host_budget_bytes"],
        limits=Limits.from_dict(d["limits"]),
        layouts=Map({layout.name: layout for layout in layouts}),
        sessions=Map({
            conn: SessionInfo(
                layout=layout, tenant=tenant, uid=uid, gid=gid, pid=pid, lock_type=lock, limit_bytes=limit
            )
            for conn, layout, tenant, uid, gid, pid, lock, limit in d["sessions"]
        }),
        tenants=Map({
            name: TenantState(name=name, quota_bytes=quota, used_bytes=used, sessions=sessions)
            for name, quota, used, sessions in d["tenants"]
        }),
        gpu_bytes=d["gpu_bytes"],
        host_bytes=d["host_bytes"],
        tick=d["tick"],
    )


def _read_conn_v1(d: dict) -> ConnImage:
    state, handshaken, requests, buffered, eof, one_shot, serving = d["protocol"]
    protocol = ProtocolImage(
        state=state, handshaken=handshaken, requests=requests, buffered=buffered, eof=eof,
        one_shot=one_shot, serving=serving,
    )
    pending = None
    if d["pending"] is not None:
        kind, requested, left, granted, restore = d["pending"]
        if kind not in PENDING_KINDS:
            raise ImageError(f"a connection waits on {kind!r}, which this server does not know")
        pending = PendingImage(
            kind=Waiting(kind), requested=requested, timeout_left_ms=left, granted=granted, restore=restore
        )
    return ConnImage(conn=d["conn"], protocol=protocol, pending=pending)


def _read_server_v1(row: list) -> ServerInfo:
    pid, backend, device, device_uuid, host_tier = row
    return ServerInfo(pid=pid, backend=backend, device=device, device_uuid=device_uuid, host_tier=host_tier)


def _read_image(body: dict, version: int, node: NodeState) -> StateImage:
    """What every version's body holds alike around its node."""
    return StateImage(
        version=version,
        server=_read_server_v1(body["server"]),
        last_seq=body["last_seq"],
        next_conn=body["next_conn"],
        state=node,
        conns=tuple(_read_conn_v1(c) for c in body["conns"]),
        queues=tuple((layout, tuple(conns)) for layout, conns in body["queues"]),
    )


def _recount_v1(node: NodeState) -> NodeState:
    """What a version-1 node implies of the counts issue 21 added: metadata bytes
    per owner and node-wide, and each tenant's layouts (owned, plus those its
    sessions may write).  Its bounds stay None: a version-1 server had none
    (the new server's SERVER_RESUMED sets its own)."""
    metadata: dict[str, int] = {}
    refs: dict[str, dict[str, int]] = {}
    for name, layout in node.layouts.items():
        if layout.owner is not None:
            metadata[layout.owner] = metadata.get(layout.owner, 0) + layout.metadata_bytes
            owned = refs.setdefault(layout.owner, {})
            owned[name] = owned.get(name, 0) + 1
    for session in node.sessions.values():
        if session.lock_type != "RO":
            mine = refs.setdefault(session.tenant, {})
            mine[session.layout] = mine.get(session.layout, 0) + 1
    tenants = Map({
        name: attrs.evolve(
            tenant, metadata_bytes=metadata.get(name, 0), layout_refs=Map(refs.get(name, {}))
        )
        for name, tenant in node.tenants.items()
    })
    return attrs.evolve(
        node, tenants=tenants, metadata_bytes=sum(layout.metadata_bytes for layout in node.layouts.values())
    )


def _read_v1(body: dict) -> StateImage:
    return _read_image(body, 1, _recount_v1(_read_node_v1(body["node"])))


# -- version 2: issue 21's bounds and counts, a connection's first-request deadline ---

# Spelled out: a field added to Limits is a new version, not a silent change of this one.
_LIMITS_V2 = (
    "max_layouts", "max_allocations", "max_metadata_keys", "max_metadata_value_bytes", "max_key_bytes",
    "max_tag_bytes", "max_allocation_bytes", "max_metadata_bytes", "tenant_metadata_quota", "tenant_max_layouts",
)


def _tenant_v2(t: TenantState) -> list:
    return [
        t.name, t.quota_bytes, t.used_bytes, t.sessions, t.metadata_quota, t.metadata_bytes, t.max_layouts,
        sorted([layout, refs] for layout, refs in t.layout_refs.items()),
    ]


def _node_v2(node: NodeState) -> dict:
    body = _node_v1(node)
    body["limits"] = [[name, getattr(node.limits, name)] for name in _LIMITS_V2]
    body["tenants"] = [_tenant_v2(t) for _, t in sorted(node.tenants.items())]
    body["metadata_bytes"] = node.metadata_bytes
    return body


def _conn_v2(conn: ConnImage) -> dict:
    out = _conn_v1(conn)
    out["first_request_left_ms"] = conn.first_request_left_ms
    return out


def _body_v2(image: StateImage) -> dict:
    body = _body_v1(image)
    body["node"] = _node_v2(image.state)
    body["conns"] = [_conn_v2(c) for c in image.conns]
    return body


def _read_tenant_v2(row: list) -> TenantState:
    name, quota, used, sessions, metadata_quota, metadata_bytes, max_layouts, refs = row
    return TenantState(
        name=name, quota_bytes=quota, used_bytes=used, sessions=sessions, metadata_quota=metadata_quota,
        metadata_bytes=metadata_bytes, max_layouts=max_layouts, layout_refs=Map({k: v for k, v in refs}),
    )


def _read_node_v2(d: dict) -> NodeState:
    node = _read_node_v1({**d, "limits": {}, "tenants": []})
    return attrs.evolve(
        node,
        limits=Limits(**{"metadata_entry_bytes": 0, **dict(d["limits"])}),  # (version 2 had no such charge)
        tenants=Map({t.name: t for t in map(_read_tenant_v2, d["tenants"])}),
        metadata_bytes=d["metadata_bytes"],
    )


def _read_v2(body: dict, version: int = 2) -> StateImage:
    image = _read_image(body, version, _read_node_v2(body["node"]))
    return attrs.evolve(
        image,
        conns=tuple(
            attrs.evolve(c, first_request_left_ms=raw["first_request_left_ms"])
            for c, raw in zip(image.conns, body["conns"])
        ),
    )


# -- version 3: a metadata entry's own cost (Limits.metadata_entry_bytes) ---------------

_LIMITS_V3 = (*_LIMITS_V2, "metadata_entry_bytes")


def _body_v3(image: StateImage) -> dict:
    body = _body_v2(image)
    body["node"]["limits"] = [[name, getattr(image.state.limits, name)] for name in _LIMITS_V3]
    return body


def _read_v3(body: dict) -> StateImage:
    if [name for name, _ in body["node"]["limits"]] != list(_LIMITS_V3):
        raise ImageError(f"a version-3 image's limits are not {_LIMITS_V3}")
    return _read_v2(body, 3)


# -- version 4: the disk tier (its budget and bytes, each tenant's disk quota and bytes) ----


def _body_v4(image: StateImage) -> dict:
    body = _body_v3(image)
    node = image.state
    body["node"]["disk_budget_bytes"] = node.disk_budget_bytes
    body["node"]["disk_bytes"] = node.disk_bytes
    for row, (_, tenant) in zip(body["node"]["tenants"], sorted(node.tenants.items())):
        row += [tenant.disk_quota, tenant.disk_bytes]
    return body


def _read_v4(body: dict) -> StateImage:
    node = body["node"]
    disk = {row[0]: row[8:] for row in node["tenants"]}
    for row in node["tenants"]:
        del row[8:]
    image = _read_v3(body)
    state = image.state
    tenants = Map({
        name: attrs.evolve(tenant, disk_quota=disk[name][0], disk_bytes=disk[name][1])
        for name, tenant in state.tenants.items()
    })
    state = attrs.evolve(
        state, tenants=tenants, disk_budget_bytes=node["disk_budget_bytes"], disk_bytes=node["disk_bytes"],
    )
    return attrs.evolve(image, version=4, state=state)


# -- version 5: a layout's snapshot kept through a rebuild (its "kept" row), why its save waits --
# Written as version 4 is; the version says that an older gms, which would drop the row
# (and lose the file from its log), may not read it.


def _read_v5(body: dict) -> StateImage:
    return attrs.evolve(_read_v4(body), version=5)


_WRITERS = {5: _body_v4}  # only the current version is written
_READERS = {1: _read_v1, 2: _read_v2, 3: _read_v3, 4: _read_v4, 5: _read_v5}


# -- the envelope --------------------------------------------------------------------


_pack = msgpack.Packer(use_bin_type=True).pack  # made once: ``msgpack.packb`` makes one per call


def _unpack(data: bytes) -> object:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def image_body(image: StateImage, version: int = STATE_VERSION) -> dict:
    """The body of ``image`` in ``version`` (only the current one is written)."""
    writer = _WRITERS.get(version)
    if writer is None:
        raise UnsupportedVersion(version)
    return writer(image)


def read_body(version: int, body: object) -> StateImage:
    """An image from a body of ``version``: UnsupportedVersion for one this server
    does not read, ImageError for a body that does not parse."""
    reader = _READERS.get(version)
    if reader is None:
        raise UnsupportedVersion(version)
    try:
        return reader(body)
    except ImageError:
        raise
    except Exception as exc:  # a malformed body of a known version
        raise ImageError(f"a version-{version} state image that does not parse: {exc!r}") from None


def encode_image(image: StateImage, version: int = STATE_VERSION) -> bytes:
    return _pack([MAGIC, version, _pack(image_body(image, version))])


def image_version(data: bytes) -> int:
    """The version of an image, read before anything else of it."""
    try:
        magic, version, _ = _unpack(data)
    except Exception as exc:  # any failure to parse: not an image
        raise ImageError(f"not a gms state image: {exc}") from None
    if magic != MAGIC or not isinstance(version, int):
        raise ImageError("not a gms state image (no magic, or no version)")
    return version


def decode_image(data: bytes) -> StateImage:
    """Raises UnsupportedVersion for a version this server does not read,
    ImageError for anything else it cannot parse."""
    version = image_version(data)
    if version not in _READERS:
        raise UnsupportedVersion(version)
    try:
        body = _unpack(_unpack(data)[2])
    except Exception as exc:
        raise ImageError(f"a version-{version} state image that does not parse: {exc!r}") from None
    return read_body(version, body)


# -- log entries ---------------------------------------------------------------------------

_FIELDS: dict[type, tuple[str, ...]] = {}
_VALUES: dict[type, Callable[[object], tuple]] = {}  # an event's field values, in one C call


def _fields(cls: type) -> tuple[str, ...]:
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in attrs.fields(cls))
    return names


def _values(cls: type) -> Callable[[object], tuple]:
    getter = _VALUES.get(cls)
    if getter is None:  # (every event has two fields at least, conn and layout: a tuple)
        getter = _VALUES[cls] = operator.attrgetter(*_fields(cls))
    return getter


def entry_row(entry: LogEntry) -> list:
    event = entry.event
    cls = type(event)
    fields = dict(zip(_fields(cls), _values(cls)(event)))
    return [entry.seq, entry.mono_ns, entry.wall_ns, event.KIND, fields]


def encode_entries(entries: Iterable[LogEntry]) -> bytes:
    return _pack([entry_row(entry) for entry in entries])


def decode_entries(data: bytes) -> list[LogEntry]:
    """Raises ImageError for an entry that is not an event this server knows."""
    out = []
    try:
        rows = _unpack(data)
    except Exception as exc:
        raise ImageError(f"log entries that do not parse: {exc}") from None
    for row in rows:
        try:
            seq, mono_ns, wall_ns, kind, fields = row
            cls = EVENT_TYPES[kind]
            names = set(_fields(cls))
            event = cls(**{k: v for k, v in fields.items() if k in names})
        except Exception as exc:
            raise ImageError(f"a log entry this server cannot read ({exc!r}): {row!r:.200}") from None
        out.append(LogEntry(seq, mono_ns, wall_ns, event))
    return out
