"""Names of GPUs and of their Ray resources.

Each GPU a gms server lends is one Ray resource, ``gms_gpu_memory_<gpu>``,
whose quantity is bytes.  ``<gpu>`` must be unique in the cluster, because
Ray adds up same-named resources and would otherwise hide which GPU has room:

- CUDA: the GPU's UUID (``GPU-2d2eca4f-...``), as ``nvidia-smi -L`` prints it;
- host backend: ``host-<N>-<digest>``, the digest of the host name and the
  socket folder, since every host-backend server calls its device ``host-N``.

The worker that lands on a GPU finds the GPU's server from that name alone.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket

import attrs

RESOURCE_PREFIX = "gms_gpu_memory_"
_HOST_KEY = re.compile(r"host-(\d+)-([0-9a-f]{8})")


def resource_name(gpu: str) -> str:
    return RESOURCE_PREFIX + gpu


def gpu_of(resource: str) -> str | None:
    """The GPU a Ray resource name stands for; None for any other resource."""
    if resource.startswith(RESOURCE_PREFIX) and len(resource) > len(RESOURCE_PREFIX):
        return resource[len(RESOURCE_PREFIX):]
    return None


def host_gpu(device: int, socket_dir: str, hostname: str | None = None) -> str:
    """The name of host-backend ``device`` whose server listens in ``socket_dir``."""
    where = f"{hostname or socket.gethostname()}\0{os.path.realpath(socket_dir)}"
    return f"host-{device}-{hashlib.sha256(where.encode()).hexdigest()[:8]}"


@attrs.frozen
class GPUName:
    """What a GPU name says: which backend, and which device (host) or UUID (CUDA)."""

    backend: str
    device: int | None = None
    uuid: str | None = None
    digest: str | None = None


def parse_gpu(gpu: str) -> GPUName:
    match = _HOST_KEY.fullmatch(gpu)
    if match:
        return GPUName("host", device=int(match.group(1)), digest=match.group(2))
    return GPUName("cuda", uuid=gpu)
