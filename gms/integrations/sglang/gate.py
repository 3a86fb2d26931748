"""While an engine's memory is released, its requests wait: the hooks on the
launcher's ``release_memory_occupation`` and ``resume_memory_occupation``.

SGLang runs a request on whatever memory its scheduler holds: one sent to a
released engine reaches a prefill over unmapped KV memory and kills the
scheduler (Triton's "Pointer argument cannot be accessed", found on the H100
with SGLang 0.5.17: the failover's first-token request reached the shadow
before its wake), and a release with requests in flight trips the
scheduler's "only when server is idle" assertion.  So a release first closes
SGLang's own pause gate (the one ``/pause_generation`` closes:
``generate_request`` waits on ``is_pause_cond`` before it tokenizes), then
drains the requests already past it by taking ``model_update_lock`` as a
writer, as SGLang's own weight update does.  The resume that leaves nothing
released opens the gate again, if a release closed it (a gate a user closed
stays closed).  A request sent to a shadow thus waits for its wake, as it
does on vLLM.  A release that comes while SGLang is still starting waits
until it is up: SGLang's own warm-up request (sent once ``/v1/models``
answers) would otherwise wait at the gate, and SGLang kills the whole server
when its warm-up gets no answer in time (found on an H200: a release right
after ``/v1/models`` answered).  No SGLang imported: the hooks get SGLang's
own objects.
"""

from __future__ import annotations

import asyncio

from . import health

# the tokenizer manager's, checked in tests/test_sglang.py
USES = ("is_pause", "is_pause_cond", "model_update_lock", "server_status")
_closed_by_release = False  # the gate is shut because of a release, not by a user
STARTING_POLL_S = 0.05


async def _until_started(manager) -> None:
    while health.status_name(manager) == "Starting":
        await asyncio.sleep(STARTING_POLL_S)


async def _close(manager) -> bool:
    """Shut the gate; True if it was open."""
    async with manager.is_pause_cond:
        was_open = not manager.is_pause
        manager.is_pause = True
    return was_open


async def _reopen(manager) -> None:
    global _closed_by_release
    if _closed_by_release and not health.released():
        _closed_by_release = False
        async with manager.is_pause_cond:
            manager.is_pause = False
            manager.is_pause_cond.notify_all()


def release(original, self, obj, *args, **kwargs):
    """AROUND the tokenizer manager's release: gate shut, in-flight requests
    drained, then SGLang's release; ``/gms/health`` says asleep after it."""
    async def run():
        global _closed_by_release
        await _until_started(self)
        if not _closed_by_release:
            _closed_by_release = await _close(self)
        try:
            async with self.model_update_lock.writer_lock:
                result = await original(self, obj, *args, **kwargs)
        except BaseException:
            await _reopen(self)  # nothing was released: the requests may go on
            raise
        health.note_released(health.tags(obj))
        return result

    return run()


def resume(original, self, obj, *args, **kwargs):
    """AROUND the tokenizer manager's resume: SGLang's resume, then the gate
    opened once no tag is released.  A failed resume keeps the gate shut."""
    async def run():
        result = await original(self, obj, *args, **kwargs)
        health.note_resumed(health.tags(obj))
        await _reopen(self)
        return result

    return run()
