"""``--load-format gms``: vLLM's model loader over a gms weights layout.

Registered with vLLM's own ``register_model_loader("gms")`` (``register``
in ``__init__.py``).  The worker (``GMSWorker``) has already taken the
weights lock when vLLM calls ``load_model``:

* **RW** (the first engine on this GPU for this model and rank): vLLM's
  default loader runs unchanged, reading the checkpoint from disk
  (``gms_load_format``, default ``auto``), but every tensor it makes lands
  in gms memory (``gms.torch.use_memory``: a ``CUDAPluggableAllocator`` in a
  ``MemPool`` of its own).  Then each parameter and buffer, fused and sharded
  as vLLM keeps them and after ``process_weights_after_loading``, is
  described (no copies), the model's identity is added, and the layout is
  committed.  The engine then reads its own weights as a reader (read-only
  mappings at the same addresses); its buffers get private copies, because
  vLLM writes some of them (attention scales).
* **RO** (every later engine): the model is built with its parameters on
  ``meta`` (no memory, no init) and its buffers computed as usual, then every
  parameter is pointed at the published tensor (one metadata scan, batched
  imports) and buffers are copied.  ``process_weights_after_loading`` runs
  as it would after a disk load: for an unquantized model it only resets the
  (private) attention scales.  Nothing is read from disk.

Quantized checkpoints are refused: their weights are repacked after loading
in ways a reader would have to repeat on read-only memory.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn
from vllm.config import ModelConfig, VllmConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
from vllm.utils.torch_utils import set_default_torch_dtype

from ... import torch as gms_torch
from ..common import config as gms_config
from ..common import weights
from ..common.errors import UnsupportedModelError
from ..common.memory import WEIGHTS, EngineMemory
from ..common.names import tensor_prefix
from .memory import current

log = logging.getLogger("vllm.gms")  # see LOGGER in __init__.py
LOAD_FORMAT = "gms"
ENGINE = "vllm"  # the layout names' and metadata keys' first part (names.py)


class GMSModelLoader(BaseModelLoader):
    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        self.gms, self.disk_config = gms_config.for_disk(load_config)  # disk: vLLM's default loader

    def download_model(self, model_config: ModelConfig) -> None:
        DefaultModelLoader(self.disk_config).download_model(model_config)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        # vLLM calls this to load new weights into a live model (RL weight
        # updates, level-2 wake): the published weights are shared and read-only.
        raise UnsupportedModelError("weights in gms are shared and read-only: they cannot be reloaded in place; "
                                    "publish a new layout (restart the engines) instead")

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        memory = current()
        _check_supported(vllm_config, model_config, self.load_config)
        started = time.perf_counter()
        if memory.writer:
            model = self._load_and_publish(memory, vllm_config, model_config, prefix)
            how = "loaded from disk and published"
        else:
            model = self._import(memory, vllm_config, model_config, prefix)
            how = "imported"
        memory.timings["load_s"] = time.perf_counter() - started
        log.info("gms: weights %s (layout %r, %.2f GiB) in %.3f s", how, memory.weights.layout,
                 memory.weights.total_bytes / (1 << 30), memory.timings["load_s"])
        return model.eval()

    # -- RW: the first engine --------------------------------------------------------

    def _load_and_publish(self, memory: EngineMemory, vllm_config: VllmConfig, model_config: ModelConfig,
                          prefix: str) -> nn.Module:
        mgr = memory.weights
        started = time.perf_counter()
        with gms_torch.without_expandable_segments(), gms_torch.use_memory(mgr, tag=WEIGHTS):
            model = DefaultModelLoader(self.disk_config).load_model(
                vllm_config=vllm_config, model_config=model_config, prefix=prefix)
        loaded = time.perf_counter()
        memory.timings["disk_load_s"] = loaded - started
        weights.publish(memory, model, ENGINE, self.gms.residency, self.gms.lock_timeout_ms, loaded)
        return model

    # -- RO: every later engine ----------------------------------------------------------

    def _import(self, memory: EngineMemory, vllm_config: VllmConfig, model_config: ModelConfig,
                prefix: str) -> nn.Module:
        mgr = memory.weights
        weights.check_published(memory, ENGINE)
        target = torch.device(self.load_config.device or vllm_config.device_config.device)
        with set_default_torch_dtype(model_config.dtype), target, gms_torch.empty_parameters():
            model = initialize_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
        gms_torch.materialize_module(model, mgr, prefix=tensor_prefix(ENGINE))
        process_weights_after_loading(model, model_config, target)
        return model


def _check_supported(vllm_config: VllmConfig, model_config: ModelConfig, load_config: LoadConfig) -> None:
    if model_config is not vllm_config.model_config:
        raise UnsupportedModelError("--load-format gms loads the engine's own model only "
                                    "(a speculative decoding draft model is not supported)")
    if model_config.quantization is not None:
        raise UnsupportedModelError(f"quantized weights ({model_config.quantization}) are repacked after "
                                    "loading; --load-format gms supports unquantized models only")
    if load_config.device not in (None, "cuda") and not str(load_config.device).startswith("cuda"):
        raise UnsupportedModelError(f"--load-format gms loads onto the GPU, not {load_config.device!r}")

