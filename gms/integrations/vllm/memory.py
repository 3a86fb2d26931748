"""The gms side of one vLLM worker process: its weights and its KV cache.

Two managers on the GPU's server, one per layout (``names.py``):

* **weights**: ``RW_OR_RO`` (or ``RO`` with ``gms_read_only``).  The first
  engine is granted RW, loads from disk into gms memory and commits; every
  later one is granted RO and maps what was published.  A reader that
  arrives while a writer builds waits for its commit, and takes over if it
  dies (the server grants RW again after the writer's ``RW_ABORT``).
* **kv_cache**: RW on a layout of this engine's own, never committed: it
  lives exactly as long as this process's session (a crash releases it).

Sleep (vLLM's level 1) unmaps both and drops both locks; the KV layout goes
with its lock.  Wake maps the weights back at the same addresses (readers
check the layout hash) and makes fresh KV memory at the same addresses, so
every tensor vLLM holds, and every CUDA graph it captured, is valid again.

The worker makes one ``EngineMemory`` per process and ``install``s it; the
model loader and the sleep backend, which vLLM constructs itself, find it
with ``current()``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import attrs

from ... import torch as gms_torch
from ...client.manager import GMSClientMemoryManager
from ...errors import StaleMemoryLayoutError
from ...fsm import GrantedLockType, RequestedLockType
from .config import GmsVllmConfig
from .errors import LayoutMismatchError, MissingWorkerError
from .names import ModelIdentity

log = logging.getLogger("vllm.gms")  # see LOGGER in __init__.py

WEIGHTS, KV_CACHE = "weights", "kv_cache"  # vLLM's sleep tags, and the tags of the gms allocations


@attrs.define(eq=False)
class EngineMemory:
    config: GmsVllmConfig
    socket: str
    device: int
    weights: GMSClientMemoryManager
    kv: GMSClientMemoryManager
    identity: ModelIdentity | None = None  # what the weights are published for (names.py)
    asleep: frozenset[str] = frozenset()  # the tags now unmapped
    timings: dict[str, float] = attrs.Factory(dict)

    @classmethod
    def open(cls, config: GmsVllmConfig, socket: str, device: int, weights_layout: str, kv_layout: str,
             identity: ModelIdentity | None = None) -> EngineMemory:
        """Managers only; ``connect`` takes the locks."""
        return cls(config, socket, device,
                   GMSClientMemoryManager(socket, device=device, layout=weights_layout),
                   GMSClientMemoryManager(socket, device=device, layout=kv_layout), identity)

    @property
    def writer(self) -> bool:
        """This process was granted RW on the weights: it loads and publishes them."""
        return self.weights.granted_lock_type is GrantedLockType.RW

    def connect(self) -> GrantedLockType:
        """Take both locks.  The weights' handshake may wait for a writer on this GPU
        (RW_OR_RO) or for a commit (RO); the KV layout is this engine's alone."""
        started = time.perf_counter()
        lock = RequestedLockType.RO if self.config.read_only else RequestedLockType.RW_OR_RO
        self.weights.connect(lock, self.config.lock_timeout_ms)
        self.timings["weights_lock_s"] = time.perf_counter() - started
        self.kv.connect(RequestedLockType.RW, self.config.lock_timeout_ms)
        log.info("gms: %s on %r at %s (waited %.3f s), RW on %r", self.weights.granted_lock_type.value,
                 self.weights.layout, self.socket, self.timings["weights_lock_s"], self.kv.layout)
        return self.weights.granted_lock_type

    def sleep(self) -> None:
        """Unmap everything and drop both locks; every address stays reserved."""
        started = time.perf_counter()
        for mgr, tag in ((self.kv, KV_CACHE), (self.weights, WEIGHTS)):
            if tag not in self.asleep:
                gms_torch.sleep(mgr)
                self.asleep |= {tag}
        self.timings["sleep_s"] = time.perf_counter() - started

    def wake(self, tags: Iterable[str] | None = None) -> None:
        """Map ``tags`` (default both) back at their addresses.  A failure leaves
        what it was waking unmapped and unlocked, and raises."""
        wanted = set(self.asleep if tags is None else tags) & self.asleep
        started = time.perf_counter()
        if WEIGHTS in wanted:
            try:
                gms_torch.wake_weights(self.weights, self.config.lock_timeout_ms)
            except StaleMemoryLayoutError as exc:
                self._undo(self.weights)
                raise LayoutMismatchError(
                    f"the weights layout {self.weights.layout!r} was published again while this engine "
                    f"slept ({exc}); its tensors cannot follow: restart the engine"
                ) from exc
            except BaseException:
                self._undo(self.weights)
                raise
            self.asleep -= {WEIGHTS}
        self.timings["wake_weights_s"] = time.perf_counter() - started
        if KV_CACHE in wanted:
            try:
                gms_torch.wake_kv_cache(self.kv, KV_CACHE, self.config.lock_timeout_ms)
            except BaseException:
                self._undo(self.kv)
                raise
            self.asleep -= {KV_CACHE}
        self.timings["wake_s"] = time.perf_counter() - started

    @staticmethod
    def _undo(mgr: GMSClientMemoryManager) -> None:
        try:
            if mgr.is_connected and any(mp.mapped for mp in mgr.mappings):
                mgr.unmap_all_vas()
        finally:
            mgr.abort()

    def close(self) -> None:
        for mgr in (self.kv, self.weights):
            mgr.close()


_current: EngineMemory | None = None


def install(memory: EngineMemory) -> None:
    global _current
    _current = memory


def current() -> EngineMemory:
    """The process's ``EngineMemory``, made by ``GMSWorker.init_device``."""
    if _current is None:
        raise MissingWorkerError(
            "--load-format gms needs its worker: add "
            "--worker-cls gms.integrations.vllm.worker.GMSWorker (docs/vllm.md)"
        )
    return _current
