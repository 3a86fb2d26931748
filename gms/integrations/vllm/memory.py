"""The vLLM worker's ``EngineMemory`` (``gms.integrations.common.memory``):
the weights and the KV cache, made by ``GMSWorker.init_device``."""

from __future__ import annotations

from ..common.memory import EngineMemory
from ..common.memory import current as _current

MISSING = ("--load-format gms needs its worker: add "
           "--worker-cls gms.integrations.vllm.worker.GMSWorker (docs/vllm.md)")


def current() -> EngineMemory:
    """The process's ``EngineMemory``; MissingWorkerError without the worker."""
    return _current(MISSING)
