"""A real server killed at any step of the server machine, restarted by its keeper.

The server machine (``server_machine.py``: three tenants as real uids, two
layouts, evictions, restores, bytes through real mappings, every step checked
against the pure core) runs its server under a keeper and gains one rule: the
server is SIGKILLed between any two steps.  The model's expected state becomes
what the pure core says a restart leaves, the dead server's sessions
disconnected (``gms.fsm.decide_resume``), less the events of its last 2 ms
that never reached the keeper (none of them a lasting change: checked), and
numbered past them; after the restart every check of
the machine holds again: the server's history refolds to that state, the
runtime probe and the memory the new server holds agree with it (the
memory it adopted is exactly the committed layouts'), and readers see the
bytes the writers wrote before the crash.
"""

from __future__ import annotations

import os
import signal

import pytest
from hypothesis.stateful import rule

from gms.client.probes import get_runtime_state
from gms.errors import GMSError
from gms.fsm import LASTING, decide_disconnect, queries
from gms.fsm.node import EMPTY_NODE
from gms.operator.postmortem import row_event
from gms.store import EventLog, Snapshot
from gms.store.log import after_loss

from ..helpers import wait_until
from .server_machine import ServerMachine, run_machine

EXAMPLES = int(os.environ.get("GMS_KEPT_MACHINE_EXAMPLES", "12"))


class KeptServerMachine(ServerMachine):
    keeper = True

    @rule()
    def kill_the_server(self):
        self._sync()
        old = self.server.server_pid()
        os.kill(old, signal.SIGKILL)

        def restarted():
            try:
                pid = get_runtime_state(self.server.socket, timeout=30).pid
            except GMSError:
                return None
            return pid if pid != old else None

        wait_until(restarted, timeout=30, what="the keeper's next server")
        for conn in self.conns.values():
            assert conn.closed_by_peer(), "a dead server's connection ends"
            conn.close()
        self.conns.clear()
        self.waiting = {}
        # The restart as the pure core decides it: the server's own SERVER_RESUMED
        # (its pid and reason are the server's to know), then every session gone.
        (row,) = [e for e in self.server.events(self.expected.last_seq) if e.kind == "SERVER_RESUMED"]
        resumed = row_event(row.fields | {"kind": row.kind, "conn": row.conn})
        assert (resumed.mode, resumed.old_pid, resumed.reason) == ("restart", old, "signal SIGKILL")
        # What the dead server logged after the last event its keeper got is lost
        # (handed on within 2 ms): never a lasting change, and its numbers never reused.
        kept = resumed.follows_seq
        lost = self.expected.since(kept)
        assert all(entry.event.KIND not in LASTING for entry in lost), f"a lasting change lost: {lost}"
        assert row.seq == after_loss(kept) > self.expected.last_seq
        survived = [entry for entry in self.expected.entries() if entry.seq <= kept]
        self.expected = EventLog.resumed(Snapshot(0, EMPTY_NODE), survived, retain=None)
        # The server's history as folded here, back to that event.
        self.replica_seq, self.replica = next((seq, state) for seq, state in reversed(self.replica_trail) if seq <= kept)
        assert self.replica_seq == kept
        self.expected.skip_lost()
        self._record([resumed])
        for conn in sorted(self.state.sessions):
            self._record(decide_disconnect(self.state, conn))
        for name in queries.reverting(self.state):  # a rebuild the crash ended: its kept snapshot comes back
            self._grant(name)


@pytest.mark.parametrize("copier", ["clients", "copier"])
def test_a_server_killed_at_any_step_comes_back_as_the_core_says(backend, copier):
    """With a copier the host copies are its chunks (2 MiB, a pool of two): the
    keeper keeps every copy's chunks, and the restarted server restores
    through a new copier from what it adopted."""
    run_machine(KeptServerMachine, backend, copier == "copier", EXAMPLES, steps=25)
