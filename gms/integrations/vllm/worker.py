"""``GMSWorker``: vLLM's GPU worker with its memory in gms.

    --load-format gms --worker-cls gms.integrations.vllm.worker.GMSWorker

A subclass, not a ``--worker-extension-cls``: vLLM appends an extension to
the worker's bases, so it can add methods but never override one, and this
worker must change three things vLLM's own worker decides:

* **init_device**: after vLLM's own, take the gms locks (the weights' may
  wait for another engine's writer to commit), then take vLLM's memory
  snapshot again.  vLLM sizes the KV cache from the free memory it sees at
  that snapshot; committed weights it will map rather than allocate must
  already be counted there as used, and a writer still loading on the same
  GPU must be done, or it would count that writer's growth as its own.
* **_maybe_get_memory_pool_context**: vLLM's CuMem/MemPool hook, the one
  place it routes the weights' and the KV cache's allocations to a pool.
  The KV cache goes to a ``MemPool`` over gms (its own RW layout); the
  weights to none, since the gms loader places them itself (RW: allocated
  in gms; RO: mapped from gms).
* the sleep-mode backend: ``gms`` (``sleep.py``), chosen here because
  vLLM 0.26 registers backends by name (``SleepModeBackendFactory``) but has
  no command-line flag that selects one.

The pools live as long as the process, so ``torch.cuda.empty_cache()``
never hands gms memory back: torch releases cached blocks only from the
default pool and from pools nobody holds any more.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os

import torch
import vllm
from vllm.distributed import (
    get_pp_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from vllm.utils.mem_utils import MemorySnapshot
from vllm.v1.worker.gpu_worker import Worker
from vllm.v1.worker.utils import request_memory

from ... import torch as gms_torch
from ...system.paths import socket_path
from ..common import config as gms_config
from ..common import names, weights
from ..common.errors import MissingWorkerError
from ..common.memory import KV_CACHE, EngineMemory, install
from ..common.parent import exit_with_parent
from .loader import ENGINE, LOAD_FORMAT
from .sleep import NAME as SLEEP_BACKEND

log = logging.getLogger("vllm.gms")  # see LOGGER in __init__.py


class GMSWorker(Worker):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        load = self.vllm_config.load_config
        if load.load_format != LOAD_FORMAT:
            raise MissingWorkerError(f"GMSWorker serves --load-format {LOAD_FORMAT}, not {load.load_format!r}")
        self.gms_config, _ = gms_config.parse(load.model_loader_extra_config)
        self.gms_memory: EngineMemory | None = None
        if self.gms_config.exit_with_parent:
            exit_with_parent()
        self.vllm_config.model_config.sleep_mode_backend = SLEEP_BACKEND

    def init_device(self) -> None:
        super().init_device()
        identity = model_identity(self.vllm_config)
        device = self.device.index
        socket = self.gms_config.socket_for(device) or socket_path(device)
        memory = EngineMemory.open(
            self.gms_config, socket, device,
            names.weights_layout(identity, self.gms_config.layout),
            {KV_CACHE: names.scratch_layout(identity, KV_CACHE, os.getpid(), self.gms_config.kv_layout)},
            identity,
        )
        memory.connect()
        install(memory)
        self.gms_memory = memory
        # vLLM's snapshot was taken before the lock: take it again (as vLLM does).
        gc.collect()
        torch.accelerator.empty_cache()
        self.init_snapshot = MemorySnapshot(device=self.device)
        self.requested_memory = request_memory(self.init_snapshot, self.cache_config)

    def _maybe_get_memory_pool_context(self, tag: str) -> contextlib.AbstractContextManager:
        if tag == KV_CACHE:
            return _kv_pool(self.gms_memory)
        return contextlib.nullcontext()  # the weights: the gms loader places them itself

    def gms_state(self) -> dict:
        """For ``collective_rpc("gms_state")``: the layouts, locks, bytes and timings."""
        m = self.gms_memory
        if m is None:
            return {}
        return {
            "pid": os.getpid(), "socket": m.socket, "device": m.device,
            "weights": {"layout": m.weights.layout, "lock": getattr(m.weights.granted_lock_type, "value", None),
                        "bytes": m.weights.total_bytes, "mapped": any(mp.mapped for mp in m.weights.mappings)},
            "kv_cache": {"layout": m.kv.layout, "lock": getattr(m.kv.granted_lock_type, "value", None),
                         "bytes": m.kv.total_bytes, "mapped": any(mp.mapped for mp in m.kv.mappings)},
            "asleep": sorted(m.asleep), "timings": dict(m.timings),
        }


@contextlib.contextmanager
def _kv_pool(memory: EngineMemory):
    with gms_torch.without_expandable_segments(), gms_torch.use_memory(memory.kv, tag=KV_CACHE) as pool:
        yield pool


def model_identity(vllm_config) -> names.ModelIdentity:
    """This rank's identity; call after vLLM has set up its parallel groups."""
    m = vllm_config.model_config
    return weights.identity(ENGINE, vllm.__version__, m.model, m.revision, m.dtype, m.architecture,
                            (get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()),
                            get_pp_group())
