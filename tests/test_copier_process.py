"""The copier process on its own: a real ``python -m gms.copier`` on a socketpair,
driven frame by frame as the server drives it (gms/server/tiers/copier_link.py)."""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import socket
import subprocess
import sys
import threading

import pytest

from gms.copier import messages as msg
from gms.copier.engine import HostEngine
from gms.copier.process import Copier as CopierLoop
from gms.cuda import open_backend, open_host_tier, open_mapper

from .helpers import MiB


class Copier:
    def __init__(self, backend: str) -> None:
        self.sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gms.copier", "--fd", str(child.fileno()), "--backend", backend],
            pass_fds=(child.fileno(),),
        )
        child.close()
        self.sock.settimeout(30)
        ready, _ = msg.receive(self.sock)
        assert isinstance(ready, msg.Ready) and ready.pid == self.proc.pid

    def send(self, message, fds=()) -> None:
        msg.send(self.sock, message, list(fds))

    def done(self) -> msg.Done:
        answer, fds = msg.receive(self.sock)
        assert not fds and isinstance(answer, msg.Done), answer
        return answer

    def close(self) -> int:
        self.sock.close()  # the copier exits when its link closes
        return self.proc.wait(30)


@pytest.fixture
def made(backend):
    """Device memory and host chunks made as the server makes them; released after."""
    yield from _making(backend)


@pytest.fixture
def made_host():
    """``made`` on the host backend, for the copier's loop run in this process."""
    yield from _making("host")


def _making(backend: str):
    gpu, host = open_backend(backend, 0), open_host_tier(backend, 0)
    held = []

    def make(tier: str, size: int):
        one = (gpu if tier == "gpu" else host).create(size, f"test-{tier}")
        held.append((gpu if tier == "gpu" else host, one))
        return one

    yield make
    for backend_, one in held:
        backend_.release(one)


def fill(backend: str, held, data: bytes) -> None:
    if backend == "host":
        with mmap.mmap(held.fd, held.size) as view:
            view[: len(data)] = data
    else:
        mapper = open_mapper("cuda", 0)
        va = mapper.reserve(held.size)
        handle = mapper.map(os.dup(held.fd), va, held.size, True)
        mapper.write(va, data)
        mapper.unmap(va, held.size, handle)
        mapper.free(va, held.size)


def contents(backend: str, held, size: int) -> bytes:
    if backend == "host":
        with mmap.mmap(held.fd, held.size) as view:
            return bytes(view[:size])
    mapper = open_mapper("cuda", 0)
    va = mapper.reserve(held.size)
    handle = mapper.map(os.dup(held.fd), va, held.size, False)
    try:
        return mapper.read(va, size)
    finally:
        mapper.unmap(va, held.size, handle)
        mapper.free(va, held.size)


def test_moves_bytes_both_ways_between_device_memory_and_chunks(backend, made):
    device = made("gpu", 6 * MiB)
    chunks = [made("host", 4 * MiB), made("host", 2 * MiB)]
    data = os.urandom(6 * MiB)
    fill(backend, device, data)
    copier = Copier(backend)
    try:
        copier.send(msg.MapChunks(["a", "b"], [4 * MiB, 2 * MiB]), [os.dup(c.fd) for c in chunks])
        # to the host: the first 4 MiB into a, the rest into b
        copier.send(msg.Copy(1, True, [6 * MiB], [0, 0], [0, 4 * MiB], ["a", "b"], [4 * MiB, 2 * MiB]),
                    [os.dup(device.fd)])
        assert copier.done() == msg.Done(1)
        assert contents(backend, chunks[0], 4 * MiB) + contents(backend, chunks[1], 2 * MiB) == data
        fill(backend, device, bytes(6 * MiB))
        # back to the device, crossed over: b to the start, a after it
        copier.send(msg.Copy(2, False, [6 * MiB], [0, 0], [2 * MiB, 0], ["a", "b"], [4 * MiB, 2 * MiB]),
                    [os.dup(device.fd)])
        assert copier.done() == msg.Done(2)
        assert contents(backend, device, 6 * MiB) == data[4 * MiB:] + data[: 4 * MiB]
    finally:
        assert copier.close() == 0


