"""A vLLM engine's progress, as ``GET /gms/health`` reports it to the failover
coordinator (``{"steps", "pending"}``, docs/failover.md), from vLLM's own
Prometheus metrics in the API server's process: the tokens its engine core
has processed (prompt and generated) and the requests running or waiting in
its scheduler.  A long prompt prefilled in chunks produces no token, and
counts no prompt token, until its last chunk (vLLM counts a prompt with its
first token): alone on the engine it would look hung for the whole prefill.
But the scheduler's stats come with every step, outputs or not (vLLM's
``Scheduler.update_from_output``: "We must return the stats even if there
are no request outputs this step", 0.26 to 0.33), and a chunk takes KV
blocks: so ``steps`` also moves with the KV cache's usage.  All of it is
recorded as the engine core's steps arrive, so it stands still when the core
hangs, and goes on when it is merely saturated.

None where vLLM records no metrics (``--disable-log-stats``): the
coordinator then judges the engine by its canaries alone.  ``Health`` is the
route's whole answer, given the engine client and a canary.  No vLLM imported.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from prometheus_client import REGISTRY, CollectorRegistry

# vLLM's metric names (vllm/v1/metrics/loggers.py; the surface check finds each in every release).
TOKENS = ("vllm:prompt_tokens", "vllm:generation_tokens")
REQUESTS = ("vllm:num_requests_running", "vllm:num_requests_waiting")
KV_USAGE = "vllm:kv_cache_usage_perc"  # a fraction (0 to 1) per engine, despite its name
# steps = tokens x TOKEN_WEIGHT + the KV usage in millionths (summed over
# engines): one number that changes when either does, and never collides.
TOKEN_WEIGHT = 10**12
log = logging.getLogger(__name__)


def progress(registry: CollectorRegistry = REGISTRY) -> dict | None:
    tokens = pending = None
    kv = 0.0
    for family in registry.collect():
        if family.name in TOKENS:
            tokens = (tokens or 0) + sum(s.value for s in family.samples if s.name.endswith("_total"))
        elif family.name in REQUESTS:
            pending = (pending or 0) + sum(s.value for s in family.samples)
        elif family.name == KV_USAGE:
            kv += sum(s.value for s in family.samples)
    if tokens is None or pending is None:
        return None
    return {"steps": int(tokens) * TOKEN_WEIGHT + round(kv * 1_000_000), "pending": int(pending)}


class Health:
    """``GET /gms/health``'s answer for one API server (``endpoints.py`` is the route).

    ``asking``: this route's own calls into the engine core not answered yet
    (``is_sleeping``, the canary): pending work too, so a core that hangs while
    idle is seen the same way as one that hangs busy.  Such a call is never
    waited for longer than ``answer_within``: past it the route answers from
    the progress (the call still pending, the steps as they stand), so the
    coordinator starts its ``stall_s`` clock at once rather than after its
    canary's timeout; the call goes on, and the next answer after it ends
    says how it went."""

    def __init__(self, registry: CollectorRegistry = REGISTRY, answer_within: float = 0.25) -> None:
        self.registry = registry
        self.answer_within = answer_within
        self.asking = 0
        self.status = "serving"  # what the last call into the core found: asleep or serving
        self.warned = False

    async def answer(self, client, canary: Callable[[], Awaitable[None]], pid: int) -> tuple[int, dict]:
        """(HTTP code, body).  ``client``: vLLM's engine client; ``canary``: one token through it."""
        if client is None:
            return 503, {"status": "starting", "pid": pid}
        try:
            await client.check_health()
        except Exception as exc:  # noqa: BLE001 - a dead engine core is a failed canary, whatever it raised
            return 503, {"status": "dead", "error": repr(exc), "pid": pid}
        busy = progress(self.registry)
        if busy is None and not self.warned:
            self.warned = True
            log.warning("vLLM records no metrics (--disable-log-stats?): a hung engine core is seen only by the "
                        "coordinator's canary timeout, not by its progress")
        if busy is not None and busy["pending"] + self.asking > 0:  # judged by its progress: no call into the core
            # Work admitted: serving, whatever the core last said (a woken shadow's first
            # requests must not read as asleep); its steps judge it.
            return 200, self._by_progress(busy, "serving", pid)
        self.asking += 1  # until the core answers: a hung core keeps it, and the next probe sees it
        if busy is None:  # nothing else to answer with
            return await self._ask(client, canary, pid)
        call = asyncio.ensure_future(self._ask(client, canary, pid))
        try:
            return await asyncio.wait_for(asyncio.shield(call), self.answer_within)
        except TimeoutError:  # the core has not answered yet: as it last was, with the call pending
            return 200, self._by_progress(progress(self.registry) or busy, self.status, pid)

    def _by_progress(self, busy: dict, status: str, pid: int) -> dict:
        return {"status": status, "pid": pid, "progress": {**busy, "pending": busy["pending"] + self.asking}}

    async def _ask(self, client, canary: Callable[[], Awaitable[None]], pid: int) -> tuple[int, dict]:
        """Ask the core whether it sleeps, then one token through it; ``asking`` is
        counted up by the caller, down here."""
        try:
            if await client.is_sleeping():
                self.status = "asleep"
                return 200, {"status": "asleep", "pid": pid}
            self.status = "serving"
            started = time.perf_counter()
            try:
                await canary()
            except Exception as exc:  # noqa: BLE001 - any failure of the model is a failed canary
                return 503, {"status": "serving", "error": repr(exc), "pid": pid}
        finally:
            self.asking -= 1
        body = {"status": "serving", "canary_s": time.perf_counter() - started, "pid": pid}
        done = progress(self.registry)
        return 200, ({**body, "progress": done} if done is not None else body)
