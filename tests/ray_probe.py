"""A Ray actor (or task body) that reports where gms.ray placed it, and uses its memory.

Shared by the Ray tests; outcomes come back as data, so nothing depends on
exceptions crossing Ray's process boundary.
"""

from __future__ import annotations

import os

import ray

import gms.ray
from gms.ray import _core
from gms.ray.errors import WorkerBindingError


class Probe:
    """A worker that reports where it landed and what it was scheduled with."""

    def where(self) -> dict:
        mine = gms.ray.scheduled()
        local = gms.ray.locate(mine.gpu)
        state = _core.read_state(local.socket_path)
        return {
            "gpu": mine.gpu,
            "bytes": mine.bytes,
            "node": ray.get_runtime_context().get_node_id(),
            "socket_dir": os.environ.get("GMS_SOCKET_DIR"),
            "socket": local.socket_path,
            "device": local.device,
            "server_budget": _core.budget_bytes(state),
        }

    def allocate(self, sizes: list[int], layout: str | None = None) -> list:
        """Connect bound to the scheduled bytes and allocate; each outcome as data."""
        if not hasattr(self, "memory"):
            self.memory = gms.ray.connect(layout=layout)
        quota_error = gms.QuotaExceededError
        out = []
        for size in sizes:
            try:
                self.memory.allocate_handle(size, tag="ray")
                out.append("ok")
            except quota_error as exc:
                out.append({"scope": exc.scope, "quota": exc.quota, "used": exc.used, "asked": exc.asked})
        return out

    def connect_error(self) -> str:
        try:
            gms.ray.connect()
        except WorkerBindingError as exc:
            return str(exc)
        return "connected"

    def crash(self) -> None:
        os._exit(1)

    def exit(self) -> None:
        ray.actor.exit_actor()

    def roundtrip(self, size: int, data: bytes) -> bytes:
        """Allocate ``size`` within the scheduled bytes, map it, write and read back."""
        if not hasattr(self, "memory"):
            self.memory = gms.ray.connect()
        allocation_id, _ = self.memory.allocate_handle(size, tag="ray")
        va = self.memory.create_mapping(allocation_id)
        self.memory.write(va, data)
        return self.memory.read(va, len(data))

    def allocate_raising(self, size: int) -> None:
        """Allocate and let any error travel back through Ray as it is."""
        if not hasattr(self, "memory"):
            self.memory = gms.ray.connect()
        self.memory.allocate_handle(size, tag="ray")
