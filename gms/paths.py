"""Where a server listens by default: one socket per device.

``<dir>/gms_<device-id>.sock`` where ``<dir>`` is ``$GMS_SOCKET_DIR``
or the system temp folder, and ``<device-id>`` is the GPU's UUID for the CUDA
backend (stable when ``CUDA_VISIBLE_DEVICES`` renumbers devices) or
``host-<N>`` for the host backend.  Where that path would not fit in a Unix
socket address (a deep ``$GMS_SOCKET_DIR``), a digest of the device id
replaces it: servers and clients derive the same name either way.
"""

from __future__ import annotations

import hashlib
import os
import tempfile

MAX_SOCKET_PATH_BYTES = 107  # sun_path is 108 bytes, with the terminating NUL


def socket_dir() -> str:
    return os.environ.get("GMS_SOCKET_DIR") or tempfile.gettempdir()


def device_id(device: int, backend: str = "auto") -> str:
    """The GPU UUID when the CUDA backend serves ``device``, else ``host-<device>``."""
    from .cuda import resolve_backend

    if resolve_backend(backend, device) == "cuda":
        from .cuda.vmm import device_uuid

        return device_uuid(device)
    return f"host-{device}"


def socket_path(device: int = 0, backend: str = "auto") -> str:
    """The socket of the server for ``device``; every layout on it is reached here."""
    return socket_path_in(socket_dir(), device_id(device, backend))


def socket_path_in(directory: str, device_id: str) -> str:
    """The socket for a device in ``directory``; raises ``ValueError``
    when even the short form is too long for a Unix socket."""
    path = os.path.join(directory, f"gms_{device_id}.sock")
    if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
        digest = hashlib.sha256(device_id.encode()).hexdigest()[:12]
        path = os.path.join(directory, f"gms_{digest}.sock")
    if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
        raise ValueError(
            f"socket path {path!r} is longer than the {MAX_SOCKET_PATH_BYTES} bytes a Unix socket "
            "address holds: set GMS_SOCKET_DIR to a shorter folder"
        )
    return path
