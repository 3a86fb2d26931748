"""What the kernel says of a process: its state (``/proc/PID/stat``).  Standard library only."""

from __future__ import annotations

import os


def state(pid: int) -> str | None:
    """The process's state letter (``R``, ``S``, ``T`` stopped, ``Z`` a zombie, ...);
    None where it is gone; ``?`` where there is no /proc to ask."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except FileNotFoundError:
        return None
    except (OSError, IndexError):
        return "?"


def gone(pid: int) -> bool:
    """Exited: no such process, or one only its parent has yet to reap."""
    found = state(pid)
    if found != "?":
        return found in (None, "Z")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


def stopped(pid: int) -> bool:
    """Stopped by a signal, or traced."""
    return state(pid) in ("T", "t")
