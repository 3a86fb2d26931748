"""The copier's engine for a server's backend (``engine.py`` says what an engine does)."""

from __future__ import annotations

from ..cuda import open_mapper
from .engine import Engine, HostEngine


def open_engine(backend: str, device: int) -> Engine:
    if backend == "cuda":
        from .cuda_engine import CudaEngine  # cuda.bindings only where the backend is CUDA

        return CudaEngine(device)
    if backend == "host":
        return HostEngine(open_mapper("host", device))
    raise ValueError(f"no copier engine for backend {backend!r}")