def test_a_bad_copy_is_answered_with_why_and_the_copier_goes_on(backend, made):
    device, chunk = made("gpu", 2 * MiB), made("host", 2 * MiB)
    copier = Copier(backend)
    try:
        copier.send(msg.MapChunks(["a"], [2 * MiB]), [os.dup(chunk.fd)])
        copier.send(msg.Copy(1, True, [2 * MiB], [0], [0], ["nope"], [2 * MiB]), [os.dup(device.fd)])
        assert "not mapped" in copier.done().error
        copier.send(msg.Copy(2, True, [2 * MiB], [0], [MiB], ["a"], [2 * MiB]), [os.dup(device.fd)])
        assert "outside its allocation" in copier.done().error
        copier.send(msg.Copy(3, True, [2 * MiB, 2 * MiB], [0], [0], ["a"], [MiB]), [os.dup(device.fd)])
        assert "came with 1 fds" in copier.done().error
        copier.send(msg.UnmapChunks(["a"]))
        copier.send(msg.Copy(4, True, [2 * MiB], [0], [0], ["a"], [MiB]), [os.dup(device.fd)])
        assert "not mapped" in copier.done().error, "an unmapped chunk is gone"
        copier.send(msg.MapChunks(["a"], [2 * MiB]), [os.dup(chunk.fd)])
        copier.send(msg.Copy(5, True, [2 * MiB], [0], [0], ["a"], [MiB]), [os.dup(device.fd)])
        assert copier.done() == msg.Done(5)
    finally:
        assert copier.close() == 0
    assert len(os.listdir(f"/proc/{os.getpid()}/fd")) < 200, "no fd leaked here either"


