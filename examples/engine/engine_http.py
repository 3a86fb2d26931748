"""HTTP: vLLM's endpoint names over the engine, as a starlette app on Trio.

``POST /v1/completions`` (OpenAI-style; greedy), ``POST /sleep``,
``POST /wake_up``, ``GET /is_sleeping``, ``GET /health`` (the canary) and
``GET /state`` (phase, addresses, timings: for tests and operators).  Model
and gms work runs in one worker thread at a time (a capacity limiter of 1),
so requests, sleeps and wakes never interleave, and the event loop keeps
answering while the model computes.  The canary's answer carries the
engine's progress (``{"steps", "pending"}``: forward passes done, requests
admitted and not finished); while the worker is busy the health check
answers with that at once instead of queueing a canary behind the work, so
a saturated engine is judged by its steps going on, a hung one by their
standing still (docs/failover.md).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid

import anyio
from engine_model import BadRequest, Engine, EngineError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import gms

log = logging.getLogger("engine.http")


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def build_app(engine: Engine) -> Starlette:
    worker = anyio.CapacityLimiter(1)
    pending = [0]  # requests admitted and not answered, a canary included
    # Model work running in a thread now.  Not the limiter's count: a canary that
    # timed out is abandoned, its token given back, while its thread may still hang.
    running = [0]
    running_lock = threading.Lock()

    def tracked(fn):
        def call(*args):
            with running_lock:
                running[0] += 1
            try:
                return fn(*args)
            finally:
                with running_lock:
                    running[0] -= 1
        return call

    async def run(fn, *args):
        return await anyio.to_thread.run_sync(tracked(fn), *args, limiter=worker)

    def progress() -> dict:
        return {"steps": engine.steps, "pending": max(pending[0], running[0])}

    async def completions(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body is not JSON", "invalid_request_error")
        if not isinstance(body, dict) or "prompt" not in body:
            return _error(400, "a completion needs a prompt", "invalid_request_error")
        if body.get("temperature", 0) not in (0, 0.0, None) or body.get("n", 1) != 1:
            return _error(400, "this engine decodes greedily: temperature must be 0 and n 1",
                          "invalid_request_error")
        if engine.phase != "serving":
            return _error(503, f"engine is {engine.phase}", "unavailable")
        prompt = body["prompt"]
        prompts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) else [prompt]
        max_tokens = body.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
            return _error(400, "max_tokens must be an integer", "invalid_request_error")
        ignore_eos = bool(body.get("ignore_eos", False))

        def complete():
            out = []
            for p in prompts:
                ids = engine.tokenize(p)
                tokens, reason = engine.generate(ids, max_tokens, ignore_eos)
                out.append((ids, tokens, reason))
            return out

        pending[0] += 1
        try:
            results = await run(complete)
        except BadRequest as exc:
            return _error(400, str(exc), "invalid_request_error")
        except EngineError as exc:
            return _error(503, str(exc), "unavailable")
        finally:
            pending[0] -= 1
        choices = [
            {"index": i, "text": engine.detokenize(tokens), "token_ids": tokens, "logprobs": None,
             "finish_reason": reason}
            for i, (_, tokens, reason) in enumerate(results)
        ]
        prompt_tokens = sum(len(ids) for ids, _, _ in results)
        completion_tokens = sum(len(tokens) for _, tokens, _ in results)
        return JSONResponse({
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": engine.options.name, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        })

    async def sleep(request: Request) -> JSONResponse:
        level = request.query_params.get("level", "1")
        if level != "1":
            return _error(400, "only level 1 (weights kept in gms, KV cache dropped) is supported",
                          "invalid_request_error")
        try:
            seconds = await run(engine.sleep)
        except EngineError as exc:
            return _error(409, str(exc), "conflict")
        log.info("asleep (%.1f ms)", seconds * 1e3)
        return JSONResponse({"is_sleeping": True, "sleep_s": seconds})

    async def wake_up(request: Request) -> JSONResponse:
        """``{"revoke_kv": true}``: first take the KV lock from a hung primary on
        this GPU (for a coordinator that cannot reach the GPU's gms socket)."""
        started = time.perf_counter()
        body = await request.body()
        try:
            options = json.loads(body) if body else {}
        except ValueError:
            return _error(400, "the body is not JSON", "invalid_request_error")
        revoked = {}
        try:
            if isinstance(options, dict) and options.get("revoke_kv"):
                revoked = {"revoked": await run(engine.revoke_kv)}
            phases = await run(engine.wake)
        except EngineError as exc:
            return _error(409, str(exc), "conflict")
        except gms.LockTimeoutError as exc:
            return _error(503, f"wake timed out waiting for a lock: {exc}", "unavailable")
        except gms.GMSError as exc:  # no server, a stale layout it could not import again, ...
            return _error(503, f"wake failed: {exc}", "unavailable")
        seconds = time.perf_counter() - started
        log.info("awake in %.1f ms %s", seconds * 1e3, phases)
        return JSONResponse({"is_sleeping": False, "wake_s": seconds, **revoked, **phases})

    async def is_sleeping(request: Request) -> JSONResponse:
        return JSONResponse({"is_sleeping": engine.phase == "asleep"})

    async def health(request: Request) -> JSONResponse:
        """Serving: the canary, after taking back any gms lock a server restart
        broke (``gms`` in the body says what happened; a revoked lock is not
        healthy, a server not back yet is: the engine serves from what it has
        mapped).  Asleep: the weights' addresses are held and their layout is
        still on the server (else the next wake would import again)."""
        phase = engine.phase
        gms_timeout = min(1.0, engine.options.canary_timeout_s / 4)
        if phase == "asleep":
            if not engine.weights_held():
                return JSONResponse({"status": "asleep", "error": "weights' address space not held"},
                                    status_code=503)
            stale = await anyio.to_thread.run_sync(engine.weights_current, gms_timeout)
            if stale is not None:
                return JSONResponse({"status": "asleep", "error": stale}, status_code=503)
            return JSONResponse({"status": "asleep"})
        if phase != "serving":
            return JSONResponse({"status": phase}, status_code=503)
        if running[0]:  # busy: its progress says more than a canary queued behind it would
            return JSONResponse({"status": "serving", "progress": progress()})

        def check():
            notes = engine.check_gms(gms_timeout)
            return notes, engine.canary()

        pending[0] += 1
        try:
            with anyio.fail_after(engine.options.canary_timeout_s):
                # abandon_on_cancel: a hung forward must not hang the probe too
                notes, seconds = await anyio.to_thread.run_sync(tracked(check), limiter=worker,
                                                                abandon_on_cancel=True)
        except TimeoutError:
            return JSONResponse({"status": "serving", "error": "canary timed out", "progress": progress()},
                                status_code=503)
        except EngineError:  # went to sleep meanwhile
            return JSONResponse({"status": engine.phase}, status_code=503)
        except Exception as exc:  # noqa: BLE001 - any failure of the model is a failed canary
            log.exception("canary failed")
            return JSONResponse({"status": "serving", "error": repr(exc)}, status_code=503)
        finally:
            pending[0] -= 1
        body = {"status": "serving", "canary_s": seconds, "progress": progress(),
                **({"gms": notes} if notes else {})}
        revoked = [layout for layout, note in notes.items() if note.startswith("revoked")]
        if revoked:
            return JSONResponse({**body, "error": f"gms lock revoked: {', '.join(revoked)}"}, status_code=503)
        return JSONResponse(body)

    async def state(request: Request) -> JSONResponse:
        return JSONResponse(engine.state())

    return Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/sleep", sleep, methods=["POST"]),
        Route("/wake_up", wake_up, methods=["POST"]),
        Route("/is_sleeping", is_sleeping, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/state", state, methods=["GET"]),
    ])
