"""Client side of the host tier: filling host copies, and restoring from them.

The server owns both tiers' memory but never maps or copies (it has no CUDA
context); the client that needs the bytes moved does it:

* a writer committing with residency ``system`` copies every allocation of
  its layout into host copies the server makes for it (device to host);
* the reader granted the restore of an evicted layout copies every host copy
  into the fresh GPU memory (host to device), then says so.

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
from ..errors import GMSError
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

    def map_host_each(self, infos, fds: list[int]) -> Iterator[int]:
        """Map the host copies one by one, yielding each address as it is mapped,
        so that the caller's copy of one overlaps mapping the next; fds not
        reached (an error, or the caller stopping early) are closed."""
        pending = list(zip(fds, self._reserve([info.aligned_size for info in infos]), infos))
        try:
            while pending:
                fd, va, info = pending.pop(0)
                handle = self.mapper.map_host(fd, va, info.aligned_size)  # consumes the fd
                self.mapped.append((va, info.aligned_size, handle))
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
    try:
        for batch in _batches(listing.allocations):
            ids = [a.allocation_id for a in batch]
            gpu, gpu_fds = _export(call, m.ExportAllocationsRequest(ids), m.ExportAllocationsResponse, len(ids))
            try:
                host, host_fds = _export(call, m.ExportHostCopiesRequest(ids), m.ExportHostCopiesResponse, len(ids))
            except BaseException:
                _close_all(gpu_fds)
                raise
            try:
                dst = scratch.map_device(gpu.allocations, gpu_fds, writable=True)
            except BaseException:
                _close_all(host_fds)
                raise
            for info, d, s in zip(gpu.allocations, dst, scratch.map_host_each(host.allocations, host_fds)):
                mapper.copy(d, s, info.aligned_size)
    finally:
        scratch.close()  # synchronizes: every copy has landed
    (done, _) = call(m.RestoreDoneRequest(), m.RestoreDoneResponse)
    return done.memory_layout_hash


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
            for info, d in zip(batch, scratch.map_host_each(host.allocations, host_fds)):
                mapper.copy(d, sources[info.allocation_id], info.aligned_size)
    finally:
        scratch.close()