def test_a_chunk_released_during_a_copy_is_unmapped_after_it(backend, made, monkeypatch):
    """The server may release a chunk while a copy into it runs (a publish revoked):
    the copy lands, then the chunk is unmapped; the stop hook holds the copy half
    way, and 400 more moves keep it busy while the release is read (unmapped at
    once, the copier would fault: no answer)."""
    monkeypatch.setenv("GMS_COPIER_STOP_AFTER", "publish:1")
    device = made("gpu", 4 * MiB)
    chunks = [made("host", 2 * MiB), made("host", 2 * MiB)]
    data = os.urandom(4 * MiB)
    fill(backend, device, data)
    copier = Copier(backend)
    try:
        copier.send(msg.MapChunks(["a", "b"], [2 * MiB, 2 * MiB]), [os.dup(c.fd) for c in chunks])
        moves = 402
        copier.send(msg.Copy(1, True, [4 * MiB], [0] * moves, [0, 2 * MiB] * (moves // 2), ["a", "b"] * (moves // 2),
                             [2 * MiB] * moves), [os.dup(device.fd)])
        wait_stopped(copier.proc.pid)
        copier.send(msg.UnmapChunks(["a", "b"]))
        os.kill(copier.proc.pid, signal.SIGCONT)
        assert copier.done() == msg.Done(1), "the copy finished into chunks released meanwhile"
        assert contents(backend, chunks[1], 2 * MiB) == data[2 * MiB:]
        copier.send(msg.Copy(2, True, [4 * MiB], [0], [0], ["a"], [MiB]), [os.dup(device.fd)])
        assert "not mapped" in copier.done().error, "unmapped once the copy ended"
    finally:
        assert copier.close() == 0


def wait_stopped(pid: int) -> None:
    from .helpers import wait_until

    def stopped() -> bool:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "T"

    wait_until(stopped, what="the copier to stop itself")


def test_the_selftest_checks_the_engine(backend):
    out = subprocess.run([sys.executable, "-m", "gms.copier", "--selftest", "--backend", backend],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("copier selftest OK"), out


@contextlib.contextmanager
def copier_loop(engine, gate: threading.Event):
    """The copier's loop (``gms.copier.process.Copier``) in a thread of this process,
    on a socketpair: our end, its Ready read.  ``gate`` is set on the way out, so
    an engine that blocks on it lets the loop end."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.settimeout(30)
    loop = threading.Thread(target=CopierLoop(engine, theirs).run)
    loop.start()
    try:
        assert isinstance(msg.receive(ours)[0], msg.Ready)
        yield ours
    finally:
        gate.set()
        ours.close()
        loop.join(30)
    assert not loop.is_alive()


def test_a_copy_is_not_held_up_by_chunks_being_unmapped(made_host):
    """Unmapping a replaced layout's chunks is slow on CUDA (16 GiB: 0.85 s);
    done where the link is read, it held the next publish's copy up behind it.
    Here the unmapping of released chunks blocks until the test lets it go, and
    a copy sent after the release is answered meanwhile (in process, host
    engine; the real process's threads are the same code)."""
    gate, unmapping = threading.Event(), threading.Event()

    class SlowUnmaps(HostEngine):
        def unmap(self, mapped):
            if mapped.size == 2 * MiB:  # the released chunks' size only
                unmapping.set()
                gate.wait(30)
            super().unmap(mapped)

    device = made_host("gpu", 4 * MiB)
    released = [made_host("host", 2 * MiB) for _ in range(3)]
    kept = made_host("host", 4 * MiB)
    data = os.urandom(4 * MiB)
    fill("host", device, data)
    with copier_loop(SlowUnmaps(open_mapper("host", 0)), gate) as ours:
        msg.send(ours, msg.MapChunks(["r0", "r1", "r2", "k"], [2 * MiB] * 3 + [4 * MiB]),
                 [os.dup(c.fd) for c in [*released, kept]])
        msg.send(ours, msg.UnmapChunks(["r0", "r1", "r2"]))
        assert unmapping.wait(30)
        msg.send(ours, msg.Copy(1, True, [4 * MiB], [0], [0], ["k"], [4 * MiB]), [os.dup(device.fd)])
        assert msg.receive(ours)[0] == msg.Done(1), "answered while the released chunks were still being unmapped"
        assert contents("host", kept, 4 * MiB) == data


def test_a_copy_waits_for_the_chunks_it_names_being_mapped_and_for_no_others(made_host):
    """The pool's new chunks are mapped as they come (1 ms each on CUDA; 150 in
    a row had held a restore's copy up by 0.12 s): a copy of chunks mapped
    already is answered meanwhile, and one into a chunk still being mapped
    waits for it, then lands (in process, host engine)."""
    gate, mapping = threading.Event(), threading.Event()

    class SlowMaps(HostEngine):
        def map_chunk(self, fd, size):
            if size == 2 * MiB:  # the new chunk's size only
                mapping.set()
                gate.wait(30)
            return super().map_chunk(fd, size)

    device = made_host("gpu", 4 * MiB)
    old, new = made_host("host", 4 * MiB), made_host("host", 2 * MiB)
    fill("host", device, os.urandom(4 * MiB))
    with copier_loop(SlowMaps(open_mapper("host", 0)), gate) as ours:
        msg.send(ours, msg.MapChunks(["old"], [4 * MiB]), [os.dup(old.fd)])
        msg.send(ours, msg.MapChunks(["new"], [2 * MiB]), [os.dup(new.fd)])
        assert mapping.wait(30)
        msg.send(ours, msg.Copy(1, True, [4 * MiB], [0], [0], ["new"], [2 * MiB]), [os.dup(device.fd)])
        msg.send(ours, msg.Copy(2, False, [4 * MiB], [0], [0], ["old"], [4 * MiB]), [os.dup(device.fd)])
        assert msg.receive(ours)[0] == msg.Done(2), "the copy of a mapped chunk did not wait"
        gate.set()
        assert msg.receive(ours)[0] == msg.Done(1), "the copy into the new chunk landed once it was mapped"
        assert contents("host", new, 2 * MiB) == contents("host", old, 2 * MiB)


def test_a_chunk_released_while_it_is_being_mapped_is_unmapped_once_mapped(made_host):
    gate, mapping, unmapped = threading.Event(), threading.Event(), threading.Event()

    class SlowMaps(HostEngine):
        def map_chunk(self, fd, size):
            mapping.set()
            gate.wait(30)
            return super().map_chunk(fd, size)

        def unmap(self, mapped):
            super().unmap(mapped)
            if mapped.size == 2 * MiB:
                unmapped.set()

    device, chunk = made_host("gpu", 2 * MiB), made_host("host", 2 * MiB)
    with copier_loop(SlowMaps(open_mapper("host", 0)), gate) as ours:
        msg.send(ours, msg.MapChunks(["c"], [2 * MiB]), [os.dup(chunk.fd)])
        assert mapping.wait(30)
        msg.send(ours, msg.UnmapChunks(["c"]))
        msg.send(ours, msg.Copy(1, True, [2 * MiB], [0], [0], ["c"], [MiB]), [os.dup(device.fd)])
        assert "not mapped" in msg.receive(ours)[0].error, "released: no copy may use it"
        gate.set()
        assert unmapped.wait(30), "unmapped as soon as it was mapped"


def test_a_restore_that_finds_a_bad_extent_ends_only_once_every_extent_has(tmp_path):
    """A checksum that fails in one extent while others are still being read:
    the file copy raises only after all of them ended, so the caller's unmap of
    the allocations and close of the file never meet a read still running (the
    copier died of that, now and then, as a restore of a corrupt snapshot)."""
    import time
    import zlib

    from gms.copier import files

    engine = HostEngine(open_mapper("host", 0))
    copier = files.FileCopier(engine, threads=4)
    data = os.urandom(4 * MiB)
    snapshot = tmp_path / "snapshot"
    snapshot.write_bytes(data)
    device = os.memfd_create("device")
    os.ftruncate(device, 4 * MiB)
    mapped = engine.map_device(device, 4 * MiB, writable=True)
    crcs = [zlib.crc32(data[k * MiB:(k + 1) * MiB]) for k in range(4)]
    crcs[0] ^= 1  # the first extent fails at once; the others finish slowly
    job = msg.FileCopy(1, False, [4 * MiB], [0] * 4, [k * MiB for k in range(4)], [k * MiB for k in range(4)],
                       [MiB] * 4, crcs)
    ended = []

    def each() -> None:
        time.sleep(0.3)
        ended.append(1)

    fd = os.open(snapshot, os.O_RDONLY)
    try:
        with pytest.raises(files.Corrupt):
            copier.run(job, [mapped], fd, each)
        assert len(ended) == 3, "every other extent ended before the failure was raised"
    finally:
        os.close(fd)
        engine.unmap(mapped)
        copier.close()


# A copier that moves a file copy's extents at the pace the test sets (a slow disk):
# its Ready, then for the one FileCopy a Progress per extent, ``pause`` s apart, then Done.
SLOW_COPIER = r"""
import socket, sys, time
from gms.copier import messages as msg
pause, stall = float(sys.argv[1]), float(sys.argv[2])
sock = socket.socket(fileno=int(sys.argv[sys.argv.index("--fd") + 1]))
msg.send(sock, msg.Ready(0, "slow"))
while (got := msg.receive(sock)) is not None:
    job, fds = got
    msg.close_fds(fds)
    if isinstance(job, msg.FileCopy):
        for n in range(len(job.size)):
            time.sleep(pause)
            msg.send(sock, msg.Progress(job.job, n + 1))
        time.sleep(stall)
        msg.send(sock, msg.Done(job.job, crcs=[0] * len(job.size)))
"""


@pytest.mark.parametrize("pace", ["slow but moving", "stuck"])
def test_a_file_copy_s_deadline_follows_its_progress(tmp_path, monkeypatch, pace):
    """Issue 60: a save on a disk slower than an assumed 64 MiB/s was killed at a
    deadline set by its size, and never landed.  Now the deadline runs from the
    last extent done: a copy that moves finishes however long it takes, one that
    stops moving is killed."""
    import trio

    from gms.disk.format import plan
    from gms.server.tiers import copier_link
    from gms.server.tiers.copier_link import CopierGone, CopierLink

    monkeypatch.setattr(copier_link, "DEADLINE_BASE_S", 0.5)
    monkeypatch.setattr(copier_link, "DISK_STALL_BYTES_PER_S", 1 << 40)  # the base alone: 0.5 s
    script = tmp_path / "slow_copier.py"
    script.write_text(SLOW_COPIER)
    pause, stall = (0.2, 0.0) if pace == "slow but moving" else (0.0, 2.0)
    extents = plan([8 * MiB], MiB)  # eight extents: 1.6 s in all when slow, three deadlines' worth

    async def main():
        link = CopierLink("host", 0)
        link.argv = [sys.executable, str(script), str(pause), str(stall)]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(link.run)
            fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(2)]
            try:
                return await link.file_copy(True, fds, [8 * MiB], extents)
            except CopierGone as gone:
                return gone
            finally:
                nursery.cancel_scope.cancel()

    got = trio.run(main)
    if pace == "stuck":
        assert isinstance(got, CopierGone) and "stuck" in str(got), got
    else:
        assert got == [0] * len(extents)
