"""What moves the bytes in the copier: mapping memory and copying it.

An engine maps host chunks for good (``map_chunk``), maps device allocations
for one copy (``map_device``), and copies between them on a queue per
direction (``copy``, then ``wait``), so that a publish's device-to-host copy
never waits behind a restore's host-to-device one (PCIe moves both ways at
once).  Mapping is the client's :class:`~gms.cuda.Mapper`, the same code a
client maps with; only the copying differs:

* :class:`HostEngine` (host backend): both tiers are memfd, a copy is a
  ``memmove`` (ctypes releases the GIL, so the two directions run at once);
* ``gms.copier.cuda_engine.CudaEngine``: ``cuMemcpyAsync`` on a stream of its
  own per direction, in the device's primary context.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Protocol

import attrs

from ..cuda import Mapper


@attrs.frozen
class Mapped:
    va: int
    size: int
    handle: object


class Engine(Protocol):
    name: str
    host_addressable: bool  # a mapped device allocation is plain memory here (the host backend)

    def map_chunk(self, fd: int, size: int) -> Mapped:
        """Map host memory (consumes ``fd``) until ``unmap``."""

    def map_device(self, fd: int, size: int, writable: bool) -> Mapped:
        """Map a device allocation (consumes ``fd``) for a copy."""

    def unmap(self, mapped: Mapped) -> None: ...

    def copy(self, dst: int, src: int, size: int, to_host: bool) -> None:
        """Start a copy on the direction's queue."""

    def wait(self, to_host: bool) -> None:
        """Until every copy started on the direction's queue has landed."""

    def staging(self, size: int) -> Mapped:
        """Host memory the device copies to and from at full speed (pinned), until ``free_staging``."""

    def free_staging(self, mapped: Mapped) -> None: ...

    def copy_now(self, dst: int, src: int, size: int, to_host: bool) -> None:
        """Copy and return once the bytes are there (the disk path's, from any thread)."""


class MapperEngine:
    """Mapping through a client :class:`Mapper`: reserve, map, unmap, free."""

    name = "mapper"

    def __init__(self, mapper: Mapper) -> None:
        self.mapper = mapper

    def _mapped(self, fd: int, size: int, map_it) -> Mapped:
        try:
            va = self.mapper.reserve(size)
        except BaseException:
            _close(fd)
            raise
        try:
            return Mapped(va, size, map_it(fd, va))  # the mapper consumes the fd
        except BaseException:
            self.mapper.free(va, size)
            raise

    def map_chunk(self, fd: int, size: int) -> Mapped:
        return self._mapped(fd, size, lambda fd, va: self.mapper.map_host(fd, va, size))

    def map_device(self, fd: int, size: int, writable: bool) -> Mapped:
        return self._mapped(fd, size, lambda fd, va: self.mapper.map(fd, va, size, writable))

    def unmap(self, mapped: Mapped) -> None:
        self.mapper.unmap(mapped.va, mapped.size, mapped.handle)
        self.mapper.free(mapped.va, mapped.size)


class HostEngine(MapperEngine):
    """The host backend's copier: memfd mappings and ``memmove``."""

    name = "memmove (host backend)"
    host_addressable = True  # the disk path reads and writes mapped allocations directly

    def copy(self, dst: int, src: int, size: int, to_host: bool) -> None:
        ctypes.memmove(dst, src, size)

    def wait(self, to_host: bool) -> None:
        pass  # memmove has returned: the bytes are there

    def staging(self, size: int) -> Mapped:
        buffer = mmap.mmap(-1, size)
        return Mapped(ctypes.addressof(ctypes.c_char.from_buffer(buffer)), size, buffer)

    def free_staging(self, mapped: Mapped) -> None:
        pass  # (the mmap goes with its last reference)

    copy_now = copy


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
