"""The server's side of the copier: start it, feed it chunks and copies, outlive it.

The copier (``gms.copier``) is a child process with a CUDA context of its own,
on a ``SOCK_SEQPACKET`` socketpair.  :meth:`CopierLink.run` supervises it in
the server's nursery: start it, tell it every chunk of host memory it must
keep mapped, serve the link until it closes, then start another after a
backoff (half a second, doubling to 30 s; reset after a minute of health).

The copier can never take the server down: when the link closes (it
crashed, a CUDA failure ended it, it was killed) or a copy outlives its
deadline (then it is killed), every copy waiting on it raises
:class:`CopierGone`, and its callers fall back to today's client-side copies
(the reader restores, the writer fills its host copies); the server logs it
and goes on.  Nothing the copier does is state: the event log says what
exists, whoever moved the bytes.

Messages to the copier go through one queue drained by one task, so they
arrive in the order the loop made them: a chunk is always mapped there
before a copy that uses it arrives.  Chunks made or released while no
copier runs are not sent; a new copier is told every live chunk first.
"""

from __future__ import annotations

import logging
import math
import signal
import socket
from collections.abc import Callable

import attrs
import trio

from ...copier import messages as msg
from ...system.launch import child_env, python_argv

log = logging.getLogger("gms.server.copier")

FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
HEALTHY_AFTER_S = 60.0
READY_TIMEOUT_S = 30.0  # a CUDA context can take seconds on a busy host
STOP_GRACE_S = 5.0
# A copy's deadline: generous (a tenth of PCIe's speed), then the copier is
# presumed stuck and killed; its callers fall back.
DEADLINE_BASE_S = 30.0
DEADLINE_BYTES_PER_S = 1 << 30
# A file copy's deadline follows its progress (issue 60: a disk slower than an
# assumed rate never finished a save): the copier says when each extent is done,
# and it is presumed stuck only when an extent takes longer than this, as slow
# as 1 MiB/s after the base.
DISK_STALL_BYTES_PER_S = 1 << 20


class CopierGone(Exception):
    """No copier did this copy (none running, it died, or it failed the copy): fall back."""


class SnapshotCorrupt(Exception):
    """The copier read a snapshot whose bytes are not what was saved."""


@attrs.frozen
class Move:
    """Bytes between a device allocation (``allocation``: its index in the copy) and a chunk."""

    allocation: int
    offset: int
    chunk: str
    size: int


LiveChunks = Callable[[], list[tuple[str, int, int]]]  # (chunk id, a new fd, size)


@attrs.define
class _Job:
    """A copy asked of the copier: its answer, once it came."""

    progress: bool  # its deadline follows its Progress (a file copy's)
    done: msg.Done | None = None
    news: trio.Event = attrs.Factory(trio.Event)  # the answer came, or (progress) an extent is done


