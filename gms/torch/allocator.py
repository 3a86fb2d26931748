"""A ``CUDAPluggableAllocator`` that puts tensors in gms memory, routed by tag.

::

    with gms.torch.use_memory(mgr, tag="weights"):
        model = build_model().cuda()      # every tensor made here is gms memory

torch loads ``gms_malloc``/``gms_free`` from a tiny shared library
(``_allocator_shim.c``), built with the system C compiler on first use into
``$GMS_CACHE_DIR`` (default ``~/.cache/gms``) and reused after.  The shim
forwards to Python: malloc goes to the manager of the innermost active
``use_memory`` (``create_mapping``), free goes to whichever manager made the
pointer, so frees that arrive after the ``with`` block still find their owner.
Each ``use_memory`` gets its own ``torch.cuda.MemPool``, so the caching
allocator never hands gms memory to code outside the block.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import attrs
import torch

from ..client.manager import GMSClientMemoryManager
from ..fsm import GrantedLockType

log = logging.getLogger("gms.torch")

_MALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)


class ShimBuildError(RuntimeError):
    pass


def cache_dir() -> Path:
    root = os.environ.get("GMS_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "gms"
    )
    return Path(root)


def build_shim() -> Path:
    """The shim library for this source, compiled once per source version."""
    source = resources.files("gms.torch").joinpath("_allocator_shim.c").read_bytes()
    target = cache_dir() / f"allocator-shim-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise ShimBuildError("gms.torch needs a C compiler (cc or $CC) to build its allocator shim")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "shim.c"
        src.write_bytes(source)
        out = Path(tmp) / "shim.so"
        result = subprocess.run(
            [compiler, "-O2", "-shared", "-fPIC", "-o", str(out), str(src)],
            capture_output=True, text=True,
        )
        if result.returncode != 0:
            raise ShimBuildError(f"building the allocator shim failed:\n{result.stderr}")
        os.replace(out, target)  # atomic: concurrent builders agree
    return target


@attrs.frozen(eq=False)
class Route:
    mgr: GMSClientMemoryManager
    tag: str


class _Router:
    """Which manager serves the next malloc, and which one owns each pointer."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active: list[Route] = []
        self.owners: dict[int, Route] = {}
        self.failure: BaseException | None = None

    def malloc(self, size: int, device: int, stream) -> int:
        with self.lock:
            route = self.active[-1] if self.active else None
        if route is None:
            log.error("gms allocator called outside use_memory()")
            return 0
        try:
            va = route.mgr.create_mapping(size=size, tag=route.tag)
        except BaseException as exc:  # torch sees NULL and raises its out-of-memory error
            self.failure = exc
            log.error("gms allocation of %d bytes failed: %s", size, exc)
            return 0
        with self.lock:
            self.owners[va] = route
        return va

    def free(self, ptr: int, size: int, device: int, stream) -> None:
        with self.lock:
            route = self.owners.pop(ptr, None)
        if route is None:
            log.error("gms allocator asked to free unknown pointer %#x", ptr or 0)
            return
        mgr = route.mgr
        try:
            allocation_id = next(mp.allocation_id for mp in mgr.mappings if mp.va == ptr)
            mgr.destroy_mapping(ptr)
            if mgr.is_connected and mgr.granted_lock_type is GrantedLockType.RW:
                mgr.free_handle(allocation_id)
        except BaseException as exc:  # never raise into torch's allocator
            log.error("gms free of %#x failed: %s", ptr, exc)


_router = _Router()
_installed: dict[str, object] = {}
_install_lock = threading.Lock()


def pluggable_allocator():
    """The process's one ``CUDAPluggableAllocator`` over the shim."""
    with _install_lock:
        if "allocator" not in _installed:
            path = str(build_shim())
            lib = ctypes.CDLL(path)  # the same handle torch's dlopen gets
            callbacks = (_MALLOC(_router.malloc), _FREE(_router.free))
            lib.gms_set_callbacks(*callbacks)
            # torch frees pools while the interpreter shuts down, when calling
            # into Python would crash: from then on the shim does nothing (the
            # process's exit releases the memory anyway).
            atexit.register(lib.gms_set_callbacks, None, None)
            _installed["callbacks"] = callbacks  # ctypes callbacks must stay alive
            _installed["lib"] = lib
            _installed["allocator"] = torch.cuda.memory.CUDAPluggableAllocator(path, "gms_malloc", "gms_free")
        return _installed["allocator"]


@contextlib.contextmanager
def without_expandable_segments() -> Iterator[None]:
    """A MemPool over a pluggable allocator cannot use expandable segments
    (pytorch/pytorch#147851): off inside, as vLLM's own CuMem pool does."""
    on = "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if on:
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    try:
        yield
    finally:
        if on:
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")


def memory_pool(mgr: GMSClientMemoryManager) -> torch.cuda.MemPool:
    """A ``MemPool`` over the gms allocator, alive as long as ``mgr`` (or until the
    caller drops it from ``mgr._torch_pools``): then torch may free its segments.
    Its memory comes from whichever manager is routed (``routed``) when torch
    asks for a segment."""
    pool = torch.cuda.MemPool(pluggable_allocator().allocator())
    mgr._torch_pools = [*getattr(mgr, "_torch_pools", []), pool]
    return pool


@contextlib.contextmanager
def routed(mgr: GMSClientMemoryManager, tag: str) -> Iterator[None]:
    """Inside, the gms allocator's mallocs go to ``mgr`` (which must hold RW), tagged ``tag``."""
    if mgr.granted_lock_type is not GrantedLockType.RW:
        raise RuntimeError("gms memory for torch needs a manager holding the RW lock")
    if mgr.backend != "cuda":
        raise RuntimeError("the pluggable allocator needs the CUDA backend")
    route = Route(mgr, tag)
    with _router.lock:
        _router.active.append(route)
    try:
        yield
    finally:
        with _router.lock:
            _router.active.remove(route)


@contextlib.contextmanager
def use_memory(mgr: GMSClientMemoryManager, tag: str = "weights") -> Iterator[torch.cuda.MemPool]:
    """Tensors created inside live in ``mgr``'s memory (which must hold RW)."""
    with routed(mgr, tag):
        pool = memory_pool(mgr)
        with torch.cuda.use_mem_pool(pool, device=torch.device("cuda", mgr.device)):
            yield pool
