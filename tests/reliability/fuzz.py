"""A seeded generator of hostile frames, and what the server must do with each.

Every frame comes with the behaviour the protocol contract demands, worked
out locally with the same codec the server uses (``gms.wire.decode``): an
undecodable frame (not msgpack, not a map, a field of the wrong type, over
the size cap) drops the connection without an answer; a decodable one gets
an answer, an error or not (never a drop); an unknown type gets
``UNKNOWN_MESSAGE``.  Nothing here knows what a valid answer is beyond that:
the model-based machines check answers, this checks that hostile input
never breaks the boundary.

Kinds of frames (``KINDS``): random bytes, random msgpack, well-formed
requests with plausible and hostile values (foreign allocation ids of
another layout, out-of-range offsets, too many keys, huge keys and values,
bad layout names, huge and negative integers), mutated requests (wrong
types, missing and extra fields, NaN, deep nesting, bad ``type``), frames
of zero length, over the cap, and truncated.
"""

from __future__ import annotations

import random
import string
import struct
from collections.abc import Callable

import attrs
import msgpack

from gms.wire import MalformedMessage, UnknownMessageType, decode
from gms.wire import messages as m
from gms.wire.connection import PRE_SESSION_MAX_FRAME_BYTES

HEADER = struct.Struct(">I")
INT_EDGES = (0, 1, -1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1)
BAD_LAYOUT_NAMES = ("", ".hidden", "../etc", "a b", "x" * 129, "ünïcode", "a\nb", "-x", "/", "a\x00b")
ALPHABET = string.ascii_letters + string.digits + "._-/"
# What a client can send the server: its own socket (alive in flight while
# unread), a pipe's ends, /dev/null, a memfd of its own.
FD_KINDS = ("own-socket", "pipe-read", "pipe-write", "devnull", "memfd")
HOSTILE_TEXT = ("", " ", "\x00", "ü" * 10, "../../", "%s%n", "\u202e", "🙂" * 3)


@attrs.frozen
class Frame:
    kind: str
    data: bytes  # exactly what is sent
    expect: str  # "reply", "drop", "maybe" (may wait, or what follows decides), "close" (we hang up after it)
    message: object = None  # the decoded request, when there is one
    # fds to send TO the server with it (SCM_RIGHTS), by kind: see FD_KINDS
    attach_fds: tuple[str, ...] = ()


@attrs.define
class Context:
    """What the campaign knows while generating for one connection."""

    own_ids: list[str]  # allocation ids this connection may see
    foreign_ids: list[str]  # another layout's ids
    layouts: list[str]  # names worth using
    max_frame_bytes: int
    handshaken: bool = False
    frames_sent: int = 0


