"""PyTorch integration (``pip install gms[torch]``).

* ``use_memory(mgr, tag)``: tensors created inside live in gms memory (CUDA);
  ``memory_pool`` and ``routed`` the same for a CUDA graph's private pool.
* ``publish_module`` / ``publish_tensors``: describe a model's tensors (RW).
* ``materialize_module`` / ``import_tensors``: zero-copy tensors in a reader.
* ``load_safetensors``: a checkpoint straight from disk into gms (RW).
* ``sleep`` / ``wake_weights`` / ``wake_kv_cache``: the shadow-engine pattern;
  ``rebuild_kv_cache`` after the KV cache's server went away.

On the host backend the same calls yield CPU tensors.
"""

from .allocator import (
    build_shim,
    memory_pool,
    pluggable_allocator,
    routed,
    use_memory,
    without_expandable_segments,
)
from .encoding import TensorMeta, TensorMetaError, decode, encode
from .loader import CheckpointError, load_safetensors, read_header
from .modules import (
    empty_parameters,
    import_tensors,
    materialize_module,
    module_tensors,
    publish_module,
    publish_tensors,
)
from .packing import plan_packs
from .sleep import rebuild_kv_cache, sleep, wake_kv_cache, wake_weights

__all__ = [
    "CheckpointError",
    "TensorMeta",
    "TensorMetaError",
    "build_shim",
    "decode",
    "empty_parameters",
    "encode",
    "import_tensors",
    "load_safetensors",
    "materialize_module",
    "memory_pool",
    "module_tensors",
    "plan_packs",
    "pluggable_allocator",
    "publish_module",
    "publish_tensors",
    "read_header",
    "rebuild_kv_cache",
    "routed",
    "sleep",
    "use_memory",
    "wake_kv_cache",
    "wake_weights",
    "without_expandable_segments",
]
