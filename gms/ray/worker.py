"""The worker side: a gms session bound to the bytes Ray scheduled.

Inside a task or actor placed by ``gms.ray``, Ray's assigned resources name
the GPU and the bytes (:func:`scheduled`).  :func:`connect` opens that GPU's
gms server on this node and connects with ``limit_bytes`` set to those bytes:
the session narrows its own limit (it can never widen past its tenant's
quota), and the server refuses any allocation past it with
``QuotaExceededError``.  When the worker ends or dies its socket closes and
the server frees the session's memory at once; Ray releases the resource.
"""

from __future__ import annotations

import os

import attrs

from ..client import GMSClientMemoryManager
from ..fsm import RequestedLockType
from ..system import paths
from . import _core
from .errors import WorkerBindingError
from .names import gpu_of, host_gpu, parse_gpu, resource_name


@attrs.frozen
class Scheduled:
    """The GPU and bytes Ray scheduled this task or actor with."""

    gpu: str
    bytes: int

    @property
    def resource(self) -> str:
        return resource_name(self.gpu)


@attrs.frozen
class LocalGPU:
    """Where a scheduled GPU is on this node."""

    backend: str
    device: int  # the CUDA ordinal this process uses for it (host: the device number)
    socket_path: str


def scheduled() -> Scheduled:
    """Raises :class:`WorkerBindingError` outside a task or actor placed by ``gms.ray``."""
    import ray

    if not ray.is_initialized() or ray.get_runtime_context().worker.mode != ray.WORKER_MODE:
        raise WorkerBindingError("gms.ray.scheduled() is for inside a Ray task or actor")
    assigned = ray.get_runtime_context().get_assigned_resources()
    mine = [(gpu_of(name), amount) for name, amount in assigned.items() if gpu_of(name)]
    if not mine:
        raise WorkerBindingError(
            "this task or actor was not scheduled with GPU memory: submit it through "
            "gms.ray.remote(gpu_memory=...) or .options(**gms.ray.options(gpu_memory=...))"
        )
    if len(mine) > 1:
        raise WorkerBindingError(f"scheduled on several GPUs at once ({[g for g, _ in mine]})")
    gpu, amount = mine[0]
    return Scheduled(gpu, round(amount))  # Ray hands back floats; the books are whole bytes


def locate(gpu: str) -> LocalGPU:
    """This node's device and gms socket for ``gpu``; raises if the GPU is not here."""
    name = parse_gpu(gpu)
    if name.backend == "host":
        if host_gpu(name.device, paths.socket_dir()) != gpu:
            raise WorkerBindingError(
                f"GPU {gpu} is not served from this node's GMS_SOCKET_DIR "
                f"({paths.socket_dir()}): start the raylet with the GMS_SOCKET_DIR its "
                "`gms ray-resources` ran with"
            )
        return LocalGPU("host", name.device, _core.server_socket(name.device, "host"))
    return LocalGPU("cuda", (device := _cuda_ordinal(name.uuid)), _core.server_socket(device, "cuda"))


def _cuda_ordinal(uuid: str) -> int:
    from ..cuda import cuda_device_count
    from ..cuda.vmm import device_uuid

    for ordinal in range(cuda_device_count()):
        if device_uuid(ordinal) == uuid:
            return ordinal
    raise WorkerBindingError(
        f"GPU {uuid} is not visible to this worker (CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); if Ray emptied it, unset "
        "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"
    )


def default_layout() -> str:
    """A layout of this worker's own: ``ray-<actor id>`` in an actor, ``ray-<task id>`` in a task."""
    import ray

    ctx = ray.get_runtime_context()
    return f"ray-{(ctx.get_actor_id() or ctx.get_task_id())[:16]}"


def connect(
    lock_type: RequestedLockType | str = RequestedLockType.RW,
    *,
    layout: str | None = None,
    timeout_ms: int | None = None,
) -> GMSClientMemoryManager:
    """A manager of ``layout`` on this worker's scheduled GPU, connected with
    ``limit_bytes`` = the scheduled bytes.  ``layout`` defaults to one of this
    worker's own (:func:`default_layout`), so workers sharing a GPU never wait
    on each other's lock."""
    mine = scheduled()
    where = locate(mine.gpu)
    return _core.open_session(
        where.socket_path,
        device=where.device,
        layout=layout or default_layout(),
        lock_type=lock_type,
        timeout_ms=timeout_ms,
        limit_bytes=mine.bytes,
    )
