"""The server's side of its keeper channel (``gms.server.restart.mirror``), on a
real socket pair read the way the keeper reads it: what tells of a lasting
change is handed on at once, the rest within ``SOON_S``, in order, many
requests' events in one system call."""

from __future__ import annotations

import os
import socket

import trio

from gms.handover import frames
from gms.handover.image import STATE_VERSION, ServerInfo, StateImage, decode_entries
from gms.server.restart import mirror
from gms.server.restart.mirror import KeeperLink
from gms.store import EventLog

from .fsm_events import closed_reader, committed, reader, started, writer


def _read_all(sock: socket.socket, reader_: frames.FrameReader) -> list[frames.Frame]:
    """Every frame the keeper's end holds now (never waits)."""
    got = []
    while True:
        try:
            data, ancillary, _, _ = sock.recvmsg(1 << 20, frames.ANCILLARY_BYTES, socket.MSG_DONTWAIT)
        except BlockingIOError:
            break
        reader_.feed(data, frames.received_fds(ancillary))
    while (frame := reader_.next_frame()) is not None:
        got.append(frame)
    return got


def _kinds(frames_: list[frames.Frame]) -> list[str]:
    """Event kinds in the events frames, in order."""
    return [row.event.KIND for f in frames_ if f.kind == "events" for row in decode_entries(f.body["entries"])]


def _recorded(log: EventLog, link: KeeperLink, events) -> None:
    """What the ledger does with a write: store it, hand it to the keeper link, flush."""
    link.logged(log.extend(events))
    link.flush(soon=True)


async def test_events_of_no_lasting_change_follow_within_soon_s_and_a_lasting_one_goes_at_once():
    ours, keepers = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    link = KeeperLink(ours)
    log = EventLog()
    log.extend([started(), *writer(1, "w")])
    log.extend(committed(log.state, 1, "w"))
    info = ServerInfo(os.getpid(), "host", 0, "uuid", False)
    link.attach(lambda: StateImage(STATE_VERSION, info, log.last_seq, 1, log.state), list)
    keeper = frames.FrameReader()
    assert [f.kind for f in _read_all(keepers, keeper)] == ["base"]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.run)
        # Two readers come and go (the ledger flushes after each write): nothing is sent yet.
        for conn in (2, 3):
            for batch in (reader(conn, "w"), closed_reader(conn, "w")):
                _recorded(log, link, batch)
        assert _read_all(keepers, keeper) == []
        assert link.behind() and not link.behind(["w"]), "nothing lasting waits: no answer is held up"
        await trio.sleep(mirror.SOON_S)
        got = _read_all(keepers, keeper)
        with trio.move_on_after(10):  # soon after SOON_S, however busy the machine (a speed is a benchmark's)
            while len(_kinds(got)) < 8:
                await trio.sleep(mirror.SOON_S / 4)
                got += _read_all(keepers, keeper)
        assert _kinds(got) == ["SESSION_OPENED", "RO_CONNECT", "RO_DISCONNECT", "SESSION_CLOSED"] * 2
        assert len(got) == 4 and not link.behind()  # four frames, one system call's worth
        # A writer's grant over the layout is lasting: it goes at once, with what waited before it.
        _recorded(log, link, reader(4, "w"))
        _recorded(log, link, writer(5, "v"))
        assert _kinds(_read_all(keepers, keeper)) == ["SESSION_OPENED", "RO_CONNECT", "SESSION_OPENED", "RW_CONNECT"]
        nursery.cancel_scope.cancel()
    ours.close()
    keepers.close()


async def test_a_quiet_node_gives_its_keeper_a_new_base(monkeypatch):
    """Events since the base, then a quiet spell: a new base (the parts that changed),
    so a restart folds no tail; no events, no base."""
    monkeypatch.setattr(mirror, "QUIET_REBASE_S", 0.05)
    ours, keepers = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    link = KeeperLink(ours)
    link.stream.opened(parts=True)
    log = EventLog()
    log.extend([started(), *writer(1, "w")])
    info = ServerInfo(os.getpid(), "host", 0, "uuid", False)
    link.attach(lambda: StateImage(STATE_VERSION, info, log.last_seq, 1, log.state), list)
    keeper = frames.FrameReader()
    assert [f.kind for f in _read_all(keepers, keeper)][-1] == "base"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.run)
        await trio.sleep(0.2)
        assert _read_all(keepers, keeper) == [], "nothing happened: no base"
        _recorded(log, link, committed(log.state, 1, "w"))
        await trio.sleep(0.2)
        got = [f.kind for f in _read_all(keepers, keeper)]
        assert got[0] == "events" and got[-1] == "base" and got.count("base") == 1
        await trio.sleep(0.2)
        assert _read_all(keepers, keeper) == [], "one base per quiet spell"
        nursery.cancel_scope.cancel()
    ours.close()
    keepers.close()
