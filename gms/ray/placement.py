"""The driver side: ask Ray for bytes of one GPU's memory.

Ray's custom resources are per node, and a request cannot say "any one of
these resources", so the GPU is named at submission: :func:`place` reads
Ray's books (every ``gms_gpu_memory_<gpu>`` resource, total and available)
and picks one GPU; the task or actor then asks Ray for that GPU's resource.
Ray keeps the books and the queue: a GPU is never promised past its bytes,
and a request waits in Ray until its GPU has room.

The pick is the best fit: the GPU that would have the fewest bytes left,
among those with room now (large holes stay free for large requests); if
none has room now, the GPU closest to having it, among those large enough.
A request no GPU can ever hold raises :class:`NoGPUFitsError` at once
instead of waiting forever in Ray.

Ray's available counts lag a submission until the raylet grants it and
reports (about 100 ms).  So that a burst of submissions from one process does
not pick the same GPU over and over, the picks this process submitted count
against their GPU here until Ray's count shows them (or for
:data:`PENDING_S` seconds at most).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping

import attrs

from .errors import GPUMemoryRequestError, NoGPUFitsError
from .names import RESOURCE_PREFIX, gpu_of, resource_name
from .units import Rounded, format_size, parse_gpu_memory, round_to_gpu

PENDING_S = 5.0  # at most; Ray shows a granted request in its books within ~100 ms


@attrs.frozen
class GPUView:
    """One GPU as Ray's books show it."""

    gpu: str
    node_id: str
    total_bytes: int
    available_bytes: int  # Ray's count, less this process's picks Ray does not show yet
    ray_available_bytes: int  # Ray's count

    @property
    def resource(self) -> str:
        return resource_name(self.gpu)


@attrs.frozen
class Placement:
    """A request rounded to, and placed on, one GPU."""

    gpu: str
    node_id: str
    rounded: Rounded
    ray_available_bytes: int  # Ray's count for the GPU when placed

    @property
    def resource(self) -> str:
        return resource_name(self.gpu)

    @property
    def asked_bytes(self) -> int:
        return self.rounded.asked_bytes

    @property
    def scheduled_bytes(self) -> int:
        """What Ray books on the GPU, and the limit gms holds the worker to."""
        return self.rounded.scheduled_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.rounded.capacity_bytes

    @property
    def fraction(self) -> float:
        """The ``num_gpus`` this request is worth on this GPU (the seed's conversion)."""
        return self.rounded.fraction

    def resources(self) -> dict[str, int]:
        return {self.resource: self.scheduled_bytes}


@attrs.define
class _Unseen:
    ray_available: int  # Ray's count for the GPU before these picks were booked
    picks: deque  # (monotonic time, bytes), oldest first


class _RecentPicks:
    """Bytes this process submitted that Ray's books may not show yet.

    Per GPU: the picks not yet seen, oldest first, and Ray's available count
    before them.  When Ray's count drops, the oldest picks that the drop
    covers are taken as booked by Ray and forgotten (never counted twice); a
    pick Ray never showed is forgotten after :data:`PENDING_S` (a short task
    can come and go between two of Ray's reports).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gpus: dict[str, _Unseen] = {}

    def add(self, gpu: str, nbytes: int, ray_available: int) -> None:
        with self._lock:
            unseen = self._gpus.setdefault(gpu, _Unseen(ray_available, deque()))
            unseen.picks.append((time.monotonic(), nbytes))

    def pending(self, ray_available: Mapping[str, int]) -> dict[str, int]:
        """Bytes per GPU still unseen, given Ray's available counts now."""
        expired_before = time.monotonic() - PENDING_S
        out: dict[str, int] = {}
        with self._lock:
            for gpu, unseen in list(self._gpus.items()):
                now = ray_available.get(gpu, 0)
                booked = unseen.ray_available - now
                while unseen.picks and unseen.picks[0][1] <= booked:
                    booked -= unseen.picks.popleft()[1]
                expired = False
                while unseen.picks and unseen.picks[0][0] < expired_before:
                    unseen.picks.popleft()
                    expired = True
                if not unseen.picks:
                    del self._gpus[gpu]
                    continue
                # What is left counts from here: from Ray's count now if a pick
                # expired unseen or bytes came back (the count rose), else from
                # the count before the picks still unseen.
                unseen.ray_available = now if expired else now + max(booked, 0)
                out[gpu] = sum(nbytes for _, nbytes in unseen.picks)
        return out

    def clear(self) -> None:
        with self._lock:
            self._gpus.clear()


_recent = _RecentPicks()


def _accelerator_resource(accelerator_type: str) -> str:
    # What Ray turns ``accelerator_type=`` into (a node resource of its detected GPUs).
    return f"accelerator_type:{accelerator_type}"


def gpus(*, accelerator_type: str | None = None) -> list[GPUView]:
    """Every GPU that gms advertises to Ray on a live node, from Ray's books now."""
    import ray

    available = {  # Ray leaves out resources with none available
        gpu: int(amount) for name, amount in ray.available_resources().items() if (gpu := gpu_of(name))
    }
    pending = _recent.pending(available)
    views = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        resources: Mapping[str, float] = node.get("Resources", {})
        if accelerator_type and _accelerator_resource(accelerator_type) not in resources:
            continue
        for name, total in resources.items():
            gpu = gpu_of(name)
            if gpu is None:
                continue
            free = available.get(gpu, 0)
            views.append(GPUView(gpu, node["NodeID"], int(total), max(free - pending.get(gpu, 0), 0), free))
    return sorted(views, key=lambda v: v.gpu)


