"""The node side: what this node's GPUs lend, as Ray resources.

Reads each GPU's gms server (a probe: no lock taken) and returns the
resources to start the node's raylet with::

    ray start --address=HEAD:6379 --resources="$(gms ray-resources)"
    ray.init(resources=gms.ray.node_resources())      # a single-node cluster

Ray is not imported here: ``gms ray-resources`` runs before ``ray start``.
"""

from __future__ import annotations

import attrs

from ..errors import GMSError
from ..system import paths
from . import _core
from .errors import NodeResourcesError
from .names import host_gpu, resource_name
from .units import EXACT_BYTES, format_size


@attrs.frozen
class NodeGPU:
    gpu: str  # the GPU's name in the cluster (names.py)
    device: int  # its ordinal on this node
    backend: str
    socket_path: str
    capacity_bytes: int  # what gms lends on it: the GPU budget

    @property
    def resource(self) -> str:
        return resource_name(self.gpu)


def local_devices(backend: str = "auto") -> list[int]:
    """Every CUDA device this process sees; device 0 where the host backend serves."""
    from ..cuda import cuda_device_count, resolve_backend

    if resolve_backend(backend, 0) == "cuda":
        return list(range(cuda_device_count()))
    return [0]


def node_gpus(devices: list[int] | None = None, backend: str = "auto") -> list[NodeGPU]:
    """This node's GPUs as their gms servers report them (``$GMS_SOCKET_DIR``)."""
    from ..cuda import resolve_backend

    gpus = []
    for device in local_devices(backend) if devices is None else devices:
        kind = resolve_backend(backend, device)
        try:
            path = _core.server_socket(device, kind)
            state = _core.read_state(path)
        except (GMSError, ValueError) as exc:
            raise NodeResourcesError(
                f"device {device}: no gms server answers ({exc}); start one with "
                f"`gms serve --device {device}` (GMS_SOCKET_DIR={paths.socket_dir()})"
            ) from exc
        capacity = _core.budget_bytes(state)
        if not capacity:
            raise NodeResourcesError(f"device {device}: its gms server reports no capacity")
        if capacity > EXACT_BYTES:
            # Ray would round it; no GPU is this large, so say so rather than guess.
            raise NodeResourcesError(
                f"device {device}: {format_size(capacity)} is past the {format_size(EXACT_BYTES)} "
                "that Ray's fixed-point resources hold to the byte; set a smaller --gpu-budget"
            )
        if kind == "cuda":
            gpu = state.device_uuid
        else:
            gpu = host_gpu(device, paths.socket_dir())
        gpus.append(NodeGPU(gpu, device, kind, path, capacity))
    if not gpus:
        raise NodeResourcesError("no GPU to advertise on this node")
    return gpus


def node_resources(devices: list[int] | None = None, backend: str = "auto") -> dict[str, int]:
    """``{"gms_gpu_memory_<gpu>": bytes, ...}`` for ``ray start --resources`` or
    ``ray.init(resources=...)``: one resource per GPU, its gms budget in bytes."""
    return {gpu.resource: gpu.capacity_bytes for gpu in node_gpus(devices, backend)}
