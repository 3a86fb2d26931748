"""The copier's CUDA engine: host chunks mapped once, copies on a stream per direction.

It maps with the client's :class:`~gms.cuda.vmm.VmmMapper` (import, reserve,
``cuMemMap``, ``cuMemSetAccess`` in the device's primary context): a host
chunk is mapped for device access once, when the server makes it, so its
set-access (8 to 10 ms per GiB on the H100 host, bench/restore_copy_probe.py)
is never paid on a transfer's path; a device allocation is mapped for one
copy (0.1 ms per GiB).  Copies are ``cuMemcpyAsync`` on one non-blocking
stream per direction: one stream reaches the PCIe floor (same probe), and
two let a publish's device-to-host copy run beside a restore's
host-to-device one.

A CUDA failure other than out-of-memory ends this process (the mapper's
rule, as in a client): the server sees the link close, falls back to
client-side copies and starts another copier.
"""

from __future__ import annotations

from cuda.bindings import driver as cu

from ..cuda.vmm import VmmMapper
from .engine import Mapped, MapperEngine


class _StreamMapper(VmmMapper):
    """The client's mapper, plus streams of the copier's own."""

    def new_stream(self):
        self._make_current()
        return self._run("cuStreamCreate", cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))

    def copy_on(self, stream, dst: int, src: int, size: int) -> None:
        self._make_current()
        self._run("cuMemcpyAsync", cu.cuMemcpyAsync(dst, src, size, stream))

    def wait_for(self, stream) -> None:
        self._make_current()
        self._run("cuStreamSynchronize", cu.cuStreamSynchronize(stream))

    def pinned(self, size: int) -> int:
        self._make_current()
        return int(self._run("cuMemHostAlloc", cu.cuMemHostAlloc(size, 0)))

    def unpin(self, address: int) -> None:
        self._make_current()
        self._run("cuMemFreeHost", cu.cuMemFreeHost(address))

    def copy_sync(self, dst: int, src: int, size: int, to_host: bool) -> None:
        self._make_current()
        if to_host:
            self._run("cuMemcpyDtoH", cu.cuMemcpyDtoH(dst, src, size))
        else:
            self._run("cuMemcpyHtoD", cu.cuMemcpyHtoD(dst, src, size))


class CudaEngine(MapperEngine):
    host_addressable = False  # the disk path stages through pinned buffers

    def __init__(self, device: int) -> None:
        mapper = _StreamMapper(device)
        super().__init__(mapper)
        self._streams = {True: mapper.new_stream(), False: mapper.new_stream()}
        name = cu.cuDeviceGetName(256, mapper._dev)[1].split(b"\0", 1)[0].decode(errors="replace")
        self.name = f"cuda device {device} ({name}), cuMemcpyAsync on a stream per direction"

    def copy(self, dst: int, src: int, size: int, to_host: bool) -> None:
        self.mapper.copy_on(self._streams[to_host], dst, src, size)

    def wait(self, to_host: bool) -> None:
        self.mapper.wait_for(self._streams[to_host])

    def staging(self, size: int) -> Mapped:
        return Mapped(self.mapper.pinned(size), size, None)

    def free_staging(self, mapped: Mapped) -> None:
        self.mapper.unpin(mapped.va)

    def copy_now(self, dst: int, src: int, size: int, to_host: bool) -> None:
        self.mapper.copy_sync(dst, src, size, to_host)
