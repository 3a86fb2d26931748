"""A server killed at any event: the pure half of the keeper path, under the core machine.

After every step of the core's stateful machine (``FsmMachine``: three
tenants, two layouts, crashes, evictions, restores, ...), the server is
killed right there, on paper, and restarted as the keeper would restart it:

* the keeper's journal (the log's snapshot as a base image, its entries as
  one batch, both encoded as they travel) rebuilds exactly the live state;
  so does its base in parts (``gms.handover.journal``), made after every
  step from the parts that changed since the last one, the keeper's way
  (every other part kept from the base before): a change the writer missed
  would leave a stale part and fail here;
* the restarted node is the live one minus the dead sessions: the reference
  model (``reference.py``, dicts and sets) has every session disconnected, in
  connection order, and must agree on every layout (locks, tables, hash,
  residency, tier, owner) and each tenant's charge; every invariant holds;
* what the restart releases is exactly the unfinished work: every
  uncommitted build and every half-restored layout's GPU memory, nothing of
  a committed layout;
* a layout whose memory is found lost is dropped whole (or, saved, kept on
  the disk tier by its snapshot), and nothing else.

The real-process version (a keeper SIGKILLing real servers) is
``test_kept_server_machine.py``.
"""

from __future__ import annotations

import copy

from hypothesis.stateful import invariant, run_state_machine_as_test

from gms.fsm import check_invariants, decide_resume, fold_all, released_memory
from gms.fsm.events import ServerResumed
from gms.handover import journal
from gms.handover.image import (
    STATE_VERSION,
    ServerInfo,
    StateImage,
    decode_entries,
    decode_image,
    encode_entries,
    encode_image,
)
from gms.handover.journal import PartWriter, decode_parts
from gms.store import EventLog, LogEntry, Snapshot

from .fsm_machine import TENANTS, FsmMachine

INFO = ServerInfo(1, "host", 0, "host-0", True)


def resumed_by(state, mode: str = "restart") -> ServerResumed:
    """The same configuration again (issue 21's bounds included): what a restarted server brings."""
    tenant_limits = {
        name: {"metadata_quota": tenant.metadata_quota, "max_layouts": tenant.max_layouts}
        for name, tenant in state.tenants.items()
    }
    return ServerResumed(
        0, mode, 1, "SIGKILL", STATE_VERSION, state.capacity_bytes, state.budget_bytes, state.host_budget_bytes,
        {name: TENANTS[name][0] for name in TENANTS}, state.limits.as_dict(), layout="",
        tenant_limits=tenant_limits,
    )


