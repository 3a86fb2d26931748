"""``--load-format gms``: SGLang's model loader over a gms weights layout.

SGLang builds a loader from a class named as the load format
(``get_model_loader``: ``isinstance(load_config.load_format, type)``); the
hook on ``LoadConfig`` (``hooks.py``) puts this class there for ``gms``.

* **RW** (the first engine on this GPU for this model and rank): SGLang's
  own loader for the format read from disk (``gms_load_format``, default
  ``auto``) runs unchanged, but every tensor it makes lands in gms memory
  (``gms.torch.use_memory``).  Then each parameter and buffer, as SGLang
  keeps them after loading (fused, sharded, post-processed), is described
  (no copies), the model's identity is added, and the layout is committed.
  The engine then reads its own weights as a reader; its buffers get
  private copies.
* **RO** (every later engine): the model is built with its parameters on
  ``meta`` (no memory, no init), then every parameter is pointed at the
  published tensor (one metadata scan, batched imports); buffers are copied.
  Nothing is read from disk.  ``post_load_weights`` runs where the model has
  one, as SGLang's own loaders that bypass ``load_weights`` do.

Quantized checkpoints are refused: their weights are repacked after loading
in ways a reader would have to repeat on read-only memory.
"""

from __future__ import annotations

import logging
import time

import sglang
import torch
from sglang.srt.configs.device_config import DeviceConfig
from sglang.srt.configs.load_config import LoadConfig
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_loader import loader as sglang_loader
from sglang.srt.model_loader.utils import set_default_torch_dtype
from torch import nn

from ... import torch as gms_torch
from ..common import config as gms_config
from ..common import names, weights
from ..common.errors import MissingWorkerError, UnsupportedModelError
from ..common.memory import WEIGHTS, EngineMemory, install, installed
from . import generations
from .process import LOAD_FORMAT, active

log = logging.getLogger("sglang.gms")  # see LOGGER in __init__.py
ENGINE = "sglang"  # the layout names' and metadata keys' first part (names.py)


class GMSModelLoader(sglang_loader.BaseModelLoader):
    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        self.gms, self.disk_config = gms_config.for_disk(load_config)  # disk: SGLang's loader for the format

    def download_model(self, model_config: ModelConfig) -> None:
        sglang_loader.get_model_loader(self.disk_config, model_config).download_model(model_config)

    def load_model(self, *, model_config: ModelConfig, device_config: DeviceConfig) -> nn.Module:
        _check_supported(model_config, device_config)
        memory = _engine_memory(self.gms, model_config, device_config)
        memory.connect_weights()
        started = time.perf_counter()
        if memory.writer:
            model = self._load_and_publish(memory, model_config, device_config)
            how = "loaded from disk and published"
        else:
            model = self._import(memory, model_config, device_config)
            how = "imported"
        memory.timings["load_s"] = time.perf_counter() - started
        log.info("gms: weights %s (layout %r, %.2f GiB) in %.3f s", how, memory.weights.layout,
                 memory.weights.total_bytes / (1 << 30), memory.timings["load_s"])
        return model.eval()

    # -- RW: the first engine --------------------------------------------------------

    def _load_and_publish(self, memory: EngineMemory, model_config: ModelConfig,
                          device_config: DeviceConfig) -> nn.Module:
        mgr = memory.weights
        started = time.perf_counter()
        with gms_torch.without_expandable_segments(), gms_torch.use_memory(mgr, tag=WEIGHTS):
            disk = sglang_loader.get_model_loader(self.disk_config, model_config)
            model = disk.load_model(model_config=model_config, device_config=device_config)
        loaded = time.perf_counter()
        memory.timings["disk_load_s"] = loaded - started
        weights.publish(memory, model, ENGINE, self.gms.residency, self.gms.lock_timeout_ms, loaded)
        return model

    # -- RO: every later engine ----------------------------------------------------------

    def _import(self, memory: EngineMemory, model_config: ModelConfig, device_config: DeviceConfig) -> nn.Module:
        weights.check_published(memory, ENGINE)
        target = torch.device(device_config.device)
        with set_default_torch_dtype(model_config.dtype), target, gms_torch.empty_parameters():
            # SGLang's own model construction (a private function: the one place this
            # integration reaches past SGLang's public loader API).
            model = sglang_loader._initialize_model(model_config, self.disk_config, None)
        gms_torch.materialize_module(model, memory.weights, prefix=names.tensor_prefix(ENGINE))
        if hasattr(model, "post_load_weights"):
            model.post_load_weights()
        return model


def _check_supported(model_config: ModelConfig, device_config: DeviceConfig) -> None:
    if model_config.quantization is not None:
        raise UnsupportedModelError(f"quantized weights ({model_config.quantization}) are repacked after "
                                    f"loading; --load-format {LOAD_FORMAT} supports unquantized models only")
    if device_config.device.type != "cuda":
        raise UnsupportedModelError(f"--load-format {LOAD_FORMAT} loads onto the GPU, not {device_config.device}")


def _engine_memory(config, model_config: ModelConfig, device_config: DeviceConfig) -> EngineMemory:
    """This process's ``EngineMemory`` (one model per scheduler process)."""
    memory = installed()
    if memory is not None:
        raise UnsupportedModelError("--load-format gms loads one model per process: a speculative decoding "
                                    "draft model, or weights reloaded in place (published weights are "
                                    "shared and read-only), is not supported")
    state = active()
    if state is None or state.device is None:
        raise MissingWorkerError("--load-format gms: the plugin's hooks did not run in this process "
                                 "(is gms installed where SGLang runs? SGLANG_PLUGINS must name gms if set)")
    device = device_config.gpu_id if device_config.gpu_id is not None and device_config.gpu_id >= 0 else state.device
    identity = model_identity(model_config)
    memory = EngineMemory.open(config, state.socket, device, names.weights_layout(identity, config.layout),
                               identity=identity)
    install(memory)
    return memory


def model_identity(model_config: ModelConfig) -> names.ModelIdentity:
    """This rank's identity; call after SGLang has set up its parallel groups."""
    architectures = getattr(model_config.hf_config, "architectures", None) or ["unknown"]
    return weights.identity(ENGINE, sglang.__version__, model_config.model_path, model_config.revision,
                            model_config.dtype, architectures[0],
                            *generations.parallel_place())
