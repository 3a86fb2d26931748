"""The gms side of one engine worker process: its weights and its scratch memory.

One manager on the GPU's server per layout (``names.py``):

* **weights**: ``RW_OR_RO`` (or ``RO`` with ``gms_read_only``).  The first
  engine is granted RW, loads from disk into gms memory and commits; every
  later one is granted RO and maps what was published.  A reader that
  arrives while a writer builds waits for its commit, and takes over if it
  dies (the server grants RW again after the writer's ``RW_ABORT``).
* **scratch** (the KV cache; SGLang's CUDA graphs' memory): RW on a layout
  of this engine's own per tag, never committed: it lives exactly as long as
  this process's session (a crash releases it).

A sleep (vLLM's ``/sleep``, SGLang's ``release_memory_occupation``) unmaps
the tags it names and drops their locks; a scratch layout goes with its
lock.  A wake maps the weights back at the same addresses (readers check the
layout hash) and makes fresh scratch memory at the same addresses, so every
tensor the engine holds, and every CUDA graph it captured, is valid again.

The engine's hooks make one ``EngineMemory`` per process and ``install`` it;
the code the engine constructs itself (a model loader, a sleep backend, a
memory-saver adapter) finds it with ``current()``.  No engine imported here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping

import attrs

from ... import torch as gms_torch
from ...client.manager import GMSClientMemoryManager
from ...errors import StaleMemoryLayoutError
from ...fsm import GrantedLockType, RequestedLockType
from ...fsm.state import CUDA_GRAPH, KV_CACHE  # noqa: F401 - CUDA_GRAPH: the engines take it from here
from .config import EngineConfig
from .errors import LayoutMismatchError, MissingWorkerError
from .names import ModelIdentity

log = logging.getLogger("gms.integrations")

# The engines' tags for their memory (vLLM's sleep tags and SGLang's memory
# types are the same words), and the tags of the gms allocations (the scratch ones: gms.fsm.state).
WEIGHTS = "weights"


@attrs.define(eq=False)
class EngineMemory:
    config: EngineConfig
    socket: str
    device: int
    weights: GMSClientMemoryManager
    scratch: dict[str, GMSClientMemoryManager] = attrs.Factory(dict)  # tag -> this engine's RW layout
    identity: ModelIdentity | None = None  # what the weights are published for (names.py)
    asleep: frozenset[str] = frozenset()  # the tags now unmapped
    timings: dict[str, float] = attrs.Factory(dict)

    @classmethod
    def open(cls, config: EngineConfig, socket: str, device: int, weights_layout: str,
             scratch_layouts: Mapping[str, str] | None = None,
             identity: ModelIdentity | None = None) -> EngineMemory:
        """Managers only; ``connect`` takes the locks."""
        memory = cls(config, socket, device, GMSClientMemoryManager(socket, device=device, layout=weights_layout),
                     identity=identity)
        for tag, layout in (scratch_layouts or {}).items():
            memory.add_scratch(tag, layout)
        return memory

    def add_scratch(self, tag: str, layout: str) -> GMSClientMemoryManager:
        if tag == WEIGHTS or tag in self.scratch:
            raise ValueError(f"{tag!r} has its layout already")
        self.scratch[tag] = GMSClientMemoryManager(self.socket, device=self.device, layout=layout)
        return self.scratch[tag]

    @property
    def kv(self) -> GMSClientMemoryManager:
        return self.scratch[KV_CACHE]

    @property
    def writer(self) -> bool:
        """This process was granted RW on the weights: it loads and publishes them."""
        return self.weights.granted_lock_type is GrantedLockType.RW

    def connect(self) -> GrantedLockType:
        """Take every lock: the weights' first (it may wait for a writer on this
        GPU, RW_OR_RO, or for a commit, RO), then each scratch layout's."""
        self.connect_weights()
        for tag in self.scratch:
            self.connect_scratch(tag)
        return self.weights.granted_lock_type

    def connect_weights(self) -> GrantedLockType:
        started = time.perf_counter()
        lock = RequestedLockType.RO if self.config.read_only else RequestedLockType.RW_OR_RO
        self.weights.connect(lock, self.config.lock_timeout_ms)
        self.timings["weights_lock_s"] = time.perf_counter() - started
        log.info("gms: %s on %r at %s (waited %.3f s)", self.weights.granted_lock_type.value,
                 self.weights.layout, self.socket, self.timings["weights_lock_s"])
        return self.weights.granted_lock_type

    def connect_scratch(self, tag: str) -> GMSClientMemoryManager:
        """RW on the layout of ``tag`` (this engine's alone: granted at once)."""
        mgr = self.scratch[tag]
        if not mgr.is_connected:
            mgr.connect(RequestedLockType.RW, self.config.lock_timeout_ms)
            log.info("gms: RW on %r", mgr.layout)
        return mgr

    def _managers(self, tags: Iterable[str] | None) -> list[tuple[str, GMSClientMemoryManager]]:
        """Scratch first, the weights last (the order of a sleep; a wake goes the other way)."""
        wanted = None if tags is None else set(tags)
        unknown = set() if wanted is None else wanted - {WEIGHTS, *self.scratch}
        if unknown:
            raise ValueError(f"no gms memory is tagged {', '.join(sorted(unknown))}")
        pairs = [*self.scratch.items(), (WEIGHTS, self.weights)]
        return [(tag, mgr) for tag, mgr in pairs if wanted is None or tag in wanted]

    def sleep(self, tags: Iterable[str] | None = None) -> None:
        """Unmap ``tags`` (default all) and drop their locks; every address stays reserved."""
        started = time.perf_counter()
        for tag, mgr in self._managers(tags):
            # Mapped memory is unmapped even when the connection is gone: a
            # server killed under a serving engine leaves its tensors live.
            if tag not in self.asleep and (mgr.is_connected or any(mp.mapped for mp in mgr.mappings)):
                gms_torch.sleep(mgr)
                self.asleep |= {tag}
        self.timings["sleep_s"] = time.perf_counter() - started

    def wake(self, tags: Iterable[str] | None = None) -> None:
        """Map ``tags`` (default all asleep) back at their addresses.  A failure
        leaves what it was waking unmapped and unlocked, and raises."""
        started = time.perf_counter()
        for tag, mgr in reversed(self._managers(tags)):
            if tag not in self.asleep:
                continue
            try:
                if tag == WEIGHTS:
                    gms_torch.wake_weights(mgr, self.config.lock_timeout_ms)
                else:
                    gms_torch.wake_kv_cache(mgr, tag, self.config.lock_timeout_ms)
            except StaleMemoryLayoutError as exc:
                self._undo(mgr)
                raise LayoutMismatchError(
                    f"the weights layout {mgr.layout!r} was published again while this engine "
                    f"slept ({exc}); its tensors cannot follow: restart the engine"
                ) from exc
            except BaseException:
                self._undo(mgr)
                raise
            self.asleep -= {tag}
            self.timings[f"wake_{tag}_s"] = time.perf_counter() - started
        self.timings["wake_s"] = time.perf_counter() - started

    @staticmethod
    def _undo(mgr: GMSClientMemoryManager) -> None:
        try:
            if mgr.is_connected and any(mp.mapped for mp in mgr.mappings):
                mgr.unmap_all_vas()
        finally:
            mgr.abort()

    def close(self) -> None:
        for _, mgr in self._managers(None):
            mgr.close()


_current: EngineMemory | None = None


def install(memory: EngineMemory) -> None:
    global _current
    _current = memory


def installed() -> EngineMemory | None:
    return _current


def current(missing: str = "--load-format gms needs the rest of its integration (docs/vllm.md, docs/sglang.md)"
            ) -> EngineMemory:
    """The process's ``EngineMemory``, made by the engine's hooks."""
    if _current is None:
        raise MissingWorkerError(missing)
    return _current