class CopierLink:
    def __init__(
        self,
        backend: str,
        device: int,
        *,
        log_level: str = "warning",
        ready_timeout: float = READY_TIMEOUT_S,
    ) -> None:
        self.argv = python_argv("gms.copier", "--backend", backend, "--device", str(device), "--log-level", log_level)
        self.state = "starting"  # starting, running, down (between copiers), stopped
        self.pid = 0
        self.engine = ""
        self.restarts = 0
        self.ready_timeout = ready_timeout
        self._live_chunks: LiveChunks = list  # what a new copier must map first (remap_with)
        self._settled = trio.Event()  # set when a start succeeded or failed
        self._outbox: trio.MemorySendChannel | None = None
        self._jobs: dict[int, _Job] = {}
        self._next_job = 1
        self._process: trio.Process | None = None

    def remap_with(self, live_chunks: LiveChunks) -> None:
        """What every copier that starts maps before its first copy: the host tier's
        chunks, made after this link (the assembly, ``gms.server.assembly``)."""
        self._live_chunks = live_chunks

    # -- what the loop asks ---------------------------------------------------------

    async def usable(self) -> bool:
        """Whether a copier runs now; while one starts, wait for it (bounded)."""
        if self.state == "starting":
            with trio.move_on_after(self.ready_timeout):
                await self._settled.wait()
        return self.state == "running"

    def map(self, chunks: list[tuple[str, int, int]]) -> None:
        """Have the copier map these (chunk id, fd, size); the fds are the link's now."""
        for start in range(0, len(chunks), msg.MAX_FDS):
            batch = chunks[start : start + msg.MAX_FDS]
            self._post(msg.MapChunks([c for c, _, _ in batch], [s for _, _, s in batch]), [f for _, f, _ in batch])

    def unmap(self, chunk_ids: list[str]) -> None:
        for start in range(0, len(chunk_ids), 4096):
            self._post(msg.UnmapChunks(list(chunk_ids[start : start + 4096])), [])

    async def copy(self, to_host: bool, fds: list[int], device_sizes: list[int], moves: list[Move]) -> None:
        """One copy (at most 253 allocations, ``msg.MAX_MOVES`` moves); consumes ``fds``.
        Returns when every byte landed; raises CopierGone otherwise."""
        await self._ask(
            lambda job: msg.Copy(
                job, to_host, list(device_sizes), [mv.allocation for mv in moves], [mv.offset for mv in moves],
                [mv.chunk for mv in moves], [mv.size for mv in moves],
            ),
            fds, DEADLINE_BASE_S + sum(mv.size for mv in moves) / DEADLINE_BYTES_PER_S,
        )

    async def file_copy(self, to_file: bool, fds: list[int], device_sizes: list[int], extents) -> list[int]:
        """Device allocations (``fds``, the file's last) to a snapshot file or back
        (``extents``: ``gms.disk.format.Extent``); consumes ``fds``.  A save's crc32
        per extent; raises SnapshotCorrupt (a restore's checksums failed) or CopierGone."""
        done = await self._ask(
            lambda job: msg.FileCopy(
                job, to_file, list(device_sizes), [e.allocation for e in extents], [e.offset for e in extents],
                [e.file_offset for e in extents], [e.size for e in extents], [e.crc for e in extents],
            ),
            fds, DEADLINE_BASE_S + max((e.size for e in extents), default=0) / DISK_STALL_BYTES_PER_S,
            progress=True,
        )
        if to_file and len(done.crcs) != len(extents):
            raise CopierGone(f"the copier answered {len(done.crcs)} checksums for {len(extents)} extents")
        return done.crcs

    async def _ask(self, make, fds: list[int], deadline: float, progress: bool = False) -> msg.Done:
        """``deadline``: for the whole copy; with ``progress``, from the copy's start or
        its last extent done (the copier's Progress), whichever came last."""
        if not await self.usable():
            msg.close_fds(fds)
            raise CopierGone(f"no copier is running ({self.state})")
        job = self._next_job
        self._next_job += 1
        waiting = self._jobs[job] = _Job(progress)
        try:
            if not self._post(make(job), fds):
                raise CopierGone("the copier went away")
            while waiting.done is None:
                with trio.move_on_after(deadline) as waited:
                    await waiting.news.wait()
                if waited.cancelled_caught:
                    log.error("copier: copy %d made no progress for %.0f s: killing it", job, deadline)
                    self._kill()
                    raise CopierGone("the copier was stuck and was killed")
                waiting.news = trio.Event()
        finally:
            self._jobs.pop(job, None)  # an answer that comes after this is ignored
        done = waiting.done
        if done.corrupt:
            raise SnapshotCorrupt(done.error)
        if done.error:
            raise CopierGone(done.error)
        return done

    def status(self) -> tuple[str, int]:
        return self.state, self.pid if self.state == "running" else 0

    def _post(self, message: object, fds: list[int]) -> bool:
        if self._outbox is None:
            msg.close_fds(fds)  # no copier: a new one is told every live chunk when it starts
            return False
        self._outbox.send_nowait((msg.encode(message), fds))
        return True

    def _kill(self) -> None:
        if self._process is not None and self._process.returncode is None:
            self._process.send_signal(signal.SIGKILL)

    # -- supervision ----------------------------------------------------------------

    async def run(self) -> None:
        """Keep a copier running until cancelled (the server stops)."""
        backoff = FIRST_BACKOFF_S
        try:
            while True:
                started = trio.current_time()
                await self._serve_one()
                if trio.current_time() - started > HEALTHY_AFTER_S:
                    backoff = FIRST_BACKOFF_S
                log.warning("copier: starting another in %.1f s; until then clients copy themselves", backoff)
                await trio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                self.restarts += 1
                self.state = "starting"
                self._settled = trio.Event()
        finally:
            self.state = "stopped"
            self._settled.set()

    def _down(self, why: str) -> None:
        self.state = "down"
        self._settled.set()
        for waiting in self._jobs.values():  # their copies will never be answered
            if waiting.done is None:
                waiting.done = msg.Done(0, f"the copier went away ({why})")
            waiting.news.set()

    async def _serve_one(self) -> None:
        """Start one copier and serve its link until it closes."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            process = await trio.lowlevel.open_process(
                [*self.argv, "--fd", str(child.fileno())], pass_fds=(child.fileno(),), env=child_env()
            )
        except OSError as exc:
            parent.close()
            log.error("copier: cannot start it: %s", exc)
            self._down(str(exc))
            return
        finally:
            child.close()
        self._process = process
        sock = trio.socket.from_stdlib_socket(parent)
        outbox, inbox = trio.open_memory_channel(math.inf)
        why = "its link closed"
        try:
            self._outbox = outbox
            chunks = self._live_chunks()  # before any copy: the queue keeps the order
            if chunks:
                self.map(chunks)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._send_all, sock, inbox)
                why = await self._read_all(sock)
                nursery.cancel_scope.cancel()
        except BaseException as exc:
            if _cancelled(exc):
                why = "the server stops"
            raise
        finally:
            self._outbox = None
            outbox.close()
            for _, fds in _drain(inbox):
                msg.close_fds(fds)
            sock.close()  # the copier sees the link close and exits
            with trio.CancelScope(shield=True):
                with trio.move_on_after(STOP_GRACE_S):
                    await process.wait()
                if process.returncode is None:
                    process.kill()
                    await process.wait()
            self._process = None
            self.pid = 0
            level = logging.INFO if why == "the server stops" else logging.WARNING
            log.log(level, "copier (pid %d) exited (%s, code %s)", process.pid, why, process.returncode)
            self._down(why)

    async def _send_all(self, sock, inbox) -> None:
        async for frame, fds in inbox:
            try:
                await sock.sendmsg([frame], msg.rights(fds))
            except OSError as exc:
                log.warning("copier: sending failed: %s", exc)
                return  # the reader sees the link close
            finally:
                msg.close_fds(fds)

    async def _read_all(self, sock) -> str:
        """Answers until the link closes; returns why it did."""
        while True:
            try:
                body, ancillary, flags, _ = await sock.recvmsg(msg.MAX_FRAME_BYTES, msg.fd_space(1))
                msg.close_fds(msg.unpack_fds(ancillary, flags))  # the copier sends none
                if not body:
                    return "its link closed"
                message = msg.decode(body)
            except (OSError, msg.LinkError) as exc:
                self._kill()
                return f"a bad frame: {exc}"
            if isinstance(message, msg.Ready):
                self.state, self.pid, self.engine = "running", message.pid, message.engine
                self._settled.set()
                log.info("copier (pid %d) ready: %s, crc32 %s", message.pid, message.engine, message.checksum)
            elif isinstance(message, msg.Progress):
                waiting = self._jobs.get(message.job)
                if waiting is not None and waiting.progress:
                    waiting.news.set()
            elif isinstance(message, msg.Done):
                waiting = self._jobs.get(message.job)
                if waiting is not None:
                    waiting.done = message
                    waiting.news.set()
                if message.error:
                    log.warning("copier: copy %d failed: %s", message.job, message.error)


def _cancelled(exc: BaseException) -> bool:
    """Cancelled, or a group (from a nursery) of nothing but Cancelled."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(trio.Cancelled)[1] is None
    return isinstance(exc, trio.Cancelled)


def _drain(inbox) -> list:
    items = []
    while True:
        try:
            items.append(inbox.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            return items
