"""Adapters that apply memory side effects: CUDA VMM, or host memory stand-ins."""

from __future__ import annotations

import functools
import importlib.util
import os

from .interface import (
    BackendError,
    DeviceInfo,
    Held,
    Mapper,
    MemoryBackend,
    MemoryLost,
    NoFileDescriptors,
    OutOfMemory,
    align_up,
)

BACKENDS = ("auto", "cuda", "host")


@functools.cache
def cuda_device_count() -> int:
    """Devices the CUDA driver sees (0 without cuda-bindings, driver or GPU)."""
    try:
        from cuda.bindings import driver

        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return 0
        err, count = driver.cuDeviceGetCount()
    except Exception:  # no bindings, or bindings without a driver library
        return 0
    return count if err == driver.CUresult.CUDA_SUCCESS else 0


def resolve_backend(backend: str, device: int) -> str:
    """``auto`` is ``$GMS_BACKEND`` if set, else CUDA when the device exists,
    host otherwise.  The variable lets a host-backend service and its clients
    agree on a machine that has a GPU."""
    if backend == "auto":
        backend = os.environ.get("GMS_BACKEND") or "auto"
        if backend == "auto":
            return "cuda" if device < cuda_device_count() else "host"
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    return backend


def open_backend(backend: str, device: int, host_capacity: int | None = None) -> MemoryBackend:
    kind = resolve_backend(backend, device)
    if kind == "cuda":
        from .vmm import VmmBackend

        return VmmBackend(device)
    from .host import HostBackend

    return HostBackend(device, capacity=host_capacity)


def open_host_tier(backend: str, device: int) -> MemoryBackend:
    """Where the server keeps host copies of evictable layouts: pinned host memory
    made through the driver on CUDA, memfd on the host backend."""
    kind = resolve_backend(backend, device)
    if kind == "cuda":
        from .vmm import VmmHostTier

        return VmmHostTier(device)
    from .host import HostBackend

    return HostBackend(device)


def preload_mapper() -> None:
    """Import the CUDA mapper where it may be needed (cuda-bindings installed, and
    ``GMS_BACKEND`` not ``host``), so its one-time cost is paid by whoever calls
    this, not by the first connect.  Import only: no CUDA call, no context, so a
    process may still fork after it."""
    if os.environ.get("GMS_BACKEND") == "host" or importlib.util.find_spec("cuda") is None:
        return
    try:
        from . import vmm  # noqa: F401
    except ImportError:  # bindings without a driver library: the host mapper will do
        pass


def open_mapper(backend: str, device: int) -> Mapper:
    if backend == "cuda":
        from .vmm import VmmMapper

        return VmmMapper(device)
    if backend == "host":
        from .host import HostMapper

        return HostMapper(device)
    raise ValueError(f"no mapper for backend {backend!r}")


__all__ = [
    "BACKENDS",
    "BackendError",
    "DeviceInfo",
    "Held",
    "Mapper",
    "MemoryBackend",
    "MemoryLost",
    "NoFileDescriptors",
    "OutOfMemory",
    "align_up",
    "cuda_device_count",
    "open_backend",
    "open_host_tier",
    "open_mapper",
    "preload_mapper",
    "resolve_backend",
]
