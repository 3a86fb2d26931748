"""What gms reads from SGLang where its API generations differ: one adapter each.

Up to 0.5.17 a scheduler is told its GPU (``Scheduler(server_args, port_args,
gpu_id, ...)``) and a rank's parallel place is read from the getters of
``sglang.srt.distributed``; 0.5.23 keeps both in the process's runtime context
(``sglang.srt.runtime_context``: ``get_device()``, ``get_parallel()``), no longer
exports those getters from ``sglang.srt.distributed`` and warns on each call.
Nothing from SGLang is imported at module level: the functions run in SGLang's
processes, after it set them up.
"""

from __future__ import annotations


def context_gpu() -> int:
    """The GPU of this scheduler process, from the runtime context (0.5.23)."""
    from sglang.srt.runtime_context import get_device

    return get_device().gpu_id


def parallel_place() -> tuple[tuple[int, int], object]:
    """This rank's (tensor-parallel rank, size) and its pipeline group (its
    ``rank_in_group`` and ``world_size``): from the runtime context where SGLang has
    one (0.5.17 on), else from the getters of the releases before it."""
    try:
        from sglang.srt.runtime_context import get_parallel
    except ImportError:
        from sglang.srt.distributed.parallel_state import (
            get_pp_group,
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        return (get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()), get_pp_group()
    parallel = get_parallel()
    return (parallel.tp_rank, parallel.tp_size), parallel.pp_group
