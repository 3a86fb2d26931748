"""The keeper stream without a socket (``gms.server.restart.keeper_stream``): what
it hands on and in what order, what an answer waits for, what it does when the
channel goes, when a base falls due.  The kernel is played by hand: a test
takes bytes off the stream (``took``) as a socket would."""

from __future__ import annotations

import os

from gms.fsm.events import AllocationCreated, MetadataPut
from gms.handover import frames
from gms.handover.image import STATE_VERSION, ServerInfo, StateImage, decode_entries
from gms.handover.words import Leaving, Say
from gms.server.restart import keeper_stream as ks
from gms.server.restart.keeper_stream import KeeperStream, LinkState, Phase
from gms.store import EventLog

from .fsm_events import closed_reader, committed, reader, started, writer

INFO = ServerInfo(1, "host", 0, "host-0", False)


class Kernel:
    """Takes what the stream hands on, as a socket would, and reads it back as the keeper does."""

    def __init__(self, stream: KeeperStream) -> None:
        self.stream = stream
        self.reader = frames.FrameReader()

    def take(self, limit: int | None = None) -> list[frames.Frame]:
        while (segment := self.stream.next_segment()) is not None:
            data = bytes(segment.data[:limit]) if limit is not None else bytes(segment.data)
            fds = [os.dup(fd) for fd in segment.fds]
            self.stream.took(len(data))
            self.reader.feed(data, fds)
            if limit is not None:
                break
        got = []
        while (frame := self.reader.next_frame()) is not None:
            got.append(frame)
        return got


def attached(parts: bool = True, held=()) -> tuple[KeeperStream, EventLog, Kernel]:
    log = EventLog()
    log.extend([started()])
    stream = KeeperStream()
    stream.opened(parts)
    stream.attach(lambda: StateImage(STATE_VERSION, INFO, log.last_seq, 1, log.state), list(held), list,
                  lambda: False)
    stream.base_now([key for key, _ in held])
    return stream, log, Kernel(stream)


def record(stream: KeeperStream, log: EventLog, events, soon: bool = True) -> bool:
    """As the ledger does: store, hand to the stream, end the write."""
    stream.logged(log.extend(events))
    return stream.flush(soon)


def kinds(got: list[frames.Frame]) -> list[str]:
    return [row.event.KIND for f in got if f.kind == Say.EVENTS for row in decode_entries(f.body["entries"])]


def test_a_channel_attached_sends_the_fds_the_keeper_lacks_then_a_base():
    memory = os.memfd_create("a0")
    try:
        stream, _, kernel = attached(held=[("gpu:a0", memory)])
        got = kernel.take()
        assert [f.kind for f in got] == [Say.HOLD, Say.PART, Say.BASE]  # (the head: an empty node)
        assert got[0].body["keys"] == ["gpu:a0"] and len(got[0].fds) == 1, "its own dup rides the frame"
        assert got[-1].body["keys"] == ["gpu:a0"]
        assert stream.state is LinkState.ATTACHED and stream.phase is Phase.BASED
        for f in got:
            f.close_fds()
    finally:
        os.close(memory)


def test_what_tells_of_no_lasting_change_waits_for_soon_and_a_lasting_change_goes_at_once():
    stream, log, kernel = attached()
    kernel.take()
    log.extend(writer(1, "w"))
    log.extend(committed(log.state, 1, "w"))
    said = [record(stream, log, batch) for conn in (2, 3) for batch in (reader(conn, "w"), closed_reader(conn, "w"))]
    assert said == [True, None, None, None], "left for the shell's hand-on within SOON_S (told once)"
    assert stream.next_segment() is None and stream.frames.soon
    assert stream.behind() and not stream.behind(["w"]), "nothing lasting waits: no answer is held up"
    assert record(stream, log, writer(4, "v")) is False, "a writer's grant is lasting: handed on at once"
    assert kinds(kernel.take()) == ["SESSION_OPENED", "RO_CONNECT", "RO_DISCONNECT", "SESSION_CLOSED"] * 2 + [
        "SESSION_OPENED", "RW_CONNECT",
    ]
    assert not stream.behind() and not stream.frames.soon


def test_an_abort_that_discards_the_kept_snapshot_is_lasting_and_one_that_does_not_is_not():
    """A writer's ``abort(discard=True)`` lets the snapshot kept through its rebuild go; a
    crash that lost it would have the next server bring that snapshot back (the writer's
    session ends with a plain RW_ABORT): its answer waits for the keeper to hold it."""
    from gms.fsm import is_lasting
    from gms.fsm.events import RwAbort

    assert is_lasting(RwAbort(1, discard=True, layout="w")) and not is_lasting(RwAbort(1, layout="w"))
    for discard, waits in ((False, False), (True, True)):
        stream, log, kernel = attached()
        kernel.take()
        log.extend(writer(1, "w"))
        record(stream, log, [RwAbort(1, discard=discard, layout="w")])
        assert stream.behind(["w"]) is waits, discard


def test_an_answer_waits_until_the_kernel_took_its_layout_s_last_lasting_change():
    stream, log, kernel = attached()
    kernel.take()
    record(stream, log, writer(1, "w"))
    target = stream.target(["w"])
    assert target == stream.frames.enqueued > stream.frames.sent and stream.behind(["w"])
    assert not stream.behind(["other"]) or stream.target(["other"]) == target, "the node's marks count for all"
    kernel.take(limit=5)  # part of the frame
    assert stream.behind(["w"]) and stream.state is LinkState.BEHIND
    kernel.take()
    assert not stream.behind(["w"]) and stream.state is LinkState.ATTACHED
    assert stream.target(["w"]) == 0, "a mark taken is forgotten"


