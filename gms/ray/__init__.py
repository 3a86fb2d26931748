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
from .units import UNIT_SCALING, Rounded, parse_gpu_memory, round_to_gpu

__all__ = [
    "RESOURCE_PREFIX",
    "UNIT_SCALING",
    "GPUMemoryRequestError",
    "NoGPUFitsError",
    "NodeGPU",
    "NodeResourcesError",
    "Rounded",
    "WorkerBindingError",
    "node_gpus",
    "node_resources",
    "parse_gpu_memory",
    "resource_name",
    "round_to_gpu",
]
