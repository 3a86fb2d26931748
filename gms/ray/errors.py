"""Errors of ``gms.ray``.

A bad request is a ``ValueError`` (the seed asks for one when ``num_gpus``
and a memory request come together); a worker that cannot be bound to the
bytes it was scheduled with is a :class:`gms.GMSError`.
"""

from __future__ import annotations

from ..errors import GMSError


class GPUMemoryRequestError(ValueError):
    """The request cannot be made: not a size, given with ``num_gpus``, or clashing options."""


class NoGPUFitsError(GPUMemoryRequestError):
    """No GPU in the cluster can ever hold the request (it would wait forever in Ray)."""

    def __init__(self, message: str, asked_bytes: int, largest_bytes: int | None) -> None:
        super().__init__(message)
        self.asked_bytes = asked_bytes
        self.largest_bytes = largest_bytes  # the largest GPU that qualified; None: none at all

    def __reduce__(self):  # crosses process boundaries (Ray, multiprocessing) intact
        return (type(self), (str(self), self.asked_bytes, self.largest_bytes))


class NodeResourcesError(GMSError):
    """A node's GPU memory could not be read from its gms servers, or cannot be advertised."""


class WorkerBindingError(GMSError):
    """Inside a task or actor: no gms GPU memory was scheduled for it, its GPU is not
    on this node, or this gms cannot hold a session to the scheduled bytes."""
