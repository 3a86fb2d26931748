"""``GET /gms/health`` on SGLang's HTTP server: what the failover coordinator
asks every engine (``{"status": "serving" | "asleep"}``, docs/failover.md).

SGLang's own ``/health`` says 200 whether or not the engine released its
memory.  This answers ``asleep`` while any tag is released (the launcher
sees every ``/release_memory_occupation`` and ``/resume_memory_occupation``
go by, through the hooks on its tokenizer manager: ``gate.py``), 503 while SGLang starts
or stops, ``serving`` otherwise; at once, never queued behind the engine's
work.  With it the engine's progress (``{"steps", "pending"}``): ``steps``
is the millisecond of the last output the launcher received from the
scheduler (it moves with every batch the model finishes), ``pending`` the
requests in flight; the coordinator fails over an engine whose steps stand
still while requests are pending (docs/failover.md).  No SGLang imported at
module level.
"""

from __future__ import annotations

import os

ROUTE = "/gms/health"
ALL_TAGS = ("weights", "kv_cache", "cuda_graph")  # what SGLang releases when a request names none

_released: set[str] = set()


def released() -> frozenset[str]:
    return frozenset(_released)


def tags(obj) -> set[str]:
    """The tags a release or resume request names (none: every tag)."""
    named = getattr(obj, "tags", None)
    return set(named) if named else set(ALL_TAGS)


def note_released(names: set[str]) -> None:
    _released.update(names)


def note_resumed(names: set[str]) -> None:
    _released.difference_update(names)


def status_name(manager) -> str:
    """SGLang's server status ("Starting", "Up", "UnHealthy") as a name."""
    return getattr(manager.server_status, "name", str(manager.server_status))


def status(server_status: str, exiting: bool, last_output: float = 0.0, in_flight: int = 0,
           pid: int = 0) -> tuple[int, dict]:
    """(HTTP code, body) from SGLang's server status ("Starting", "Up", "UnHealthy"), the
    time of the last output the launcher received, the requests in flight and the
    launcher's pid (the process a supervisor started).  Pure."""
    if exiting or server_status in ("Starting", "UnHealthy"):
        return 503, {"status": "unavailable", "sglang": server_status, "pid": pid}
    body = {"status": "asleep" if _released else "serving", "gms": {"released": sorted(_released)},
            "progress": {"steps": int(last_output * 1000), "pending": in_flight}, "pid": pid}
    return 200, body


def add_route(*args, **kwargs) -> None:
    from fastapi.responses import JSONResponse
    from sglang.srt.entrypoints import http_server

    if any(getattr(r, "path", None) == ROUTE for r in http_server.app.routes):
        return

    async def gms_health() -> JSONResponse:
        manager = http_server._global_state.tokenizer_manager
        code, body = status(status_name(manager), bool(manager.gracefully_exit),
                            float(getattr(manager, "last_receive_tstamp", 0.0) or 0.0),
                            len(getattr(manager, "rid_to_state", ()) or ()), os.getpid())
        return JSONResponse(body, status_code=code)

    http_server.app.add_api_route(ROUTE, gms_health, methods=["GET"])