class KilledAnywhereMachine(FsmMachine):
    def __init__(self) -> None:
        super().__init__()
        self.writer = PartWriter()
        self.parts: dict[str, bytes] = {}
        self.noted = 0  # events the writer was told of

    @invariant()
    def a_base_in_parts_is_the_live_state(self):
        state = self.log.state
        self.writer.note([LogEntry(0, 0, 0, event) for event in self.events[self.noted:]])
        self.noted = len(self.events)
        image = StateImage(STATE_VERSION, INFO, self.log.last_seq, self.next_conn, state)
        changed, keys = self.writer.parts(image)
        self.parts = {key: changed[key] if key in changed else self.parts[key] for key in keys}
        assert decode_parts(self.parts) == image

    @invariant()
    def a_server_killed_here_comes_back_with_every_committed_layout(self):
        state = self.log.state
        snapshot = self.log.snapshot
        base = encode_image(StateImage(STATE_VERSION, INFO, snapshot.last_seq, self.next_conn, snapshot.state))
        tail = encode_entries(list(self.log.entries()))
        image = decode_image(base)
        journal = EventLog.resumed(
            Snapshot(image.last_seq, image.state), decode_entries(tail), retain=None, max_bytes=64 << 20
        )
        assert journal.state == state and journal.last_seq == self.log.last_seq
        for name, tenant in state.tenants.items():  # issue 21's bounds and counts came with the image
            kept = journal.state.tenants[name]
            assert (kept.metadata_bytes, kept.metadata_quota, kept.max_layouts, kept.layout_refs) == (
                tenant.metadata_bytes, tenant.metadata_quota, tenant.max_layouts, tenant.layout_refs,
            )

        events = decide_resume(state, resumed_by(state))
        after = fold_all(events, state)
        check_invariants(after)
        assert not after.sessions

        refs = copy.deepcopy(self.refs)
        for conn in sorted(self.sessions):
            refs[self.sessions[conn][0]].disconnect(conn, lambda: 0)
        for name, ref in refs.items():
            layout = after.layout(name)
            # a rebuild the restart ends leaves the snapshot kept through it, to come back (Snapshots.revert)
            assert layout.kept_file == (state.layout(name).kept_file if not ref.committed or layout.persist else "")
            assert (name in after.layouts) == (ref.committed or bool(layout.kept_file or layout.unserved))
            assert layout.unserved == (ref.unserved if not ref.committed else "")
            assert layout.lock_state.value == ref.state_name() == ("COMMITTED" if ref.committed else "EMPTY")
            assert {k: (a.size, a.aligned_size, a.tag, a.layout_slot) for k, a in layout.allocations.items()} == (
                ref.allocs if ref.committed else {}
            )
            assert {k: (m.allocation_id, m.offset_bytes, m.value) for k, m in layout.metadata.items()} == (
                ref.meta if ref.committed else {}
            )
            assert layout.layout_hash == (ref.layout_hash if ref.committed else None)
            if ref.committed:
                assert (layout.residency.value, layout.tier.value, set(layout.host_copies), layout.owner) == (
                    ref.residency, ref.tier, ref.host, ref.owner,
                )
        for tenant in TENANTS:
            owned = sum(ref.bytes() for ref in refs.values() if ref.owner == tenant and ref.committed)
            assert (after.tenants[tenant].used_bytes, after.tenants[tenant].sessions) == (owned, 0)

        released = set()
        before = state
        for event in events:
            released |= {(r.tier.value, r.allocation_id) for r in released_memory(before, event)}
            before = fold_all([event], before)
        expected = set()
        for name, layout in state.layouts.items():
            if not layout.committed:
                expected |= {("gpu", i) for i in layout.allocations} | {("host", i) for i in layout.host_copies}
            elif layout.tier.value == "restoring":
                expected |= {("gpu", i) for i in layout.allocations}
        assert released == expected, "a restart releases the unfinished work and nothing committed"

        committed = sorted(name for name, layout in after.layouts.items() if layout.committed)
        if committed:
            doomed = after.layouts[committed[0]]
            held = [("gpu", i) for i in sorted(doomed.allocations) if doomed.gpu_bytes]
            held += [("host", i) for i in sorted(doomed.host_copies)]
            if held:
                dropped = fold_all(decide_resume(state, resumed_by(state), held[:1]), state)
                check_invariants(dropped)
                if doomed.saved:  # its snapshot holds it: on the disk tier, the same commit
                    fell = dropped.layouts[doomed.name]
                    assert (fell.tier.value, fell.gpu_bytes, fell.host_bytes) == ("disk", 0, 0)
                    assert (fell.layout_hash, fell.disk_file, fell.metadata, fell.allocations) == (
                        doomed.layout_hash, doomed.disk_file, doomed.metadata, doomed.allocations)
                elif doomed.kept_file:  # lost, with a snapshot kept from before it: that comes back
                    assert dropped.layouts[doomed.name].kept_file == doomed.kept_file
                    assert not dropped.layouts[doomed.name].committed
                else:
                    assert doomed.name not in dropped.layouts
                assert all(dropped.layouts[n] == after.layouts[n] for n in committed[1:]), "only that layout"
            elif doomed.allocations:  # on the disk tier alone: no memory of it can be lost
                kept = fold_all(decide_resume(state, resumed_by(state), [("gpu", min(doomed.allocations))]), state)
                assert kept.layouts == after.layouts

        took_over = fold_all(decide_resume(state, resumed_by(state, "take-over")), state)
        check_invariants(took_over)
        assert took_over.sessions == state.sessions and took_over.layouts == state.layouts


def test_a_server_killed_at_any_event_restarts_with_the_node_minus_its_sessions(monkeypatch):
    # Buckets of a byte: the machine's small metadata then spreads over many,
    # and grows and shrinks their count, so every way a part can change is met.
    monkeypatch.setattr(journal, "BUCKET_BYTES", 1)
    run_state_machine_as_test(KilledAnywhereMachine)
