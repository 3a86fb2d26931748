"""The copier process: holds every host chunk mapped, copies on the server's word.

One per server (the server starts it, ``gms.server.tiers.copier_link``), with a
CUDA context of its own (on the host backend, no context: ``memmove``), so
the server keeps none.  It owns no state: the server's event log says what
exists; the copier keeps mappings and moves bytes.

Threads: the main thread reads the link in order and hands each message on:
chunks to map to the mapping thread, each copy to the worker of its
direction.  A copy waits for the chunks it names that are still being
mapped (a copy always finds the chunks mapped that were sent before it),
and for no others: a restore's copy is not held up behind the pool's new
chunks (150 of them, 1 ms each, had delayed one by 0.12 s on the H100).
Each worker maps the copy's device allocations one by one, starting each
one's moves as soon as it is mapped (mapping the next overlaps copying the
last), waits for them to land, answers, then unmaps.  Chunks the server
releases leave the table at once and are unmapped by a thread of their own,
between copies: unmapping is slow (259 chunks, 16 GiB: 0.85 s on the H100)
and, done where the link is read, held the next publish's copy up behind a
replaced layout's chunks.  A chunk the server releases while a copy uses it
is unmapped when that copy ends; one released while it is being mapped, once
it is mapped.

It exits when the link closes (the server went away or stopped it).  A CUDA
failure ends it at once (``gms.cuda.vmm.fatal``); the server notices the link
close, falls back to client-side copies and starts another.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import signal
import socket
import threading
import time
from collections.abc import Iterator

from .. import checksum
from . import files
from . import messages as msg
from .chunk_maps import ChunkMaps
from .engine import Engine, Mapped

log = logging.getLogger("gms.copier")
# Test hook (tests/test_copier.py, tests/test_disk_tier.py): "restore:N",
# "publish:N", "save:N" or "load:N" stops this process (SIGSTOP) once N moves
# (or extents) of that kind have landed, so a test can kill it with a copy half done.
STOP_AFTER_ENV = "GMS_COPIER_STOP_AFTER"
UNMAP_PATIENCE_S = 1.0  # the longest a released chunk waits for a pause between copies
_KINDS = {"publish": True, "restore": False, "save": "save", "load": "load"}


def _stop_after() -> tuple[object, int] | None:
    spec = os.environ.get(STOP_AFTER_ENV, "")
    if not spec:
        return None
    kind, _, count = spec.partition(":")
    return _KINDS[kind], int(count)


class Copier:
    def __init__(self, engine: Engine, sock: socket.socket) -> None:
        self.engine = engine
        self.sock = sock
        self._send_lock = threading.Lock()
        self.maps = ChunkMaps()  # the host chunks (their own lock)
        self._queues = {True: queue.SimpleQueue(), False: queue.SimpleQueue()}
        self._maps: queue.SimpleQueue = queue.SimpleQueue()  # (MapChunks, fds), or None: stop
        self._unmaps: queue.SimpleQueue = queue.SimpleQueue()  # Mapped chunks to unmap, or None: stop
        self._failure: BaseException | None = None  # of the mapping thread: ends the process
        self._stopping = threading.Event()
        self._moves = {True: 0, False: 0, "save": 0, "load": 0}
        self._moves_lock = threading.Lock()
        self._stop_after = _stop_after()
        self._files: files.FileCopier | None = None  # made at the first file copy
        self._disk: queue.SimpleQueue = queue.SimpleQueue()  # (FileCopy, fds), or None: stop

    # -- the link ---------------------------------------------------------------

    def _send(self, message: object) -> None:
        try:
            with self._send_lock:
                msg.send(self.sock, message)
        except OSError:
            self._stopping.set()  # the server is gone: nobody to answer

    def run(self) -> None:
        workers = [
            threading.Thread(target=self._work, args=(to_host,), name=f"copier-{'d2h' if to_host else 'h2d'}")
            for to_host in (True, False)
        ]
        mapper = threading.Thread(target=self._map_chunks, name="copier-map")
        unmapper = threading.Thread(target=self._unmap_chunks, name="copier-unmap")
        disk = threading.Thread(target=self._work_files, name="copier-files")
        workers.append(disk)
        for worker in [*workers, mapper, unmapper]:
            worker.start()
        self._send(msg.Ready(os.getpid(), self.engine.name, checksum.IMPLEMENTATION))
        try:
            while not self._stopping.is_set():
                got = msg.receive(self.sock)
                if got is None:
                    break
                self._handle(*got)
        except OSError:
            if self._failure is None:  # else: the mapping thread shut the link to stop us
                raise
        finally:
            self._maps.put(None)
            mapper.join()
            self._stop()
            for q in [*self._queues.values(), self._disk]:
                q.put(None)
            for worker in workers:
                worker.join()
            self._unmaps.put(None)
            unmapper.join()
            for mapped in self.maps.take_all():
                self.engine.unmap(mapped)
            if self._files is not None:
                self._files.close()
        if self._failure is not None:
            raise self._failure

    def _stop(self) -> None:
        self._stopping.set()
        self.maps.wake_all()

    def _handle(self, message: object, fds: list[int]) -> None:
        if isinstance(message, msg.MapChunks):
            if len(fds) != len(message.ids) or len(message.sizes) != len(message.ids):
                msg.close_fds(fds)
                raise msg.LinkError(f"MapChunks of {len(message.ids)} chunks came with {len(fds)} fds")
            self.maps.expect(message.ids, message.sizes)
            self._maps.put((message, fds))
        elif isinstance(message, msg.UnmapChunks):
            msg.close_fds(fds)
            self._unmap_later(self.maps.release(message.ids))
            log.debug("%d chunks released: unmapped between copies", len(message.ids))
        elif isinstance(message, msg.Copy):
            log.debug("copy %d received", message.job)
            self._dispatch(message, fds)
        elif isinstance(message, msg.FileCopy):
            error = files.check(message, len(fds))
            if error:
                msg.close_fds(fds)
                self._send(msg.Done(message.job, error))
            else:
                self._disk.put((message, fds))
        else:
            msg.close_fds(fds)
            raise msg.LinkError(f"the copier takes no {type(message).__name__}")

    # -- chunks -------------------------------------------------------------------

    def _map_chunks(self) -> None:
        for message, fds in _each(self._maps):
            if self._failure is not None:
                msg.close_fds(fds)
                continue
            started = time.perf_counter()
            try:
                self._map(message, fds)
            except BaseException as exc:  # noqa: BLE001 - ends the process, as on the main thread
                self._failure = exc
                self._stop()
                try:
                    self.sock.shutdown(socket.SHUT_RDWR)  # the main thread's read returns
                except OSError:
                    pass
                continue
            log.debug("mapped %d chunks in %.1f ms", len(message.ids), (time.perf_counter() - started) * 1e3)

    def _map(self, message: msg.MapChunks, fds: list[int]) -> None:
        for n, (chunk, size, fd) in enumerate(zip(message.ids, message.sizes, fds)):
            try:
                mapped = self.engine.map_chunk(fd, size)  # consumes the fd
            except BaseException:
                msg.close_fds(fds[n + 1 :])
                raise
            old = self.maps.mapped(chunk, mapped)
            if old is not None:
                self._unmaps.put(old)

    def _unmap_later(self, mappings: list[Mapped]) -> None:
        for mapped in mappings:
            self._unmaps.put(mapped)

    def _unmap_chunks(self) -> None:
        """Unmap released chunks one by one, each when no copy runs (or after a
        second: a stream of copies does not keep memory pinned for ever).  An
        unmap slows the device mappings a copy makes beside it (a 2 GiB
        publish's two took 21 to 33 ms instead of 1 to 3 on the H100)."""
        for mapped in _each(self._unmaps):
            self.maps.wait_quiet(UNMAP_PATIENCE_S)
            self.engine.unmap(mapped)

    # -- copies -------------------------------------------------------------------

    def _dispatch(self, job: msg.Copy, fds: list[int]) -> None:
        error = _malformed(job, len(fds)) or self.maps.claim(job.chunk, job.size)
        if error:
            msg.close_fds(fds)
            self._send(msg.Done(job.job, error))
            return
        self._queues[job.to_host].put((job, fds))

    def _work(self, to_host: bool) -> None:
        for job, fds in _each(self._queues[to_host]):
            device: list[Mapped] = []
            self.maps.start_copy(job.chunk, self._stopping.is_set)  # (its chunks sent before it: mapped)
            try:
                if self._stopping.is_set():
                    msg.close_fds(fds)
                    continue
                error = self._copy(job, fds, device)
                self._send(msg.Done(job.job, error))
            finally:
                for mapped in device:  # after the answer: off the transfer's path
                    self.engine.unmap(mapped)
                self._unmap_later(self.maps.end_copy(job.chunk))

    def _copy(self, job: msg.Copy, fds: list[int], device: list[Mapped]) -> str:
        """Run the copy; '' when every byte landed, else why not."""
        by_allocation: list[list[int]] = [[] for _ in fds]
        for k, allocation in enumerate(job.allocation):
            by_allocation[allocation].append(k)
        chunk_va = self.maps.addresses(job.chunk)
        engine = self.engine
        consumed = 0
        clock = time.perf_counter
        started, mapping = clock(), 0.0
        try:
            for i, fd in enumerate(fds):
                consumed = i + 1  # map_device consumes the fd, mapped or not
                t0 = clock()
                device.append(engine.map_device(fd, job.device_sizes[i], writable=not job.to_host))
                mapping += clock() - t0
                for k in by_allocation[i]:
                    here, there = device[i].va + job.offset[k], chunk_va[job.chunk[k]]
                    if job.to_host:
                        engine.copy(there, here, job.size[k], True)
                    else:
                        engine.copy(here, there, job.size[k], False)
                    self._maybe_stop(job.to_host)
            issued = clock()
            engine.wait(job.to_host)
            if log.isEnabledFor(logging.INFO):  # where a transfer's time goes (docs/performance.md, section 7)
                moved = sum(job.size)
                log.info(
                    "copy %d %s: %.1f MiB, %d allocations: mapping %.1f ms, issuing the rest %.1f ms, "
                    "waiting %.1f ms, %.1f GiB/s",
                    job.job, "to host" if job.to_host else "to device", moved / 2**20, len(fds), mapping * 1e3,
                    (issued - started - mapping) * 1e3, (clock() - issued) * 1e3,
                    moved / 2**30 / max(clock() - started, 1e-9),
                )
        except Exception as exc:  # noqa: BLE001 - answered; the server falls back
            msg.close_fds(fds[consumed:])
            try:
                engine.wait(job.to_host)  # what was started lands before its memory is unmapped
            except Exception:  # noqa: BLE001 - the copy failed already; say why it did
                pass
            log.warning("copy %d failed: %s", job.job, exc)
            return f"{type(exc).__name__}: {exc}"
        return ""

    def _maybe_stop(self, kind: object) -> None:
        with self._moves_lock:
            self._moves[kind] += 1
            stop = self._stop_after is not None and self._stop_after == (kind, self._moves[kind])
        if stop:
            if isinstance(kind, bool):
                self.engine.wait(kind)  # what was started has landed: a copy half done
            os.kill(os.getpid(), signal.SIGSTOP)

    # -- file copies (the disk tier) ---------------------------------------------------------

    def _work_files(self) -> None:
        """One file copy at a time (its extents run on the FileCopier's threads)."""
        for job, fds in _each(self._disk):
            if self._stopping.is_set():
                msg.close_fds(fds)
                continue
            device: list[Mapped] = []
            try:
                self._send(self._copy_file(job, fds, device))
            finally:
                # After the answer: letting a restored GiB's mapping go took 73 ms on 2 cores, which
                # the reader waited for (the memory stays the server's; only this view of it goes).
                for mapped in device:
                    self.engine.unmap(mapped)

    def _copy_file(self, job: msg.FileCopy, fds: list[int], device: list[Mapped]) -> msg.Done:
        """The copy; ``device`` gets the allocations' mappings, for the caller to let go."""
        *device_fds, file_fd = fds
        consumed = 0
        kind = "save" if job.to_file else "load"
        started = time.perf_counter()
        try:
            if self._files is None:
                self._files = files.FileCopier(self.engine)
            for i, fd in enumerate(device_fds):
                consumed = i + 1  # map_device consumes the fd, mapped or not
                device.append(self.engine.map_device(fd, job.device_sizes[i], writable=not job.to_file))
            done = itertools.count(1)  # (next() on it is atomic: the disk threads share it)

            def each() -> None:  # (on the disk threads)
                self._maybe_stop(kind)
                self._send(msg.Progress(job.job, next(done)))

            crcs = self._files.run(job, device, file_fd, each)
        except files.Corrupt as exc:
            log.error("restore %d from a snapshot: %s", job.job, exc)
            return msg.Done(job.job, f"corrupt: {exc}", corrupt=True)
        except Exception as exc:  # noqa: BLE001 - answered: the server says why the save or restore failed
            log.warning("file copy %d failed: %s", job.job, exc)
            return msg.Done(job.job, f"{type(exc).__name__}: {exc}")
        finally:
            msg.close_fds(device_fds[consumed:])
            os.close(file_fd)
        moved = sum(job.size)
        log.info("%s %d: %.1f MiB in %d extents, %.2f GiB/s", kind, job.job, moved / 2**20, len(job.size),
                 moved / 2**30 / max(time.perf_counter() - started, 1e-9))
        return msg.Done(job.job, crcs=crcs if job.to_file else [])


def _each(work: queue.SimpleQueue) -> Iterator:
    """What is put on ``work``, in order, until the None that stops its thread."""
    while (item := work.get()) is not None:
        yield item


def _malformed(job: msg.Copy, fds: int) -> str:
    moves = len(job.allocation)
    if fds != len(job.device_sizes):
        return f"{len(job.device_sizes)} device allocations came with {fds} fds"
    if not (len(job.offset) == len(job.chunk) == len(job.size) == moves):
        return "the move columns differ in length"
    for allocation, offset, size in zip(job.allocation, job.offset, job.size):
        if error := msg.extent_error(job.device_sizes, allocation, offset, size, "a move"):
            return error
    return ""
