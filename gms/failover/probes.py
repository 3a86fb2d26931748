"""HTTP to engines: canaries, wake, first token.  Every call has a deadline."""

from __future__ import annotations

import time

import httpx
import trio

from .health import Probe, Progress

# One token id that every vocabulary has; not 0: SGLang refuses a prompt of
# falsy ids as empty (its serving_completions._validate_request).
CANARY_PROMPT = [1]


async def health(client: httpx.AsyncClient, url: str, want: str, timeout: float, path: str = "/health") -> Probe:
    started = time.monotonic()
    status, detail, ok, notes, progress = None, "", False, {}, None
    with trio.move_on_after(timeout) as scope:  # a stopped engine accepts and never answers
        try:
            response = await client.get(f"{url}{path}", timeout=timeout)
            body = _json(response)
            status = body.get("status")
            ok = response.status_code == 200 and status == want
            detail = f"{response.status_code} {body}"
            notes = body.get("gms") if isinstance(body.get("gms"), dict) else {}
            progress = Progress.parse(body.get("progress"))
        except httpx.HTTPError as exc:
            detail = f"{type(exc).__name__}: {exc}"
    if scope.cancelled_caught:
        detail = f"no answer in {timeout} s"
    return Probe(url, ok, status, detail, started, time.monotonic() - started, notes, progress)


async def post(client: httpx.AsyncClient, url: str, path: str, timeout: float, body: dict | None = None):
    """(status code or None, JSON body or error text, seconds)."""
    started = time.monotonic()
    with trio.move_on_after(timeout):
        try:
            response = await client.post(f"{url}{path}", json=body, timeout=timeout)
            return response.status_code, _json(response), time.monotonic() - started
        except httpx.HTTPError as exc:
            return None, f"{type(exc).__name__}: {exc}", time.monotonic() - started
    return None, f"no answer in {timeout} s", time.monotonic() - started


async def first_token(client: httpx.AsyncClient, url: str, timeout: float):
    return await post(client, url, "/v1/completions", timeout,
                      {"prompt": CANARY_PROMPT, "max_tokens": 1, "ignore_eos": True})


def _json(response: httpx.Response) -> dict:
    try:
        body = response.json()
    except ValueError:
        return {"text": response.text[:200]}
    return body if isinstance(body, dict) else {"body": body}
