"""CUDA VMM adapters (``cuda.bindings.driver``): the real GPU memory path.

Server side (:class:`VmmBackend`): ``cuMemCreate`` pinned device memory that
can be exported as a POSIX fd, exported once (the server ``dup()``s that fd
per export), released on layout clear; called from the tier's lane only.  It never maps and never creates a context.  The host tier
(:class:`VmmHostTier`) is the same call on the GPU's host NUMA node: pinned
host memory the server owns, exported as an fd, that every client maps
without registering it (``cudaHostRegister`` costs 0.44 s per 8 GiB in each
process) and copies from at PCIe speed (bench/host_tier_probe.py).

Client side (:class:`VmmMapper`): import the fd, reserve aligned address
space, ``cuMemMap`` and ``cuMemSetAccess`` (read-write for RW, read-only for
RO) in the device's primary context, the one PyTorch uses.

Errors: out-of-memory raises :class:`OutOfMemory` (the server retries).  Any
other CUDA error raises :class:`CudaError` on the server (the server stops)
and ends the process on the client, as the seed requires: a failed VMM call
leaves address space in a state no caller can reason about.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

from cuda.bindings import driver as cu

from .interface import BackendError, DeviceInfo, Held, MemoryLost, OutOfMemory, contiguous_runs

_SUCCESS = cu.CUresult.CUDA_SUCCESS
_OOM = cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY
_POSIX_FD = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
EXIT_CUDA_FAILURE = 70
# Errors that say the driver could not look, not that the memory is gone.
_CANNOT_CHECK = frozenset(
    {
        cu.CUresult.CUDA_ERROR_NOT_INITIALIZED,
        cu.CUresult.CUDA_ERROR_INVALID_CONTEXT,
        cu.CUresult.CUDA_ERROR_DEINITIALIZED,
    }
)


class CudaError(BackendError):
    def __init__(self, call: str, result) -> None:
        err, name = cu.cuGetErrorName(result)
        label = name.decode() if err == _SUCCESS else str(result)
        super().__init__(f"{call} failed: {label} ({int(result)})")
        self.call = call
        self.result = result


def _check(call: str, out):
    """Unpack a cuda-bindings result tuple, raising on failure."""
    result, *values = out if isinstance(out, tuple) else (out,)
    if result != _SUCCESS:
        if result == _OOM:
            raise OutOfMemory(f"{call}: CUDA_ERROR_OUT_OF_MEMORY")
        raise CudaError(call, result)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _init() -> None:
    _check("cuInit", cu.cuInit(0))


def _device(ordinal: int):
    _init()
    return _check("cuDeviceGet", cu.cuDeviceGet(ordinal))


def _format_uuid(raw) -> str:
    data = raw if isinstance(raw, bytes | bytearray) else bytes(ord(c) & 0xFF for c in raw)
    h = bytes(data[:16]).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def device_uuid(ordinal: int) -> str:
    """The GPU's UUID as nvidia-smi prints it (stable across CUDA_VISIBLE_DEVICES)."""
    return _format_uuid(_check("cuDeviceGetUuid", cu.cuDeviceGetUuid(_device(ordinal))).bytes)


def host_numa_node(ordinal: int) -> int:
    """The host NUMA node nearest the GPU (0 where the driver cannot say)."""
    attribute = getattr(cu.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID", None)
    if attribute is None:
        return 0
    err, node = cu.cuDeviceGetAttribute(attribute, _device(ordinal))
    return int(node) if err == _SUCCESS and node >= 0 else 0


def _location(ordinal: int, host: bool, location=None) -> cu.CUmemLocation:
    """Fill ``location`` (a new one if None): the GPU, or its host NUMA node."""
    location = cu.CUmemLocation() if location is None else location
    if host:
        location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
        location.id = host_numa_node(ordinal)
    else:
        location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        location.id = ordinal
    return location


def _allocation_prop(ordinal: int, host: bool = False) -> cu.CUmemAllocationProp:
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    _location(ordinal, host, prop.location)
    prop.requestedHandleTypes = _POSIX_FD
    return prop


def granularity(ordinal: int, host: bool = False) -> int:
    flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    prop = _allocation_prop(ordinal, host)
    return int(_check("cuMemGetAllocationGranularity", cu.cuMemGetAllocationGranularity(prop, flag)))


# -- NVML (free memory without a context) ---------------------------------------


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class _Nvml:
    """Free device memory from NVML, initialised once (an init per status probe
    cost milliseconds); None where NVML is missing."""

    def __init__(self, uuid: str) -> None:
        self._nvml = self._handle = None
        try:
            nvml = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError:
            return
        if nvml.nvmlInit_v2() != 0:
            return
        handle = ctypes.c_void_p()
        if nvml.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(handle)) != 0:
            nvml.nvmlShutdown()
            return
        self._nvml, self._handle = nvml, handle

    def free_bytes(self) -> int | None:
        if self._nvml is None:
            return None
        memory = _NvmlMemory()
        if self._nvml.nvmlDeviceGetMemoryInfo(self._handle, ctypes.byref(memory)) != 0:
            return None
        return int(memory.free)

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml = None


