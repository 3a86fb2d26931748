"""Which engine copies for a backend: the one module that knows both, so that
``engine`` (the protocol, the host engine) and ``cuda_engine`` (built on it)
import one way.  CUDA is imported only when the backend is CUDA."""

from __future__ import annotations

from ..cuda import open_mapper
from .engine import Engine, HostEngine


def open_engine(backend: str, device: int) -> Engine:
    if backend == "cuda":
        from .cuda_engine import CudaEngine

        return CudaEngine(device)
    if backend == "host":
        return HostEngine(open_mapper("host", device))
    raise ValueError(f"no copier engine for backend {backend!r}")
