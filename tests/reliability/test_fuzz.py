"""Hostile frames: a seeded campaign against one real server, then its health.

Connections come in every role (no handshake, writer of a layout of their
own, reader of a committed one, RW_OR_RO, and, when the suite runs as root,
a client of another uid with no admin rights) and send frames from
``fuzz.Fuzzer``.  Each frame's answer is checked against the contract
(``fuzz.expectation``): an answer for a decodable request, a drop for an
undecodable frame, never a hang; every fd the server sends must belong to the
layout the connection holds (the memfd's name carries the allocation id);
fds sent TO the server must not stay in it.

After the campaign: the server is alive, a writer + reader round trip works,
the sentinel layout's bytes are intact, RSS and fds are within bounds, and
the server's whole history refolds with the pure core to its live state with
zero invariant violations.  A frame that kills or hangs the server is written
to ``GMS_RELIABILITY_OUT`` (or the test's tmp folder) and belongs in
``test_fuzz_regressions.py``.

``GMS_FUZZ_SEED`` picks the seed (the CI slice and the long mode use fixed ones).
"""

from __future__ import annotations

import array
import json
import os
import random
import select
import socket
import time
from collections import Counter, deque
from pathlib import Path

import attrs
import pytest

from gms.client.probes import get_runtime_state
from gms.errors import GMSError
from gms.wire import FrameDecoder, decode
from gms.wire import messages as m

from ..helpers import RawConn, ServerProcess, wait_until
from .common import (
    baseline,
    connect_as,
    is_root,
    open_dir,
    record,
    refold,
    rss_bytes,
    scale,
    settle,
    stop,
    unused_uid,
)
from .fuzz import Context, Frame, Fuzzer
from .test_crash import commit_pattern, read_back

SEED = int(os.environ.get("GMS_FUZZ_SEED", "20251515"))
FRAMES = int(os.environ.get("GMS_FUZZ_FRAMES", scale(6000, 100_000)))
MAX_FRAME = 1 << 20
ADMIN_LAYOUTS = ("sentinel", "fz-ro", "fz-w0", "nope")
SERVER_ARGS = (
    "--socket-mode", "666", "--host-capacity", "256MiB", "--alloc-retry-timeout", "0.2",
    "--max-frame-bytes", str(MAX_FRAME), "--max-allocations", "64", "--max-metadata-keys", "128",
    "--max-metadata-value-bytes", "4KiB", "--max-layouts", "64",
)
RSS_SLACK = 48 << 20  # what the campaign may leave behind in the server, beyond its events


class Violation(AssertionError):
    pass


class Stuck(Violation):
    """Readers of fz-ro cannot get in: a writer queued ahead of them never leaves."""


def memfd_allocation_id(fd: int) -> str | None:
    """The allocation id in a gms memfd's name (``/memfd:gms-<id> (deleted)``)."""
    target = os.readlink(f"/proc/self/fd/{fd}")
    if not target.startswith("/memfd:gms-"):
        return None
    return target[len("/memfd:gms-"):].split(" ")[0]


