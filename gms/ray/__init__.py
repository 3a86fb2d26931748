"""``gms.ray``: schedule Ray tasks and actors by bytes of GPU memory, held to them by gms.

``pip install 'gms[ray]'``.  Docs: docs/ray.md.

Node (before ``ray start``)::

    ray start --address=HEAD:6379 --resources="$(gms ray-resources)"

Driver::

    @gms.ray.remote(gpu_memory="20GB")
    class Worker:
        def __init__(self):
            self.memory = gms.ray.connect()      # limit_bytes = the scheduled bytes

Importing this package does not import Ray (the node side runs without it).
"""

from .errors import GPUMemoryRequestError, NodeResourcesError, NoGPUFitsError, WorkerBindingError
from .names import RESOURCE_PREFIX, resource_name
from .node import NodeGPU, node_gpus, node_resources
from .placement import GPUMemoryRemote, GPUView, Placement, gpus, options, place, remote
from .units import UNIT_SCALING, Rounded, parse_gpu_memory, round_to_gpu
from .worker import LocalGPU, Scheduled, connect, default_layout, locate, scheduled

__all__ = [
    "RESOURCE_PREFIX",
    "UNIT_SCALING",
    "GPUMemoryRemote",
    "GPUMemoryRequestError",
    "GPUView",
    "LocalGPU",
    "NoGPUFitsError",
    "NodeGPU",
    "NodeResourcesError",
    "Placement",
    "Rounded",
    "Scheduled",
    "WorkerBindingError",
    "connect",
    "default_layout",
    "gpus",
    "locate",
    "node_gpus",
    "node_resources",
    "options",
    "parse_gpu_memory",
    "place",
    "remote",
    "resource_name",
    "round_to_gpu",
    "scheduled",
]