# -- server ----------------------------------------------------------------------


class VmmBackend:
    """Creates and exports device memory; never maps it, never needs a context.

    Called from one lane thread only (``gms.server.tiers.lanes``); it keeps no table:
    the server's loop does."""

    name = "cuda"
    loop_bytes = 0
    host = False

    def __init__(self, device: int = 0) -> None:
        self.device = device
        self._dev = _device(device)
        self._prop = _allocation_prop(device, self.host)
        self.granularity = granularity(device, self.host)
        self.uuid = device_uuid(device)
        raw_name = _check("cuDeviceGetName", cu.cuDeviceGetName(256, self._dev))
        self.device_name = raw_name.split(b"\0", 1)[0].decode(errors="replace")
        self.total_bytes = int(_check("cuDeviceTotalMem", cu.cuDeviceTotalMem(self._dev)))
        self._nvml: _Nvml | None = None  # made on the lane, at the first status probe

    def create(self, aligned_size: int, label: str = "") -> Held:
        handle = _check("cuMemCreate", cu.cuMemCreate(aligned_size, self._prop, 0))
        try:
            fd = _check(
                "cuMemExportToShareableHandle", cu.cuMemExportToShareableHandle(handle, _POSIX_FD, 0)
            )
        except BaseException:
            cu.cuMemRelease(handle)
            raise
        return Held(handle, int(fd), aligned_size)

    def adopt(self, fd: int, aligned_size: int) -> Held:
        """Import the fd (no context needed, like cuMemCreate) and check what the
        driver says it is: memory of this tier's kind on this device.  An fd
        whose memory a GPU reset took no longer imports, or no longer says so:
        MemoryLost.  The driver cannot tell an allocation's size from its
        handle; the state's size is trusted (a client maps no more).

        Not checked: the handle types the allocation was made exportable as.
        An importer's properties need not repeat the exporter's, and nothing
        is exported from this handle: exports dup the fd kept.  A driver that
        cannot import here at all (no context, not initialised) is no verdict
        on the memory: a BackendError, which stops the server with every fd
        still kept, rather than every layout dropped."""
        err, handle = cu.cuMemImportFromShareableHandle(fd, _POSIX_FD)
        if err in _CANNOT_CHECK:
            raise CudaError("cuMemImportFromShareableHandle (adopting kept memory)", err)
        if err != _SUCCESS:
            raise MemoryLost(f"cuMemImportFromShareableHandle: {CudaError('import', err)}")
        try:
            err, prop = cu.cuMemGetAllocationPropertiesFromHandle(handle)
            if err != _SUCCESS:
                raise MemoryLost(f"cuMemGetAllocationPropertiesFromHandle: {CudaError('properties', err)}")
            expected = self._prop
            if (
                prop.type != expected.type
                or prop.location.type != expected.location.type
                or int(prop.location.id) != int(expected.location.id)
            ):
                raise MemoryLost(
                    f"the fd is memory of another kind or place (type {prop.type}, location "
                    f"{prop.location.type} {prop.location.id}; this tier makes {expected.type}, "
                    f"{expected.location.type} {expected.location.id})"
                )
        except BaseException:
            cu.cuMemRelease(handle)
            raise
        return Held(handle, fd, aligned_size)

    def release(self, held: Held) -> None:
        os.close(held.fd)
        _check("cuMemRelease", cu.cuMemRelease(held.handle))

    def device_info(self) -> DeviceInfo:
        if self._nvml is None:
            self._nvml = _Nvml(self.uuid)
        return DeviceInfo(
            backend=self.name,
            device=self.device,
            name=self.device_name,
            uuid=self.uuid,
            total_bytes=self.total_bytes,
            free_bytes=self._nvml.free_bytes(),
        )

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.close()


class VmmHostTier(VmmBackend):
    """Pinned host memory on the GPU's NUMA node, made and exported like device memory
    (pinning host pages costs about 0.24 s per GiB: why each tier has its own lane)."""

    name = "cuda-host"
    host = True

    def device_info(self) -> DeviceInfo:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return DeviceInfo(self.name, self.device, "pinned host memory (cuMemCreate)", self.uuid, total, free)


# -- client ------------------------------------------------------------------------


def fatal(message: str) -> None:
    """The seed's rule for the client: a non-OOM CUDA VMM failure ends the process."""
    sys.stderr.write(f"gms: FATAL CUDA failure in the client: {message}\n")
    sys.stderr.flush()
    os._exit(EXIT_CUDA_FAILURE)


