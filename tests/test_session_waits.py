"""What a session waits on, without sockets or Trio (gms.server.service.waits):
the waits a take-over can find, what it hands on, and the successor going on."""

from __future__ import annotations

import math

import pytest

from gms.fsm import Grant, GrantedLockType, RequestedLockType
from gms.fsm.events import RestoreClaimed, RoConnect
from gms.handover.image import PendingImage
from gms.handover.words import Waiting
from gms.server.service.waits import StateError, Waits
from gms.wire import messages as m

HANDSHAKE = m.HandshakeRequest("RO", 5000, layout="w")


def test_a_queued_handshake_hands_on_what_is_left_of_its_deadline_and_a_grant_that_came_meanwhile():
    waits = Waits()
    wait = waits.ask_lock(HANDSHAKE, RequestedLockType.RO, 5.0, now=100.0)
    assert (wait.deadline, wait.asked_at) == (105.0, 100.0)
    assert waits.image(101.5) == PendingImage(Waiting.LOCK, requested="RO", timeout_left_ms=3500)
    assert waits.image(200.0).timeout_left_ms == 0  # past its deadline: nothing left, never negative
    waits.granted(Grant(1, GrantedLockType.RO, RoConnect(1, layout="w")))  # while the server paused
    assert waits.image(101.5) == PendingImage(Waiting.LOCK, requested="RO", timeout_left_ms=3500, granted="RO")
    assert waits.lock_ended() is wait and waits.image(101.5) is None
    with pytest.raises(StateError):
        waits.lock_ended()


def test_a_memory_wait_stopped_by_a_take_over_keeps_its_mark_one_that_ends_does_not():
    waits = Waits()
    waits.granted(Grant(1, GrantedLockType.RO, RestoreClaimed(1, layout="w")))
    waits.wait_memory(Waiting.RESTORE)
    waits.memory_ended(parked=True)
    assert waits.image(0.0) == PendingImage(Waiting.RESTORE, granted="RO", restore=True)
    waits.memory_ended()
    assert waits.image(0.0) is None
    with pytest.raises(StateError):
        waits.wait_memory(Waiting.LOCK)  # a lock is not memory
    waits.wait_memory(Waiting.ALLOCATE)
    with pytest.raises(StateError):
        waits.wait_memory(Waiting.ALLOCATE)  # one request at a time


def test_the_successor_goes_on_from_the_image_once():
    before = Waits()
    before.ask_lock(HANDSHAKE, RequestedLockType.RO, math.inf, now=10.0)
    image = before.image(12.0)
    assert image == PendingImage(Waiting.LOCK, requested="RO")  # no limit travels as None
    after = Waits()
    after.go_on(image.kind, HANDSHAKE, requested=image.requested, now=50.0)
    assert after.lock.request is HANDSHAKE and math.isinf(after.lock.deadline)
    assert after.image(60.0) == image  # the same wait, handed on again
    assert after.take_pending() is Waiting.LOCK and after.take_pending() is None
    with pytest.raises(StateError):
        after.go_on(Waiting.ALLOCATE, HANDSHAKE)  # one wait to go on from

    limited = Waits()
    limited.go_on("lock", HANDSHAKE, requested="RW", timeout_left=2.5, now=7.0)  # an image's value, decoded
    assert limited.lock.deadline == 9.5 and limited.image(8.0).timeout_left_ms == 1500


def test_every_request_type_has_one_route():
    """Issue 50: one table (gms.server.service.routes) routes every request the wire
    defines, a take-over included; its columns say which wait, which are admin
    verbs (m.ADMIN: checked once) and which only describe (m.PROBES); and
    UnknownRequest is raised in one place, the table's own module."""
    import subprocess

    from gms.server.service.routes import DESCRIBES, ROUTES
    from gms.wire import messages as m

    defined = {t for t in vars(m).values() if isinstance(t, type) and t.__name__.endswith("Request")}
    assert set(ROUTES) == defined
    assert {t for t, r in ROUTES.items() if r.admin} == set(m.ADMIN)
    assert DESCRIBES == set(m.PROBES)
    assert {t for t, r in ROUTES.items() if r.waits} >= {m.HandshakeRequest, m.AllocateRequest, m.CommitRequest}
    raised = subprocess.run(["grep", "-rn", "raise UnknownRequest", "gms"], capture_output=True, text=True).stdout
    assert [line.split(":")[0] for line in raised.splitlines()] == ["gms/server/service/routes.py"], raised

def test_a_lock_nothing_will_grant_is_turned_away_and_a_granted_one_never_is():
    waits = Waits()
    waits.ask_lock(m.HandshakeRequest("RO", None, "w"), RequestedLockType.RO, math.inf, 0.0)
    waits.turn_away()
    assert waits.turned_away and waits.grant is None
    assert waits.lock_ended().requested is RequestedLockType.RO
    granted = Waits()
    granted.granted(Grant(1, GrantedLockType.RO, RoConnect(1, layout="w")))
    with pytest.raises(StateError, match="turned away"):
        granted.turn_away()
