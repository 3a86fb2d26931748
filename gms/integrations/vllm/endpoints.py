"""``GET /gms/health``: the engine contract of ``gms failover``, on vLLM's API server.

The failover coordinator (docs/failover.md) asks each engine for its canary
and wants a word back: ``{"status": "serving"}`` when one token went
through the whole model within its deadline, ``{"status": "asleep"}`` while
the engine sleeps with its process alive.  vLLM's own ``/health`` answers
200 in both cases and runs no model, so this route adds the contract beside
it (``health_path = "/gms/health"`` in the coordinator's configuration).

An endpoint plugin (vLLM's ``vllm.endpoint_plugins`` group): vLLM loads one
only when ``VLLM_PLUGINS`` names it (``VLLM_PLUGINS=gms``, which also keeps
the ``gms`` general plugin).  The canary is an ordinary request through the
engine client, prompt ``[0]`` (every vocabulary has token 0), one greedy
token.  ``/sleep``, ``/wake_up`` and ``/is_sleeping`` are vLLM's own
(``VLLM_SERVER_DEV_MODE=1``).

With the answer goes the engine's progress (``progress.py``).  While
requests are running or waiting the route answers with that at once, with
no canary and no call to the engine core: a saturated engine's canary
would queue behind its batch, and a hung core would hold the canary (and
even ``is_sleeping``) for ever, where its progress standing still says it
within ``stall_s``.  The route's own calls into the core (``is_sleeping``,
the canary) count as pending until answered, so a core that hangs while
idle is caught the same way.
"""

from __future__ import annotations

import os
import uuid

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from .progress import Health

PATH = "/gms/health"
_health = Health()  # one per API server process


class GmsEndpoints:
    """The ``vllm.endpoint_plugins`` entry point (a zero-argument factory)."""

    name = "gms"
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        router = APIRouter()
        router.add_api_route(PATH, health, methods=["GET"])
        app.include_router(router)

    async def init_state(self, engine_client, state, args) -> None:
        state.gms_engine_client = engine_client


async def health(request: Request) -> JSONResponse:
    client = getattr(request.app.state, "gms_engine_client", None)

    async def canary() -> None:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        async for _ in client.generate({"prompt_token_ids": [0]}, params, f"gms-canary-{uuid.uuid4().hex}"):
            pass

    code, body = await _health.answer(client, canary, os.getpid())
    return JSONResponse(body, status_code=code)
