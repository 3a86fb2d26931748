"""A vLLM engine's progress, as ``GET /gms/health`` reports it to the failover
coordinator (``{"steps", "pending"}``, docs/failover.md), from vLLM's own
Prometheus metrics in the API server's process: the tokens its engine core
has processed (prompt and generated: they move with every model step that
does work) and the requests running or waiting in its scheduler.  Both are
recorded as the engine core's outputs arrive, so they stand still when the
core hangs, and go on when it is merely saturated.

None where vLLM records no metrics (``--disable-log-stats``): the
coordinator then judges the engine by its canaries alone.  No vLLM imported.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry

# vLLM's metric names (vllm/v1/metrics/loggers.py; the surface check finds each in every release).
TOKENS = ("vllm:prompt_tokens", "vllm:generation_tokens")
REQUESTS = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def progress(registry: CollectorRegistry = REGISTRY) -> dict | None:
    steps = pending = None
    for family in registry.collect():
        if family.name in TOKENS:
            steps = (steps or 0) + sum(s.value for s in family.samples if s.name.endswith("_total"))
        elif family.name in REQUESTS:
            pending = (pending or 0) + sum(s.value for s in family.samples)
    if steps is None or pending is None:
        return None
    return {"steps": int(steps), "pending": int(pending)}