def frame(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


def expectation(body: bytes, ctx: Context) -> tuple[str, object]:
    """What the contract demands for a whole frame with this body (before a
    handshake succeeds, frames are held to the smaller pre-session cap)."""
    cap = ctx.max_frame_bytes if ctx.handshaken else min(ctx.max_frame_bytes, PRE_SESSION_MAX_FRAME_BYTES)
    if len(body) > cap:
        return "drop", None
    try:
        message = decode(body)
    except MalformedMessage:
        return "drop", None
    except UnknownMessageType:
        return "reply", None
    return ("maybe" if _may_wait(message) else "reply"), message


def _may_wait(message) -> bool:
    # A handshake may wait for its lock (a hostile timeout_ms: long); an
    # allocation for memory (the campaign's server gives up after a moment).
    if isinstance(message, m.HandshakeRequest):
        return message.timeout_ms is None or message.timeout_ms > 200
    return False


class Fuzzer:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.kinds: list[tuple[str, float, Callable[[Context], Frame]]] = [
            ("valid", 30, self.valid),
            ("mutated", 25, self.mutated),
            ("random-msgpack", 10, self.random_msgpack),
            ("random-bytes", 8, self.random_bytes),
            ("unknown-type", 4, self.unknown_type),
            ("deep-nesting", 3, self.deep_nesting),
            ("zero-length", 2, self.zero_length),
            ("oversized", 2, self.oversized),
            ("truncated", 3, self.truncated),
            ("split-header", 2, self.split_header),
            ("with-fds", 5, self.with_fds),
            ("huge-strings", 2, self.huge_strings),
            ("too-many-keys", 2, self.too_many_keys),
            ("foreign-ids", 5, self.foreign_ids),
        ]
        self._weights = [w for _, w, _ in self.kinds]

    def next(self, ctx: Context, last: bool = False) -> Frame:
        """A frame of any kind.  Before a connection's ``last`` frame, mostly
        ones the session survives, so connections live long enough to build
        layouts and reach deeper states."""
        while True:
            _, _, make = self.rng.choices(self.kinds, self._weights)[0]
            f = make(ctx)
            if last or f.expect not in ("drop", "close") or self.rng.random() < 0.15:
                ctx.frames_sent += 1
                return f

    # -- values ---------------------------------------------------------------------------

    def text(self, short: bool = True) -> str:
        r = self.rng
        if r.random() < 0.2:
            return r.choice(HOSTILE_TEXT)
        return "".join(r.choices(ALPHABET, k=r.randint(0, 12 if short else 2000)))

    def integer(self) -> int:
        r = self.rng
        if r.random() < 0.4:
            return r.choice(INT_EDGES)
        return r.randint(-5, 64 << 20)

    def allocation_id(self, ctx: Context) -> str:
        r = self.rng
        pool = r.choice([ctx.own_ids, ctx.foreign_ids, ctx.own_ids])
        if pool and r.random() < 0.85:
            return r.choice(pool)
        return r.choice(["", "0" * 32, self.text(), r.randbytes(16).hex()])

    def layout(self, ctx: Context) -> str:
        r = self.rng
        return r.choice(BAD_LAYOUT_NAMES) if r.random() < 0.2 else r.choice(ctx.layouts)

    def field(self, name: str, ctx: Context):
        r = self.rng
        if name == "allocation_id":
            return self.allocation_id(ctx)
        if name == "allocation_ids":
            return [self.allocation_id(ctx) for _ in range(r.choice([0, 1, 2, 5, 253, 254]))]
        if name == "size":
            return r.choice([r.randint(1, 8 << 20), 0, -1, 2 << 20, self.integer()])
        if name == "tag":
            return r.choice(["weights", "kv", "", "t" * 257, self.text()])
        if name == "key":
            return r.choice([f"k{r.randint(0, 300)}", "", "k" * 1025, self.text()])
        if name == "value":
            return r.randbytes(r.choice([0, 1, 16, 4096, 4097, 20_000]))
        if name == "offset_bytes":
            return r.choice([0, 1, (2 << 20) - 1, 2 << 20, 8 << 20, -1, 2**63 - 1, self.integer()])
        if name == "prefix":
            return r.choice(["", "k", "k1", self.text(), "p" * r.randint(1, 3000)])
        if name == "lock_type":
            return r.choice(["RW", "RO", "RW_OR_RO", "RO", "rw", "", "ADMIN"])
        if name == "timeout_ms":
            return r.choice([0, 1, 20, 50, None, -1, 2**63 - 1]) if r.random() < 0.1 else r.randint(0, 50)
        if name == "layout":
            return self.layout(ctx)
        if name == "limit_bytes":
            return r.choice([None, 0, 1, 2 << 20, -1, 2**64 - 1])
        if name == "residency":
            return r.choice([None, "device", "system", "unpinned", "gpu", ""])
        if name in ("since_seq", "limit"):
            return r.choice([None, 0, 1, 10, -1, 2**63 - 1, -(2**63), self.integer()])
        if name == "entries":
            count = r.choice([0, 1, 3, 50])
            return [self.entry(ctx) for _ in range(count)]
        return self.random_object(2)

    def entry(self, ctx: Context) -> dict:
        return {
            "key": self.field("key", ctx),
            "allocation_id": self.allocation_id(ctx),
            "offset_bytes": self.field("offset_bytes", ctx),
            "value": self.field("value", ctx),
        }

    def random_object(self, depth: int):
        r = self.rng
        choice = r.randrange(10 if depth > 0 else 8)
        if choice == 0:
            return None
        if choice == 1:
            return r.random() < 0.5
        if choice == 2:
            return self.integer()
        if choice == 3:
            return r.choice([float("nan"), float("inf"), -0.0, 1.5, 1e308])
        if choice == 4:
            return self.text()
        if choice == 5:
            return r.randbytes(r.randint(0, 32))
        if choice == 6:
            if r.random() < 0.3:  # ext -1: unpacks to a Timestamp object
                return msgpack.Timestamp(r.randint(0, 2**32 - 1), r.randint(0, 999_999_999))
            return msgpack.ExtType(r.randint(0, 127), r.randbytes(r.randint(0, 8)))
        if choice == 7:
            return r.choice(["type", "size", "RW", ""])
        if choice == 8:
            return [self.random_object(depth - 1) for _ in range(r.randint(0, 4))]
        return {self.text(): self.random_object(depth - 1) for _ in range(r.randint(0, 4))}

    # -- requests -------------------------------------------------------------------------

    def request_map(self, ctx: Context, cls: type | None = None) -> dict:
        r = self.rng
        if cls is None:
            if not ctx.handshaken and r.random() < 0.3:
                cls = m.HandshakeRequest
            else:
                cls = r.choice(m.REQUESTS + (m.HandshakeResponse, m.ErrorResponse, m.CommitResponse))
        body = {"type": cls.__name__}
        for f in attrs.fields(cls):
            if f.default is not attrs.NOTHING and r.random() < 0.3:
                continue  # leave an optional field out
            body[f.name] = self.field(f.name, ctx)
        if cls is m.ListAllocationsRequest:
            body["tag"] = r.choice([None, "weights", "", self.text()])
        return body

    def pack(self, body: dict, ctx: Context, kind: str) -> Frame:
        try:
            data = msgpack.packb(body, use_bin_type=True)
        except (OverflowError, ValueError, TypeError):
            data = msgpack.packb({"type": "GetStateHashRequest"})
        expect, message = expectation(data, ctx)
        return Frame(kind, frame(data), expect, message)

    def valid(self, ctx: Context) -> Frame:
        return self.pack(self.request_map(ctx), ctx, "valid")

    def mutated(self, ctx: Context) -> Frame:
        r = self.rng
        body = self.request_map(ctx)
        fields = [k for k in body if k != "type"]
        for _ in range(r.randint(1, 3)):
            how = r.randrange(7)
            if how == 0 and fields:  # a wrong type
                body[r.choice(fields)] = self.random_object(2)
            elif how == 1 and fields:  # a missing field
                body.pop(r.choice(fields), None)
            elif how == 2:  # extra fields
                body[self.text()] = self.random_object(2)
            elif how == 3 and fields:  # huge or negative integers, NaN
                body[r.choice(fields)] = r.choice(INT_EDGES + (float("nan"), float("-inf")))
            elif how == 4:  # a bad type name
                body["type"] = r.choice([None, 7, b"AllocateRequest", "", "allocaterequest", self.text(), ["x"]])
            elif how == 5 and fields:  # bool for int, str for bytes, bytes for str
                name = r.choice(fields)
                value = body.get(name)
                body[name] = {int: True, str: b"x", bytes: "x", bool: 1}.get(type(value), None)
            elif how == 6:  # a nested map where a field goes
                body[r.choice(fields or ["type"])] = {"a": {"b": [1, 2, {"c": None}]}}
        return self.pack(body, ctx, "mutated")

    def random_msgpack(self, ctx: Context) -> Frame:
        value = self.random_object(3)
        if self.rng.random() < 0.5:
            value = {"type": self.rng.choice([m.AllocateRequest.__name__, self.text()]), "x": value}
        return self.pack(value, ctx, "random-msgpack")

    def random_bytes(self, ctx: Context) -> Frame:
        body = self.rng.randbytes(self.rng.choice([1, 2, 5, 17, 100, 1000]))
        expect, message = expectation(body, ctx)
        return Frame("random-bytes", frame(body), expect, message)

    def unknown_type(self, ctx: Context) -> Frame:
        body = {"type": self.rng.choice(["NoSuchRequest", "HandshakeRequestV2", self.text() + "X"])}
        return self.pack(body, ctx, "unknown-type")

    def deep_nesting(self, ctx: Context) -> Frame:
        r = self.rng
        depth = r.choice([64, 500, 5000, 100_000])
        nested = (b"\x91" if r.random() < 0.5 else b"\x81\xa1k") * depth + b"\xc0"
        field = r.choice([b"\xa4size", b"\xa3tag", b"\xa5extra"])
        body = b"\x83" + msgpack.packb("type") + msgpack.packb("AllocateRequest") + field + nested
        body += msgpack.packb("lock") + msgpack.packb(1)
        expect, message = expectation(body, ctx)
        return Frame("deep-nesting", frame(body), expect, message)

    def zero_length(self, ctx: Context) -> Frame:
        return Frame("zero-length", frame(b""), "drop")

    def oversized(self, ctx: Context) -> Frame:
        r = self.rng
        length = r.choice([ctx.max_frame_bytes + 1, 2**31, 2**32 - 1])
        return Frame("oversized", HEADER.pack(length) + r.randbytes(r.randint(0, 64)), "drop")

    def truncated(self, ctx: Context) -> Frame:
        """A frame cut short; the campaign then hangs up: the server must drop it."""
        whole = self.valid(ctx).data
        cut = self.rng.randint(1, max(1, len(whole) - 1))
        return Frame("truncated", whole[:cut], "close")

    def split_header(self, ctx: Context) -> Frame:
        """A whole valid frame, sent a few bytes at a time (the campaign splits it)."""
        inner = self.valid(ctx)
        return attrs.evolve(inner, kind="split-header")

    def with_fds(self, ctx: Context) -> Frame:
        inner = self.valid(ctx)
        chosen = self.rng.sample(FD_KINDS, self.rng.randint(1, len(FD_KINDS)))
        return attrs.evolve(inner, kind="with-fds", attach_fds=tuple(chosen))

    def huge_strings(self, ctx: Context) -> Frame:
        r = self.rng
        size = r.choice([1 << 16, 1 << 20, ctx.max_frame_bytes - 200])
        cls, name = r.choice([
            (m.MetadataScanRequest, "prefix"),
            (m.MetadataListRequest, "prefix"),
            (m.MetadataGetRequest, "key"),
            (m.MetadataPutRequest, "key"),
            (m.MetadataPutRequest, "value"),
            (m.AllocateRequest, "tag"),
            (m.HandshakeRequest, "layout"),
            (m.GetEventHistoryRequest, "layout"),
        ])
        body = self.request_map(ctx, cls)
        body[name] = r.randbytes(size) if name == "value" else "h" * size + self.text()
        return self.pack(body, ctx, "huge-strings")

    def too_many_keys(self, ctx: Context) -> Frame:
        r = self.rng
        templates = [self.entry(ctx) for _ in range(4)]
        if ctx.own_ids and r.random() < 0.7:  # plausible entries: only the count is wrong
            for t in templates:
                t.update(allocation_id=r.choice(ctx.own_ids), offset_bytes=0, value=b"v")
        count = r.choice([129, 500, 2000])
        entries = [dict(templates[n % 4], key=f"many{n}") for n in range(count)]
        return self.pack({"type": "MetadataPutManyRequest", "entries": entries}, ctx, "too-many-keys")

    def foreign_ids(self, ctx: Context) -> Frame:
        """Requests naming another layout's allocations (they must be unknown here)."""
        r = self.rng
        ids = ctx.foreign_ids or ["f" * 32]
        cls = r.choice([m.ExportAllocationRequest, m.ExportAllocationsRequest, m.GetAllocationRequest,
                        m.FreeAllocationRequest, m.MetadataPutRequest, m.ExportHostCopiesRequest])
        body = self.request_map(ctx, cls)
        if "allocation_id" in body or cls in (m.ExportAllocationRequest, m.GetAllocationRequest,
                                                m.FreeAllocationRequest, m.MetadataPutRequest):
            body["allocation_id"] = r.choice(ids)
        if cls in (m.ExportAllocationsRequest, m.ExportHostCopiesRequest):
            mixed = [r.choice(ids)] + r.sample(ctx.own_ids, min(len(ctx.own_ids), 2))
            r.shuffle(mixed)
            body["allocation_ids"] = mixed
        return self.pack(body, ctx, "foreign-ids")
