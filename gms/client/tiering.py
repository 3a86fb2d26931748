"""Client side of the host tier: filling host copies, and restoring from them.

The server owns both tiers' memory but never maps or copies (it has no CUDA
context).  A server with a copier (``gms.copier``) moves the bytes itself and
the clients just wait; from a server without one (none configured, an older
server, or its copier died) the client that needs the bytes moved does it:

* a writer committing with residency ``system`` copies every allocation of
  its layout into host copies the server makes for it (device to host);
* the reader granted the restore of an evicted layout copies every host copy
  into the fresh GPU memory (host to device), then says so.  A host copy the
  copier filled may be held in several chunks (``ExportHostChunksRequest``).

On CUDA the host copies are pinned memory (``cuMemCreate`` on the host NUMA
node), mapped here without registration, so the copies run at PCIe speed.
Mapping a host copy is the dearest step of a transfer (its set-access costs
about 8 ms per GiB on the H100 host against 20 ms per GiB of copying:
``bench/restore_copy_probe.py``), so host copies are mapped one at a time,
each while the copy of the one before runs (copies are asynchronous, one
synchronize at the end).  On the host backend both tiers are memfd and a
copy is a ``memmove``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence

from ..cuda import Mapper
from ..errors import GMSError, GMSServerError
from ..wire import messages as m
from ..wire.messages import MAX_FDS_PER_MESSAGE
from .transport import _close_all

Call = Callable[[object, type], tuple[object, list[int]]]
# Two exports (device and host) per batch must fit one fd message each.
_BATCH = MAX_FDS_PER_MESSAGE // 2


def _batches(items: Sequence, size: int = _BATCH) -> Iterator[Sequence]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


class _Scratch:
    """Address space mapped for one transfer, all of it unmapped and freed at the end."""

    def __init__(self, mapper: Mapper) -> None:
        self.mapper = mapper
        self.mapped: list[tuple[int, int, object]] = []
        self.reserved: list[tuple[int, int]] = []

    def _reserve(self, sizes: list[int]) -> list[int]:
        total = sum(sizes)
        base = self.mapper.reserve(total)
        self.reserved.append((base, total))
        return list(itertools.accumulate(sizes[:-1], initial=base))

    def map_device(self, infos, fds: list[int], writable: bool) -> list[int]:
        sizes = [info.aligned_size for info in infos]
        vas = self._reserve(sizes)
        handles = self.mapper.map_many(list(zip(fds, vas, sizes)), writable)  # consumes the fds
        self.mapped += zip(vas, sizes, handles)
        return vas

    def map_host_each(self, sizes: list[int], fds: list[int]) -> Iterator[int]:
        """Map the host copies (or chunks) one by one, yielding each address as it
        is mapped, so that the caller's copy of one overlaps mapping the next;
        fds not reached (an error, or the caller stopping early) are closed."""
        pending = list(zip(fds, self._reserve(sizes), sizes))
        try:
            while pending:
                fd, va, size = pending.pop(0)
                handle = self.mapper.map_host(fd, va, size)  # consumes the fd
                self.mapped.append((va, size, handle))
                yield va
        finally:
            _close_all([fd for fd, _, _ in pending])

    def close(self) -> None:
        self.mapper.synchronize()
        if self.mapped:
            self.mapper.unmap_many(self.mapped)
        for va, size in self.reserved:
            self.mapper.free(va, size)
        self.mapped, self.reserved = [], []


def _export(call: Call, request: object, expect: type, count: int):
    response, fds = call(request, expect)
    if len(fds) != count:
        _close_all(fds)
        raise GMSError(f"expected {count} file descriptors, got {len(fds)}")
    return response, fds


def restore(call: Call, mapper: Mapper) -> str:
    """Fill the restored layout's GPU memory from its host copies; returns the layout hash."""
    (listing, _) = call(m.ListAllocationsRequest(None), m.ListAllocationsResponse)
    scratch = _Scratch(mapper)
    chunked = True  # a server from before host chunks answers UNKNOWN_MESSAGE: then whole copies
    try:
        for batch in _batches(listing.allocations):
            ids = [a.allocation_id for a in batch]
            gpu, gpu_fds = _export(call, m.ExportAllocationsRequest(ids), m.ExportAllocationsResponse, len(ids))
            dst = dict(zip(ids, scratch.map_device(gpu.allocations, gpu_fds, writable=True)))
            if chunked:
                try:
                    _restore_chunks(call, mapper, scratch, ids, dst)
                    continue
                except GMSServerError as exc:
                    if exc.code != "UNKNOWN_MESSAGE":
                        raise
                    chunked = False
            host, host_fds = _export(call, m.ExportHostCopiesRequest(ids), m.ExportHostCopiesResponse, len(ids))
            sizes = [info.aligned_size for info in host.allocations]
            for info, s in zip(gpu.allocations, scratch.map_host_each(sizes, host_fds)):
                mapper.copy(dst[info.allocation_id], s, info.aligned_size)
    finally:
        scratch.close()  # synchronizes: every copy has landed
    (done, _) = call(m.RestoreDoneRequest(), m.RestoreDoneResponse)
    return done.memory_layout_hash


def _restore_chunks(call: Call, mapper: Mapper, scratch: _Scratch, ids: list[str], dst: dict[str, int]) -> None:
    """Copy the host copies of ``ids`` chunk by chunk, a page of chunks (253 fds) at a time."""
    start = 0
    while True:
        response, fds = call(m.ExportHostChunksRequest(ids, start), m.ExportHostChunksResponse)
        try:
            rows = list(response.rows())
        except ValueError as exc:
            _close_all(fds)
            raise GMSError(str(exc)) from None
        if len(fds) != len(rows) or any(a not in dst for a, _, _ in rows):
            _close_all(fds)
            raise GMSError(f"expected {len(rows)} host chunks of the asked allocations, got {len(fds)} fds")
        for (allocation_id, offset, size), s in zip(rows, scratch.map_host_each([r[2] for r in rows], fds)):
            mapper.copy(dst[allocation_id] + offset, s, size)
        if not response.next_start:
            return
        start = response.next_start


def fill_host_copies(call: Call, mapper: Mapper, live: dict[str, int]) -> None:
    """As the writer: have the server make a host copy of every allocation of the
    layout and copy the device bytes into it.  ``live`` maps allocation ids to
    the addresses where this process maps them; others are mapped for the copy."""
    (listing, _) = call(m.ListAllocationsRequest(None), m.ListAllocationsResponse)
    scratch = _Scratch(mapper)
    try:
        for batch in _batches(listing.allocations):
            ids = [a.allocation_id for a in batch]
            unmapped = [i for i in ids if i not in live]
            sources = dict(live)
            if unmapped:
                gpu, fds = _export(call, m.ExportAllocationsRequest(unmapped), m.ExportAllocationsResponse, len(unmapped))
                sources.update(zip(unmapped, scratch.map_device(gpu.allocations, fds, writable=False)))
            host, host_fds = _export(call, m.ExportHostCopiesRequest(ids), m.ExportHostCopiesResponse, len(ids))
            sizes = [info.aligned_size for info in host.allocations]
            for info, d in zip(batch, scratch.map_host_each(sizes, host_fds)):
                mapper.copy(d, sources[info.allocation_id], info.aligned_size)
    finally:
        scratch.close()