class VmmMapper:
    """Maps exported device memory into this process's CUDA address space."""

    name = "cuda"

    def __init__(self, device: int = 0) -> None:
        self.device = device
        try:
            self._dev = _device(device)
            self._ctx = _check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(self._dev))
            self.granularity = granularity(device)
            self.device_uuid = device_uuid(device)
        except CudaError as exc:
            fatal(str(exc))
        self._current = threading.local()
        self._stream = None  # for copies; made on first use
        self._access = {}
        for writable, flags in (
            (True, cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE),
            (False, cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ),
        ):
            desc = cu.CUmemAccessDesc()
            desc.location = _location(device, host=False)
            desc.flags = flags
            self._access[writable] = [desc]

    def _run(self, call: str, out):
        try:
            return _check(call, out)
        except CudaError as exc:
            fatal(str(exc))

    def _make_current(self) -> None:
        # The primary context, current in whichever thread calls us.
        if getattr(self._current, "ok", False):
            return
        self._run("cuCtxSetCurrent", cu.cuCtxSetCurrent(self._ctx))
        self._current.ok = True

    def reserve(self, size: int) -> int:
        self._make_current()
        return int(self._run("cuMemAddressReserve", cu.cuMemAddressReserve(size, self.granularity, 0, 0)))

    def map(self, fd: int, va: int, size: int, writable: bool) -> object:
        return self.map_many([(fd, va, size)], writable)[0]

    def map_many(self, items, writable: bool) -> list[object]:
        """Import and map each; then one cuMemSetAccess per contiguous run of
        mappings (set-access is the dearest call, and may span mappings)."""
        self._make_current()
        handles = []
        try:
            for fd, va, size in items:
                try:
                    handle = self._run(
                        "cuMemImportFromShareableHandle", cu.cuMemImportFromShareableHandle(fd, _POSIX_FD)
                    )
                finally:
                    os.close(fd)  # the imported handle holds its own reference
                self._run("cuMemMap", cu.cuMemMap(va, size, 0, handle, 0))
                handles.append(handle)
        finally:
            for fd, _, _ in items[len(handles) + 1 :]:
                os.close(fd)
        access = self._access[writable]
        for start, length in contiguous_runs([(va, size) for _, va, size in items]):
            self._run("cuMemSetAccess", cu.cuMemSetAccess(start, length, access, 1))
        return handles

    def map_host(self, fd: int, va: int, size: int) -> object:
        self._make_current()
        try:
            handle = self._run("cuMemImportFromShareableHandle", cu.cuMemImportFromShareableHandle(fd, _POSIX_FD))
        finally:
            os.close(fd)
        self._run("cuMemMap", cu.cuMemMap(va, size, 0, handle, 0))
        # Device access only: copies to and from it run on the GPU's copy
        # engines; CPU access would double the page-table work of a restore.
        self._run("cuMemSetAccess", cu.cuMemSetAccess(va, size, self._access[True], 1))
        return handle

    def unmap(self, va: int, size: int, handle: object) -> None:
        self.unmap_many([(va, size, handle)])

    def unmap_many(self, items) -> None:
        self._make_current()
        for start, length in contiguous_runs([(va, size) for va, size, _ in items]):
            self._run("cuMemUnmap", cu.cuMemUnmap(start, length))
        for _, _, handle in items:
            self._run("cuMemRelease", cu.cuMemRelease(handle))

    def free(self, va: int, size: int) -> None:
        self._make_current()
        self._run("cuMemAddressFree", cu.cuMemAddressFree(va, size))

    def synchronize(self) -> None:
        self._make_current()
        self._run("cuCtxSynchronize", cu.cuCtxSynchronize())

    def _copy_stream(self):
        self._make_current()
        if self._stream is None:
            flags = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
            self._stream = self._run("cuStreamCreate", cu.cuStreamCreate(flags))
        return self._stream

    def copy(self, dst: int, src: int, size: int) -> None:
        self._run("cuMemcpyAsync", cu.cuMemcpyAsync(dst, src, size, self._copy_stream()))

    def write(self, va: int, data: bytes) -> None:
        """The bytes are at ``va`` when this returns, as with the host backend's
        ``memmove``.  A plain ``cuMemcpyHtoD`` from pageable memory returns once
        the bytes are staged, before they land: a caller that unmaps next had
        the GPU write to an unmapped address (an MMU fault, Xid 31, which ends
        the process's context).  Its own stream, so no other work is waited for."""
        stream = self._copy_stream()
        self._run("cuMemcpyHtoDAsync", cu.cuMemcpyHtoDAsync(va, data, len(data), stream))
        self._run("cuStreamSynchronize", cu.cuStreamSynchronize(stream))

    def read(self, va: int, size: int) -> bytes:
        self._make_current()
        buffer = bytearray(size)
        self._run("cuMemcpyDtoH", cu.cuMemcpyDtoH(buffer, va, size))
        return bytes(buffer)
