"""Lanes: one worker thread per memory tier that makes every call into its backend.

CUDA calls take time (``cuMemRelease`` about 0.5 ms per GiB, pinning host
pages about a quarter of a second per GiB, an NVML query) and none of them may
stall the event loop, where every other client waits.  So each tier's
backend is called only from its lane, in the order the loop asked, and the
loop never touches what the lane does: it awaits a call's result (``call``)
or hands over work it needs no answer to (``post``: releases, which the loop
has already recorded).  One lane per tier keeps a slow host-copy pin from
delaying another tenant's device allocation.

A failure in posted work (a CUDA error releasing memory) has no caller to
raise in: the lane keeps it, and :meth:`Lane.watch` raises it in the server's
nursery, which stops the server (exit 70) as any other broken effect does.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import trio

T = TypeVar("T")
_STOP = object()


class Lane:
    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._token = trio.lowlevel.current_trio_token()
        self._failure: BaseException | None = None
        self._failed = trio.Event()
        self._thread = threading.Thread(target=self._work, name=f"gms-lane-{name}", daemon=True)
        self._thread.start()

    # -- the loop's side ---------------------------------------------------------

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the lane and return its result (or raise its error).

        Not cancellable, like a system call: a result that was made (memory)
        always reaches the caller, which alone knows how to undo it."""
        done = trio.Event()
        box: list = []
        self._jobs.put((fn, args, (done, box)))
        with trio.CancelScope(shield=True):
            await done.wait()
        ok, value = box[0]
        if ok:
            return value
        raise value

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the lane, after everything asked before it; no answer."""
        self._jobs.put((fn, args, None))

    def post_then(self, then: Callable[[bool, Any], None], fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the lane; ``then(ok, result or error)`` runs on the loop after."""
        self._jobs.put((fn, args, then))

    async def watch(self) -> None:
        """Raise the first failure of posted work (run in the server's nursery)."""
        await self._failed.wait()
        raise self._failure

    def stop(self) -> None:
        """Finish what was asked, then end the thread (blocking: at shutdown only)."""
        self._jobs.put(_STOP)
        self._thread.join()

    # -- the lane's side ---------------------------------------------------------

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            fn, args, reply = job
            try:
                value = (True, fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the loop below
                value = (False, exc)
            if callable(reply):
                self._token.run_sync_soon(reply, *value)
            elif reply is not None:
                done, box = reply
                box.append(value)
                self._token.run_sync_soon(done.set)
            elif not value[0]:
                self._token.run_sync_soon(self.fail, value[1])

    def fail(self, exc: BaseException) -> None:
        """Stop the server with ``exc`` (a failure in work nobody awaits); on the loop."""
        if self._failure is None:
            self._failure = exc
            self._failed.set()