def _choose(asked: int, views: list[GPUView]) -> tuple[GPUView, Rounded] | None:
    candidates = [(v, round_to_gpu(asked, v.total_bytes)) for v in views]
    candidates = [(v, r) for v, r in candidates if r.fits]
    if not candidates:
        return None
    # Best fit (fewest bytes left over) by Ray's count less our unseen picks; then,
    # in case those are stale, by Ray's count alone; else wait in Ray where the
    # shortfall is smallest.
    for free in (lambda v: v.available_bytes, lambda v: v.ray_available_bytes):
        room = [(v, r) for v, r in candidates if r.scheduled_bytes <= free(v)]
        if room:
            return min(room, key=lambda c, f=free: (f(c[0]) - c[1].scheduled_bytes, c[0].gpu))
    return min(candidates, key=lambda c: (c[1].scheduled_bytes - c[0].ray_available_bytes, c[0].gpu))


def place(
    gpu_memory: int | str, *, gpu: str | None = None, accelerator_type: str | None = None
) -> Placement:
    """Round ``gpu_memory`` to a GPU of the cluster and pick that GPU.

    ``gpu`` pins a GPU by name (``gms.ray.gpus()`` lists them);
    ``accelerator_type`` keeps to nodes of that Ray accelerator type.
    A question only: nothing is booked until the request is submitted
    (:func:`options`, :func:`remote`).
    """
    asked = parse_gpu_memory(gpu_memory)
    views = gpus(accelerator_type=accelerator_type)
    if gpu is not None:
        views = [v for v in views if v.gpu == gpu]
        if not views:
            raise NoGPUFitsError(f"no live node advertises GPU {gpu!r}", asked, None)
    chosen = _choose(asked, views)
    if chosen is None:
        raise NoGPUFitsError(_unfit_message(asked, views, accelerator_type), asked,
                             max((v.total_bytes for v in views), default=None))
    view, rounded = chosen
    return Placement(view.gpu, view.node_id, rounded, view.ray_available_bytes)


def _unfit_message(asked: int, views: list[GPUView], accelerator_type: str | None) -> str:
    where = f"of accelerator type {accelerator_type!r} " if accelerator_type else ""
    if not views:
        return (
            f"gpu_memory={format_size(asked)}: no GPU {where}in this Ray cluster advertises "
            f"gms memory (resources {RESOURCE_PREFIX}*): start each node with "
            "`ray start --resources=\"$(gms ray-resources)\"`"
        )
    largest = max(views, key=lambda v: v.total_bytes)
    return (
        f"gpu_memory={format_size(asked)} fits on no GPU {where}in this Ray cluster: the largest, "
        f"{largest.gpu} on node {largest.node_id}, lends {format_size(largest.total_bytes)}"
    )


def _check_options(ray_options: Mapping) -> None:
    if ray_options.get("num_gpus"):
        raise GPUMemoryRequestError(
            "gpu_memory and num_gpus are mutually exclusive: gpu_memory already is a share of "
            "one GPU (its fraction differs from GPU to GPU)"
        )
    clash = [name for name in (ray_options.get("resources") or {}) if gpu_of(name)]
    if clash:
        raise GPUMemoryRequestError(f"resources {clash} are gms.ray's own: use gpu_memory")


def options(gpu_memory: int | str, *, gpu: str | None = None, **ray_options) -> dict:
    """Ray options (for ``.options(**...)``) asking for ``gpu_memory`` bytes of
    one GPU, placed now; ``ray_options`` pass through.  Submit them at once:
    this process counts them against the GPU until Ray's books show them."""
    _check_options(ray_options)
    placement = place(gpu_memory, gpu=gpu, accelerator_type=ray_options.get("accelerator_type"))
    _recent.add(placement.gpu, placement.scheduled_bytes, placement.ray_available_bytes)
    return {**ray_options, "resources": {**(ray_options.get("resources") or {}), **placement.resources()}}


_KEEP = object()


class GPUMemoryRemote:
    """A Ray remote function or actor class whose every call or instance asks
    for ``gpu_memory`` bytes of one GPU, placed when it is submitted."""

    def __init__(self, target, gpu_memory, gpu: str | None, ray_options: dict) -> None:
        import ray

        parse_gpu_memory(gpu_memory)  # refuse a bad request when it is written, not run
        _check_options(ray_options)
        self._target = target
        self._remote = target if _is_ray_remote(target) else ray.remote(target)
        self.gpu_memory = gpu_memory
        self.gpu = gpu
        self.ray_options = dict(ray_options)

    def options(self, *, gpu_memory=_KEEP, gpu=_KEEP, **ray_options) -> GPUMemoryRemote:
        return GPUMemoryRemote(
            self._remote,
            self.gpu_memory if gpu_memory is _KEEP else gpu_memory,
            self.gpu if gpu is _KEEP else gpu,
            {**self.ray_options, **ray_options},
        )

    def remote(self, *args, **kwargs):
        opts = options(self.gpu_memory, gpu=self.gpu, **self.ray_options)
        return self._remote.options(**opts).remote(*args, **kwargs)

    def __repr__(self) -> str:
        return f"gms.ray.remote(gpu_memory={self.gpu_memory!r})({self._remote!r})"


def _is_ray_remote(target) -> bool:
    from ray.actor import ActorClass
    from ray.remote_function import RemoteFunction

    return isinstance(target, RemoteFunction | ActorClass)


def remote(*, gpu_memory: int | str, gpu: str | None = None, **ray_options):
    """``@gms.ray.remote(gpu_memory="20GB", num_cpus=1)``: ``ray.remote`` by bytes
    of GPU memory.  Each ``.remote()`` call picks a GPU then (see :func:`place`)."""

    def wrap(target) -> GPUMemoryRemote:
        return GPUMemoryRemote(target, gpu_memory, gpu, ray_options)

    return wrap
