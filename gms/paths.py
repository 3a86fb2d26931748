"""Where a server listens by default: one socket per (device, tag).

``<dir>/gms_<device-id>_<tag>.sock`` where ``<dir>`` is ``$GMS_SOCKET_DIR``
or the system temp folder, and ``<device-id>`` is the GPU's UUID for the CUDA
backend (stable when ``CUDA_VISIBLE_DEVICES`` renumbers devices) or
``host-<N>`` for the host backend.
"""

from __future__ import annotations

import os
import tempfile

DEFAULT_TAGS = ("weights", "kv_cache")


def socket_dir() -> str:
    return os.environ.get("GMS_SOCKET_DIR") or tempfile.gettempdir()


def device_id(device: int, backend: str = "auto") -> str:
    """The GPU UUID when the CUDA backend serves ``device``, else ``host-<device>``."""
    from .cuda import resolve_backend

    if resolve_backend(backend, device) == "cuda":
        from .cuda.vmm import device_uuid

        return device_uuid(device)
    return f"host-{device}"


def socket_path(device: int = 0, tag: str = "weights", backend: str = "auto") -> str:
    return os.path.join(socket_dir(), f"gms_{device_id(device, backend)}_{tag}.sock")
