"""How a gms process starts another (a server, a spare, a keeper, the copier):
the same interpreter and package, never code from the folder it runs in.

``python -m`` puts the working folder first on the import path, so a root
``gms serve`` started in a folder others can write (``/tmp``) would run
whatever ``./gms/__main__.py`` a local user planted there, as root, in every
child.  Children are started with ``-P`` (no unsafe path first) and an import
path cleaned of entries others could write; the process itself drops such
entries at start (:func:`drop_unsafe_import_paths`), for the imports it makes
later.  Standard library only: the first thing ``gms`` runs.
"""

from __future__ import annotations

import os
import stat
import sys

_WRITABLE = stat.S_IWGRP | stat.S_IWOTH


def python_argv(module: str, *args: str) -> list[str]:
    """``[python, -P, -m, module, *args]``: this interpreter, safe path."""
    return [sys.executable, "-P", "-m", module, *args]


def without_options(words: list[str], flags: tuple[str, ...]) -> list[str]:
    """A command line's ``words`` less each of ``flags`` and its value (``--flag V``
    or ``--flag=V``): what a child is started with from its parent's own words.  Pure."""
    out, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in flags:
            skip = True
        elif not word.startswith(tuple(f + "=" for f in flags)):
            out.append(word)
    return out


def _owners() -> frozenset[int]:
    return frozenset({0, os.geteuid()})


def safe_import_path(entry: str) -> bool:
    """May this process import from ``entry``: an absolute path that only root or
    this process's user can change (it and every folder above it: owned by
    them, writable by no one else, a sticky folder above it aside)?  A path
    that does not exist is judged by the folders above it: whoever can create
    it could fill it."""
    if not entry or not os.path.isabs(entry):
        return False  # the working folder, whatever it is when the import comes
    owners = _owners()
    path, first = os.path.normpath(entry), True
    while True:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            st = None
        except OSError:
            return False
        if st is not None:
            if st.st_uid not in owners:
                return False
            if st.st_mode & _WRITABLE and (first or not st.st_mode & stat.S_ISVTX):
                return False
            first = False
        parent = os.path.dirname(path)
        if parent == path:
            return True
        path = parent


def drop_unsafe_import_paths() -> list[str]:
    """Take from ``sys.path`` what :func:`safe_import_path` refuses, where this
    process runs as root (another user's own server may import from its own
    folders).  Returns what it dropped."""
    if os.geteuid() != 0:
        return []
    dropped = [p for p in sys.path if not safe_import_path(p)]
    sys.path[:] = [p for p in sys.path if p not in dropped]
    return dropped


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: ours) with PYTHONPATH's unsafe entries removed (an empty
    one is the working folder) and PYTHONSAFEPATH set, for a gms child."""
    out = dict(os.environ if env is None else env)
    path = out.get("PYTHONPATH")
    if path is not None:  # (an empty or relative entry is the working folder, or under it)
        kept = [p for p in path.split(os.pathsep) if os.path.isabs(p) and (os.geteuid() != 0 or safe_import_path(p))]
        if kept:
            out["PYTHONPATH"] = os.pathsep.join(kept)
        else:
            out.pop("PYTHONPATH")
    out["PYTHONSAFEPATH"] = "1"
    return out


def code_stamp(files: list[str] | None = None) -> tuple[tuple[str, int, int, int], ...]:
    """What the code of this process is on disk now: (path, inode, size, mtime)
    of the interpreter and of each gms module loaded (or of ``files``).  An
    upgrade or an edit changes it; a file gone reads as (path, 0, 0, 0)."""
    if files is None:
        files = [sys.executable] + sorted(
            m.__file__ for name, m in list(sys.modules.items())
            if (name == "gms" or name.startswith("gms.")) and getattr(m, "__file__", None)
        )
    stamp = []
    for path in files:
        try:
            st = os.stat(path)
            stamp.append((path, st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            stamp.append((path, 0, 0, 0))
    return tuple(stamp)