class Conn:
    """A raw connection that sends frames however the fuzzer says."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.settimeout(10)  # a send the server never reads must not hang the campaign
        self.decoder = FrameDecoder(1 << 30)

    def send(self, f: Frame, rng: random.Random) -> None:
        if f.attach_fds:
            self._send_with_fds(f.data, f.attach_fds)
        elif f.kind == "split-header":
            cut = sorted({rng.randint(1, max(1, len(f.data) - 1)) for _ in range(3)})
            for start, stop in zip([0, *cut], [*cut, len(f.data)]):
                self.sock.sendall(f.data[start:stop])
                time.sleep(0.0005)
        else:
            self.sock.sendall(f.data)

    def _send_with_fds(self, data: bytes, kinds: tuple[str, ...]) -> None:
        """Ancillary fds TO the server (fuzz.FD_KINDS), with the frame's first byte."""
        r, w = os.pipe()
        made = {"pipe-read": r, "pipe-write": w, "devnull": os.open(os.devnull, os.O_RDONLY),
                "memfd": os.memfd_create("fuzz-fd")}
        fds = [self.sock.fileno() if kind == "own-socket" else made[kind] for kind in kinds]
        try:
            self.sock.sendmsg([data[:1]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            self.sock.sendall(data[1:])
        finally:
            for fd in made.values():
                os.close(fd)

    def receive(self, timeout: float):
        """("reply", message, fds) | ("eof", None, fds) | ("timeout", None, fds)."""
        fds: list[int] = []
        deadline = time.monotonic() + timeout
        while True:
            body = self.decoder.next_frame()
            if body is not None:
                return "reply", decode(body), fds
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                return "timeout", None, fds
            try:
                data, anc, _, _ = self.sock.recvmsg(1 << 20, socket.CMSG_SPACE(253 * 4))
            except ConnectionResetError:
                return "eof", None, fds
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(array.array("i", payload[: len(payload) - len(payload) % 4]))
            if not data:
                return "eof", None, fds
            self.decoder.feed(data)

    def close(self) -> None:
        self.sock.close()


def alive(server: ServerProcess) -> bool:
    if server.proc.poll() is not None:
        return False
    try:
        get_runtime_state(server.socket, timeout=5)
    except GMSError:
        return False
    return True


def allocation_ids(server: ServerProcess, layout: str) -> list[str]:
    conn = RawConn(server.socket)
    try:
        if not conn.call(m.HandshakeRequest("RO", 5000, layout)).success:
            state = server.state()
            raise Stuck(f"no read lock on {layout} in 5 s: {state.waiting} waiting, {state.sessions} "
                        "sessions (a dead writer still queued holds readers back?)")
        return [a.allocation_id for a in conn.call(m.ListAllocationsRequest()).allocations]
    finally:
        conn.close()


class Campaign:
    def __init__(self, server: ServerProcess, seed: int, out: Path) -> None:
        self.server = server
        self.rng = random.Random(seed)
        self.fuzzer = Fuzzer(seed)
        self.out = out
        self.other_uid = unused_uid() if is_root() else None
        self.kinds: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.frames = 0
        self.connections = 0
        self.fds_received = 0
        self.writers = 0
        self.anchor: RawConn | None = None
        self.sentinel_ids = allocation_ids(server, "sentinel")
        self.ro_ids: list[str] = []
        self.committed: dict[str, set[str]] = {}  # fuzz layouts committed by fuzz writers, and their ids
        self.doomed: deque[list[Frame]] = deque(maxlen=25)  # the last queued writers that died
        self.handshake: bytes | None = None  # the current connection's handshake frame
        self.ensure_ro()

    # -- the committed layout readers use, held by an anchor reader -----------------------

    def ensure_ro(self) -> None:
        row = self.server.layout("fz-ro")
        if not row.committed:
            commit_pattern(self.server, "fz-ro", f"fz-ro/{self.connections}")
        if self.anchor is None or not row.readers:
            if self.anchor is not None:
                self.anchor.close()
            self.anchor = RawConn(self.server.socket)
            assert self.anchor.call(m.HandshakeRequest("RO", 5000, "fz-ro")).success
        self.ro_ids = allocation_ids(self.server, "fz-ro")

    def known_ids(self) -> set[str]:
        ids = set(self.sentinel_ids) | set(self.ro_ids)
        for owned in self.committed.values():
            ids |= owned
        return ids

    # -- one connection ---------------------------------------------------------------------

    def open(self) -> tuple[Conn, Context, str, str, set[str] | None] | None:
        """A connection in a random role; returns it, its context, its role
        ("none", "writer" or "reader"), the layout it holds, and the ids it
        may be sent (a reader of a layout not tracked: None)."""
        rng = self.rng
        roles = ["none"] * 2 + ["RW"] * 4 + ["RO"] * 3 + ["RW_OR_RO"]
        if self.other_uid is not None:
            roles.append("other-uid")
        role = rng.choice(roles)
        writer_layout = f"fz-w{rng.randrange(6)}"
        if role == "other-uid":
            sock = connect_as(self.server.socket, self.other_uid)
        else:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(self.server.socket)
        conn = Conn(sock)
        ctx = Context([], self.sentinel_ids + self.ro_ids, ["fz-ro", writer_layout, "fz-new"], MAX_FRAME)
        self.handshake = None
        if role in ("none", "other-uid"):
            return conn, ctx, role, "", set()
        layout = "fz-ro" if role == "RO" else writer_layout if role == "RW" else rng.choice(["fz-ro", writer_layout])
        self.handshake = _frame(m.HandshakeRequest(role, 2000, layout))
        conn.sock.sendall(self.handshake)
        outcome, response, fds = conn.receive(10)
        assert not fds
        if outcome != "reply" or not getattr(response, "success", False):
            conn.close()
            return None
        ctx.handshaken = True
        role, allowed = self.granted(response)
        ctx.own_ids = sorted(allowed or ())
        ctx.foreign_ids = list(self.known_ids() - (allowed or set()))
        return conn, ctx, role, layout, allowed

    def granted(self, response: m.HandshakeResponse) -> tuple[str, set[str] | None]:
        if response.granted_lock_type == "RW":
            self.committed.pop(response.layout, None)  # RW_CONNECT cleared it
            return "writer", set()
        if response.layout == "fz-ro":
            return "reader", set(self.ro_ids)
        return "reader", self.committed.get(response.layout)

    def die_queued(self) -> None:
        """A writer queued behind the anchor reader sends more (fds too, its own
        socket among them) and dies: it must leave the queue and its session
        must unwind (checked every few connections), never be granted."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(self.server.socket)
        conn = Conn(sock)
        handshake = _frame(m.HandshakeRequest("RW", None, "fz-ro"))
        conn.sock.sendall(handshake)
        time.sleep(0.005)  # the server reads the handshake and queues it: what follows waits unread
        sent = [Frame("handshake", handshake, "maybe")]
        ctx = Context([], sorted(self.known_ids()), ["fz-ro"], MAX_FRAME, handshaken=True)
        for n in range(self.rng.randint(1, 3)):
            f = self.fuzzer.next(ctx)
            if n == 0:
                f = attrs.evolve(f, attach_fds=("own-socket", *f.attach_fds[:2]))
            sent.append(f)
            self.kinds["die-queued"] += 1
            self.frames += 1
            try:
                conn.send(f, self.rng)
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                break  # dropped for pipelining too much, or not read: either way it dies now
        conn.close()
        self.outcomes["died-queued"] += 1
        self.doomed.append(sent)

    def run_connection(self) -> None:
        if self.rng.random() < 0.05:
            self.connections += 1
            return self.die_queued()
        opened = self.open()
        self.connections += 1
        if opened is None:
            self.outcomes["handshake-timeout"] += 1
            return
        conn, ctx, role, layout, allowed = opened
        self.writers += role == "writer"
        admin_first = role == "other-uid" and self.rng.random() < 0.5
        sent: list[Frame] = []
        try:
            count = self.rng.randint(1, 60)
            for n in range(count):
                f = self.admin_frame() if admin_first else self.fuzzer.next(ctx, last=n == count - 1)
                first = not sent and not ctx.handshaken
                sent.append(f)
                self.kinds[f.kind] += 1
                self.frames += 1
                try:
                    conn.send(f, self.rng)
                except (BrokenPipeError, ConnectionResetError):
                    self.outcomes["send-failed"] += 1
                    return
                except TimeoutError:
                    self.fail("the server stopped reading (a send blocked 10 s)", sent, None)
                if f.expect == "close":
                    self.outcomes["hung-up"] += 1
                    return
                outcome, response, fds = conn.receive(0.2 if f.expect == "maybe" else 5)
                self.outcomes[f"{f.expect}->{outcome}"] += 1
                self.check_fds(fds, allowed, sent)
                if admin_first:
                    admin_first = False
                    if outcome != "reply" or getattr(response, "code", None) != "PERMISSION_DENIED":
                        self.fail("an admin verb from a non-admin uid was not refused", sent, response)
                if isinstance(response, m.LockWaiting):
                    # The handshake waits for its lock (a reader for a commit, a writer
                    # for readers): what follows would be queued unread, as die_queued
                    # already sends; this connection ends here.
                    self.outcomes["lock-waiting"] += 1
                    return
                if outcome == "timeout":
                    if f.expect != "maybe":
                        self.fail("no answer in 5 s", sent, None)
                    return
                if outcome == "eof":
                    if f.expect == "reply":
                        self.fail("a decodable request dropped the connection", sent, None)
                    return
                if f.expect == "drop":
                    self.fail(f"an undecodable frame was answered: {response!r:.200}", sent, response)
                if role == "writer":
                    self.track(ctx, f, response, allowed, layout)
                if isinstance(response, m.HandshakeResponse) and response.success:
                    ctx.handshaken = True
                    role, allowed = self.granted(response)
                    layout = response.layout
                if closes(f.message, response, first):
                    return
        finally:
            conn.close()

    def admin_frame(self) -> Frame:
        cls = self.rng.choice([m.RevokeRequest, m.EvictRequest, m.PinRequest])
        message = cls(self.rng.choice(ADMIN_LAYOUTS))
        return Frame("admin-non-admin", _frame(message), "reply", message)

    def track(self, ctx: Context, f: Frame, response, writer_ids: set[str], layout: str) -> None:
        if isinstance(response, m.AllocateResponse):
            writer_ids.add(response.allocation_id)
            ctx.own_ids = sorted(writer_ids)
        elif isinstance(response, m.FreeAllocationResponse) and response.success:
            writer_ids.discard(f.message.allocation_id)
            ctx.own_ids = sorted(writer_ids)
        elif isinstance(response, m.CommitResponse) and response.success:
            self.committed[layout] = set(writer_ids)

    def check_fds(self, fds: list[int], allowed: set[str] | None, sent: list[Frame]) -> None:
        """Every fd must be an allocation of the layout this connection holds."""
        try:
            foreign = self.known_ids() - (allowed or set())
            for fd in fds:
                self.fds_received += 1
                allocation_id = memfd_allocation_id(fd)
                if allocation_id is None:
                    self.fail(f"an fd that is no gms allocation: {os.readlink(f'/proc/self/fd/{fd}')}", sent, None)
                if allocation_id in foreign or (allowed is not None and allocation_id not in allowed):
                    self.fail(f"an fd of allocation {allocation_id} outside this connection's layout", sent, None)
        finally:
            for fd in fds:
                os.close(fd)

    def fail(self, why: str, sent: list[Frame], response) -> None:
        """Keep the connection's frames (the last one did it) for a regression test."""
        connection = [Frame("handshake", self.handshake, "reply")] if self.handshake else []
        path = self.save(why, "connection", [connection + sent])
        raise Violation(f"{why} (frame {self.frames}, kind {sent[-1].kind}; saved to {path})")

    def save(self, why: str, scenario: str, connections: list[list[Frame]]) -> Path:
        """A finding ``test_fuzz_regressions.py`` can replay (copy it to findings/)."""
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"fuzz-finding-{SEED}-{self.frames}.json"
        path.write_text(json.dumps({
            "why": why, "seed": SEED, "frame_number": self.frames, "scenario": scenario,
            "connections": [[{"kind": f.kind, "hex": f.data.hex(), "fds": list(f.attach_fds)} for f in frames]
                            for frames in connections],
        }, indent=1))
        return path

    def run(self, frames: int) -> None:
        while self.frames < frames:
            self.run_connection()
            if self.connections % 25 == 0:
                self.check()

    def check(self) -> None:
        """Alive; no session or waiter outlives its connection; fz-ro readable."""
        if not alive(self.server):
            raise Violation(f"server dead or hung after frame {self.frames}")
        try:
            self.ensure_ro()
        except Stuck as exc:
            path = self.save(str(exc), "die-queued", list(self.doomed))
            raise Violation(f"{exc} (the last queued writers that died: {path})") from None

        def settled() -> bool:
            state = self.server.state()
            return state.sessions == 1 and state.waiting == 0  # the anchor alone

        try:
            wait_until(settled, timeout=10, what="sessions of closed connections gone")
        except AssertionError:
            state = self.server.state()
            why = (f"after frame {self.frames}: {state.sessions} sessions, {state.waiting} "
                   "waiting, with only the anchor reader connected")
            path = self.save(why, "die-queued", list(self.doomed))
            raise Violation(f"{why} (the last queued writers that died: {path})") from None


def closes(message, response, first: bool) -> bool:
    """Does the server close the connection after this answer (docs/protocol.md)?"""
    if first and isinstance(message, m.ONE_SHOT):
        return True  # probes and admin verbs answer once
    if isinstance(response, (m.CommitResponse, m.AbortResponse)) and response.success:
        return True  # a writer's commit or abort ends its session
    return isinstance(response, m.HandshakeResponse) and not response.success


def _frame(message) -> bytes:
    from gms.wire import encode

    return encode(message)


@pytest.fixture(scope="module")
def server():
    server = ServerProcess(open_dir(), *SERVER_ARGS)
    commit_pattern(server, "sentinel", "sentinel")
    yield server
    stop(server)


def test_hostile_frames_campaign(server, tmp_path):
    out = Path(os.environ.get("GMS_RELIABILITY_OUT") or tmp_path)
    sentinel_hash = server.layout("sentinel").memory_layout_hash
    campaign = Campaign(server, SEED, out)
    campaign.run(50)  # warm up: every code path the server has, before the baseline
    if campaign.anchor is not None:
        campaign.anchor.close()
        campaign.anchor = None
    base_rss = rss_bytes(server.pid)
    started = time.perf_counter()
    campaign.ensure_ro()
    base = baseline(server, sessions=1)  # the anchor reader
    events_before = server.state().last_event_seq
    campaign.run(FRAMES)
    campaign.check()
    elapsed = time.perf_counter() - started
    appended = server.state().last_event_seq - events_before

    # The server is alive and answers; the campaign's connections are all gone.
    assert alive(server), server.log
    campaign.anchor.close()
    state = server.state()
    # Layouts fuzz writers committed stay (that is their right): drop them to compare.
    for row in state.layouts:
        if row.name.startswith("fz-"):
            conn = RawConn(server.socket)
            assert conn.call(m.HandshakeRequest("RW", 5000, row.name)).success, row
            conn.close()
    # fds: as at the start, less the anchor's socket and fz-ro's memfds.
    fds = base["fds"] - 1 - (base["handles"] - 2)
    after = settle(server, {"sessions": 0, "handles": 2, "host_handles": 0, "fds": fds}, timeout=20)
    growth = rss_bytes(server.pid) - base_rss

    # A writer and a reader still work, and nothing touched another layout's bytes.
    commit_pattern(server, "after-fuzz", "after-fuzz")
    assert read_back(server, "after-fuzz") == 2
    assert read_back(server, "sentinel") == 2
    assert server.layout("sentinel").memory_layout_hash == sentinel_hash
    refold(server)  # zero invariant violations in everything the campaign did

    record("fuzz", f"seed {SEED}", frames=campaign.frames, connections=campaign.connections,
           writers=campaign.writers, fds_received=campaign.fds_received, errors=0,
           seconds=round(elapsed, 1), frames_per_s=round(campaign.frames / elapsed),
           rss_before_mib=round(base_rss / 2**20, 1), rss_growth_mib=round(growth / 2**20, 1),
           fds_before=base["fds"], fds_after=after["fds"],
           events=server.state().last_event_seq, kinds=dict(campaign.kinds), outcomes=dict(campaign.outcomes))
    # What the server may keep: the event log (about 370 bytes an event, all
    # retained here) and some slack; nothing else may grow with the campaign.
    bound = RSS_SLACK + 400 * appended
    assert growth < bound, f"server RSS grew by {growth / 2**20:.0f} MiB (bound {bound / 2**20:.0f} MiB)"
