"""FileServingLock: the one-node serving lock, held by a kernel file lock."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from gms.failover.lock import FileServingLock, ServingLock

HOLD = textwrap.dedent("""
    import sys
    from gms.failover.lock import FileServingLock
    lock = FileServingLock(sys.argv[1])
    print(lock.try_acquire(sys.argv[2]), flush=True)
    sys.stdin.read()   # hold until killed (or stdin closes)
""")


@pytest.fixture
def path(tmp_path):
    return tmp_path / "serving.lock"


def hold_in_child(path, holder: str) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(path), holder],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "True"
    return child


def test_is_a_serving_lock(path):
    assert isinstance(FileServingLock(path), ServingLock)


def test_one_holder_at_a_time_and_renewal(path):
    a, b = FileServingLock(path), FileServingLock(path)
    assert a.holder() is None
    assert a.try_acquire("A")
    assert a.try_acquire("A")  # renewing what it holds
    assert not a.try_acquire("B")  # this instance holds it for A
    assert not b.try_acquire("B")  # two locks in one process exclude each other
    assert not b.try_acquire("A")  # the name alone does not make another file the holder
    assert a.holder() == b.holder() == "A"
    b.release("A")  # b does not hold it: no-op
    a.release("B")  # wrong holder: no-op
    assert b.holder() == "A"
    a.release("A")
    assert a.holder() is None and b.holder() is None
    assert b.try_acquire("B")
    assert a.holder() == "B"
    assert a.record()["holder"] == "B"
    b.close()
    assert a.holder() is None


def test_a_holder_in_another_process_is_seen_and_excludes(path):
    child = hold_in_child(path, "set-A")
    try:
        lock = FileServingLock(path)
        assert lock.holder() == "set-A"
        assert lock.record()["pid"] == child.pid
        assert not lock.try_acquire("set-B")
        assert lock.holder() == "set-A"  # asking did not disturb it
    finally:
        child.kill()
        child.wait()


def test_the_kernel_releases_the_lock_of_a_killed_holder(path):
    child = hold_in_child(path, "set-A")
    lock = FileServingLock(path)
    assert not lock.try_acquire("set-B")
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert lock.record()["holder"] == "set-A"  # the dead holder's record is still in the file...
    assert lock.holder() is None  # ...but nobody holds the lock behind it
    assert lock.try_acquire("set-B")
    assert FileServingLock(path).holder() == "set-B"
    lock.release("set-B")


def test_a_coordinator_waits_while_another_holds_the_serving_lock(path, tmp_path):
    """A second coordinator must not act: it waits for the lock, and takes it
    (and starts its engine sets) only once the first one is gone."""
    import json
    import time

    from .helpers import wait_until

    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]  # never becomes ready
    events = tmp_path / "events.jsonl"
    config = tmp_path / "failover.toml"
    config.write_text("\n".join([
        f'lock = "file:{path}"', 'ranks = ["/nonexistent.sock"]', "interval_s = 0.05",
        f'events = "{events}"',
        '[sets.A]', 'kind = "local"', "ports = [1]", f"command = {json.dumps(sleeper)}",
        '[sets.B]', 'kind = "local"', "ports = [2]", f"command = {json.dumps(sleeper)}",
    ]) + "\n")
    other = hold_in_child(path, "A")
    said = tmp_path / "coordinator.log"
    coordinator = subprocess.Popen([sys.executable, "-m", "gms", "failover", "--config", str(config)],
                                   stdout=subprocess.DEVNULL, stderr=said.open("w"))
    try:
        # Until it has met the held lock (a fixed sleep let a loaded host kill the
        # holder before the coordinator's first try: it never waited, and said so).
        wait_until(lambda: "waiting" in said.read_text(), timeout=60, what="the coordinator to wait for the lock")
        time.sleep(0.5)  # ten of its intervals, the lock still held
        assert coordinator.poll() is None
        assert not events.exists() or events.read_text() == ""  # started nothing
        other.kill()
        other.wait()
        wait_until(lambda: events.exists() and '"start"' in events.read_text(), timeout=20,
                   what="the coordinator to take the lock")
        assert FileServingLock(path).holder() == "A"
        coordinator.send_signal(signal.SIGTERM)
        assert coordinator.wait(30) == 0
        assert FileServingLock(path).holder() is None  # released on the way out
    finally:
        other.kill()
        if coordinator.poll() is None:
            coordinator.kill()
            coordinator.wait()