def test_a_request_that_added_much_waits_while_the_keeper_is_far_behind(monkeypatch):
    monkeypatch.setattr(ks, "BACKLOG_BYTES", 1000)
    stream, log, kernel = attached()
    kernel.take()
    record(stream, log, writer(7, "w"))
    kernel.take()
    since = stream.added(7)

    record(stream, log, [AllocationCreated(7, "a", 4096, 4096, "w", 0, layout="w")])
    record(stream, log, [MetadataPut(7, f"k{i}", "a", 0, b"v" * 1000, layout="w") for i in range(80)], soon=False)
    assert stream.added(7) - since > ks.SMALL_BYTES
    assert stream.pressed(7, since) and stream.behind(["w"], 7, since), "it added much, the keeper is behind"
    assert not stream.pressed(8, 0), "one that added little never waits for it"
    kernel.take()
    assert not stream.pressed(7, since)


def test_a_channel_that_goes_drops_what_waits_and_closes_its_fds():
    closed = []
    stream = KeeperStream(close_fds=lambda fds: closed.extend(fds))
    stream.opened(True)
    log = EventLog()
    log.extend([started()])
    memory = os.memfd_create("b0")
    try:
        stream.attach(lambda: StateImage(STATE_VERSION, INFO, log.last_seq, 1, log.state), [], list, lambda: False)
        stream.held("gpu", [("b0", memory)])
        stream.flush()
        (dup,) = stream.next_segment().fds
        stream.gone()
        assert closed == [dup] and stream.state is LinkState.GONE and stream.next_segment() is None
        assert not stream.behind(["w"]) and stream.frames.sent == stream.frames.enqueued, "nothing is waited for"
        stream.held("gpu", [("b0", memory)])  # gone: nothing queued
        assert stream.next_segment() is None
    finally:
        os.close(memory)
        os.close(dup)


def test_a_base_falls_due_once_the_events_outweigh_it_and_is_made_in_steps(monkeypatch):
    monkeypatch.setattr(ks, "MIN_TAIL_BYTES", 2000)
    stream, log, kernel = attached()
    kernel.take()
    conn = 1
    while not stream.rebase_due:
        record(stream, log, writer(conn, f"l{conn}"), soon=False)
        conn += 1
    steps = list(stream.rebase())
    assert not stream.rebase_due and steps.count(True) == 0  # a small base: no pause to hand on
    got = kernel.take()
    assert got[-1].kind == Say.BASE and got[-1].body["tails"] == 0
    assert {f.kind for f in got[:-1]} <= {Say.PART, Say.EVENTS}
    stream.stopping(Leaving.SHUTDOWN)
    (said,) = kernel.take()
    assert (said.kind, said.body) == (Say.STOPPING, {"why": "shutdown"})


def test_the_conversation_names_every_word_once():
    """gms.handover.words.CONVERSATION (drawn in docs/architecture.md) is the whole
    vocabulary of the channel, each word said by one side."""
    from gms.handover.words import CONVERSATION

    said = [say for _, say, _ in CONVERSATION]
    assert sorted(said) == sorted(Say) and len(said) == len(set(said))


def test_a_take_over_s_first_fds_tell_the_keeper_the_node_is_provisional():
    """The keeper learns a node is a take-over's with its first fds, not with the
    journal after them: a server dying in between leaves a keeper that knows the
    listener it holds may be the old server's (gms.server.restart.startup.prepare)."""
    import os as _os

    from gms.handover.frames import Frame
    from gms.handover.words import Say
    from gms.keeper.store import Store

    store = Store()
    r, w = _os.pipe()
    try:
        store.apply(Frame(Say.HOLD, {"keys": ["listener"], "provisional": 4242}, (r,)))
        body, fds = store.handback()
        assert (body["mode"], body["provisional"]) == ("fresh", 4242) and [k for k, _ in fds] == ["listener"]
        store.apply(Frame(Say.CONFIRM, {}, ()))
        assert "provisional" not in store.handback()[0]
    finally:
        store.close()
        _os.close(w)


def test_the_events_a_new_base_leaves_behind_are_the_keeper_s_history():
    """The keeper keeps, by the numbers the server named beside each batch, what a
    base replaces, and hands it back with the journal (gms.store.prior)."""
    from gms.handover.frames import Frame
    from gms.handover.words import Say
    from gms.keeper.store import Store

    store = Store()
    store.apply(Frame(Say.BASE, {"image": b"img0", "history": [[1, 1, 1, b"e1"]]}, ()))
    store.apply(Frame(Say.EVENTS, {"entries": b"e2-4", "span": [2, 4, 3]}, ()))
    store.apply(Frame(Say.EVENTS, {"entries": b"old-server"}, ()))  # no numbers (an older server): not kept
    store.apply(Frame(Say.EVENTS, {"entries": b"e6", "span": [6, 6, 1]}, ()))
    store.apply(Frame(Say.PART, {"key": "p", "data": b"d"}, ()))
    store.apply(Frame(Say.BASE, {"parts": ["p"], "tails": 1}, ()))  # the last tail is after the new base
    body, _ = store.handback()
    assert body["history"] == [[1, 1, 1, b"e1"], [2, 4, 3, b"e2-4"]] and body["tails"] == [b"e6"]
    store.drop_node(keep_listener=False)
    assert store.history == type(store.history)()
