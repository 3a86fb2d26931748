"""vLLM's ``/sleep`` and ``/wake_up`` onto gms: a sleep-mode backend.

vLLM 0.26 routes sleep and wake through a pluggable backend
(``vllm/device_allocator/sleep_mode_backend.py``, RFC #34303): the worker
calls ``suspend(level)`` and ``resume(tags)``.  This one unmaps the weights
and the KV cache and drops both gms locks (the memory goes back to the
server, the KV layout is dropped with its lock, the addresses stay
reserved), and on wake maps them back at the same addresses: the weights as
published, the KV cache as fresh memory.  Nothing is copied to the host.

vLLM 0.33 adds ``discard(tags)`` (the KV cache released while the weights
stay): served by sleeping those tags.

Level 1 is the level this maps.  Level 2 ("discard the weights, reload them
on wake") is served the same way: the weights are not discarded, they stay
published in gms, so there is nothing to reload.
"""

from __future__ import annotations

import logging

from vllm.device_allocator.sleep_mode_backend import SleepModeBackend

from .memory import current

log = logging.getLogger("vllm.gms")  # see LOGGER in __init__.py
NAME = "gms"


class GMSSleepBackend(SleepModeBackend):
    def suspend(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level {level}: gms serves levels 1 and 2")
        if level == 2:
            log.info("gms: sleep level 2 is served as level 1: the weights stay published in gms")
        self._state = "SUSPENDED"
        current().sleep()

    def resume(self, tags: list[str] | None = None) -> None:
        self._state = "RESUMING"
        memory = current()
        memory.wake(tags)
        self._state = "RUNNING" if not memory.asleep else "SUSPENDED"

    def discard(self, tags: tuple[str, ...]) -> None:
        # vLLM 0.33's selective discard (``release_kv_cache_memory``): a tag
        # asleep in gms has its memory back on the server already, and a KV
        # layout's contents are never kept, so discarding is sleeping those tags.
        current().sleep(tags)
        self._state = "SUSPENDED"

    @classmethod
    def preserves_communicators(cls) -> bool:
        # NCCL's buffers are not gms memory: a sleep leaves them as they are.
        return True

    @classmethod
    def preserves_compiled_artifacts(cls) -> bool:
        # The process lives on and every tensor keeps its address.
        return True
