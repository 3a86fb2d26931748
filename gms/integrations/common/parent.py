"""Exit with the parent: a worker whose API server died must not keep its GPU memory.

An engine runs the model in a child of its API server process (vLLM's engine
core, SGLang's schedulers).  When the API server is SIGKILLed, nothing tells
that child, and it keeps its
KV cache and its CUDA context: a shadow engine waking after a failover would
wait for memory held by an orphan.  ``exit_with_parent`` watches the parent
through a pidfd (readable once that process has exited) in a daemon thread
and SIGKILLs this process then.  A pidfd, not ``PR_SET_PDEATHSIG``: that
fires when the *thread* that started this process ends, which in a threaded
API server is not the same thing as the process dying.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading

log = logging.getLogger("gms.integrations")

_started: set[int] = set()  # parents already watched by this process


def exit_with_parent() -> bool:
    """Start watching; False where there is nothing to watch (the parent is
    init or a subreaper already, or the kernel has no pidfds)."""
    parent = os.getppid()
    if parent <= 1 or parent in _started:
        return False
    try:
        fd = os.pidfd_open(parent)
    except (AttributeError, OSError) as exc:  # Linux < 5.3, or the parent is gone already
        log.warning("gms: cannot watch parent %d (%s)", parent, exc)
        return False
    if os.getppid() != parent:  # it died between getppid and pidfd_open
        os.close(fd)
        _die(parent)
    _started.add(parent)
    threading.Thread(target=_watch, args=(fd, parent), name="gms-parent-watch", daemon=True).start()
    return True


def _watch(fd: int, parent: int) -> None:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while not poller.poll():
        pass
    _die(parent)


def _die(parent: int) -> None:
    log.error("gms: parent process %d exited: this worker exits too, releasing its GPU memory", parent)
    os.kill(os.getpid(), signal.SIGKILL)
