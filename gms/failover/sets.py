"""Engine sets: one engine per rank, started, watched and restarted together.

Two kinds, one interface (:class:`EngineSet`):

* :class:`LocalProcessSet`: processes the coordinator spawns from a command
  template, one per rank or one over every rank (tensor parallel), each in
  a process group of its own.  Restart = SIGKILL every engine's group, then
  start them all again.  A process's exit is noticed at once (a task awaits
  each one).
* :class:`KubernetesPodSet`: pods found by label selector, one per rank or
  one over every rank (a rank label names the rank).  Restart = delete the
  set's pods; their controller (a StatefulSet, say) recreates them.  Thin on purpose: it lists
  and deletes pods through the official client, nothing more.  Its pods run
  ``GMS_MODE=shadow`` always (a pod spec cannot follow the roles as they
  swap); the coordinator wakes whichever set holds the serving lock.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
from collections.abc import Callable
from typing import Protocol

import trio

from .config import KubernetesSetConfig, LocalSetConfig

log = logging.getLogger("gms.failover")


class EngineSet(Protocol):
    name: str

    def urls(self) -> list[str]:
        """Each rank's engine endpoint, by rank (current as of the last refresh)."""
        ...

    def dead(self) -> list[int]:
        """Ranks whose engine is known to be gone."""
        ...

    async def refresh(self) -> None:
        """Look again at what runs (pods); a no-op where exits are noticed at once."""
        ...

    async def start(self, mode: str) -> None:
        """Bring up every rank (``GMS_MODE=mode`` where the set controls it)."""
        ...

    async def kill(self) -> None:
        """Take every rank down, at once and without grace."""
        ...

    async def stop(self) -> None:
        """Shut down at the coordinator's exit (local processes only)."""
        ...


# -- local processes -------------------------------------------------------------


class LocalProcessSet:
    """One process per engine: per rank, or one over every rank (one port).
    Each engine is a process group of its own (its workers, an engine core,
    a scheduler are its children), so a kill takes the whole engine down,
    not only the process the coordinator started."""

    def __init__(self, config: LocalSetConfig, sockets: tuple[str, ...], nursery: trio.Nursery,
                 on_exit: Callable[[str, int, int], None]) -> None:
        self.name = config.name
        self.config = config
        self.sockets = sockets
        self._nursery = nursery
        self._on_exit = on_exit
        self._procs: dict[int, trio.Process] = {}
        self._gone: set[int] = set()  # leaders' pids whose groups are empty
        self._generation = 0

    def fields(self, engine: int) -> dict[str, object]:
        """The placeholders of engine ``engine``: its rank (the first of its
        ranks), the world size, its port and its rank's socket."""
        return {"rank": engine, "world_size": len(self.sockets), "port": self.config.ports[engine],
                "socket": self.sockets[engine], "set": self.name}

    def urls(self) -> list[str]:
        return [f"http://{self.config.host}:{port}" for port in self.config.ports]

    def dead(self) -> list[int]:
        return [rank for rank, proc in sorted(self._procs.items()) if proc.returncode is not None]

    def pids(self) -> list[int]:
        return [proc.pid for _, proc in sorted(self._procs.items())]

    async def refresh(self) -> None:
        pass

    async def start(self, mode: str) -> None:
        self._generation += 1
        for rank in range(len(self.config.ports)):
            fields = self.fields(rank)
            argv = [part.format(**fields) for part in self.config.command]
            env = {**os.environ, **{k: v.format(**fields) for k, v in self.config.env}, "GMS_MODE": mode}
            out = subprocess.DEVNULL
            if self.config.log_dir:
                os.makedirs(self.config.log_dir, exist_ok=True)
                path = os.path.join(self.config.log_dir, f"{self.name}-rank{rank}.log")
                out = await trio.to_thread.run_sync(open, path, "ab")
            try:
                proc = await trio.lowlevel.open_process(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                                        start_new_session=True)
            finally:
                if out is not subprocess.DEVNULL:
                    out.close()  # the child has its own copy
            log.info("set %s rank %d: started pid %d (GMS_MODE=%s)", self.name, rank, proc.pid, mode)
            self._procs[rank] = proc
            self._nursery.start_soon(self._watch, rank, proc, self._generation)

    async def _watch(self, rank: int, proc: trio.Process, generation: int) -> None:
        code = await proc.wait()
        if generation == self._generation:  # not one we killed to restart
            log.warning("set %s rank %d: pid %d exited with %d", self.name, rank, proc.pid, code)
            self._on_exit(self.name, rank, code)

    async def kill(self) -> None:
        self._generation += 1  # their exits are expected now
        for proc in self._procs.values():
            self._signal_group(proc, signal.SIGKILL)  # SIGKILL also ends a stopped (SIGSTOP) process
        for proc in self._procs.values():
            await proc.wait()

    async def stop(self, grace_s: float = 10.0) -> None:
        self._generation += 1
        for proc in self._procs.values():
            self._signal_group(proc, signal.SIGTERM)
        with trio.move_on_after(grace_s):
            for proc in self._procs.values():
                await proc.wait()
        await self.kill()

    def _signal_group(self, proc: trio.Process, sig: int) -> None:
        """Signal an engine's whole process group, its leader gone or not (a
        SIGKILLed API server leaves an engine core and workers behind).  The
        group's id is the leader's pid, which no new process can take while
        any member lives; a group found empty is not signalled again (the
        number may then be reused)."""
        if proc.pid in self._gone:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            self._gone.add(proc.pid)


# -- Kubernetes pods -------------------------------------------------------------
# Pods are handled as the API's own JSON (camelCase, as the Kubernetes API
# reference documents a Pod), so the logic below is plain data in, data out.


def pod_rank(pod: dict, rank_label: str) -> int | None:
    value = pod.get("metadata", {}).get("labels", {}).get(rank_label)
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def pod_running(pod: dict) -> bool:
    """Running, has an address, is not being deleted, and no container has terminated."""
    meta, status = pod.get("metadata", {}), pod.get("status", {})
    if meta.get("deletionTimestamp") or status.get("phase") != "Running" or not status.get("podIP"):
        return False
    return not any("terminated" in (c.get("state") or {}) for c in status.get("containerStatuses") or ())


def pods_by_rank(pods: list[dict], rank_label: str, world_size: int) -> dict[int, dict]:
    """One pod per rank: a live one if any, else the newest."""
    out: dict[int, dict] = {}
    for pod in sorted(pods, key=lambda p: p.get("metadata", {}).get("creationTimestamp") or ""):
        rank = pod_rank(pod, rank_label)
        if rank is None or not 0 <= rank < world_size:
            continue
        if rank not in out or pod_running(pod) or not pod_running(out[rank]):
            out[rank] = pod
    return out


class KubernetesPodSet:
    def __init__(self, config: KubernetesSetConfig) -> None:
        from kubernetes import client
        from kubernetes import config as kube_config

        try:
            kube_config.load_incluster_config()
        except kube_config.ConfigException:
            kube_config.load_kube_config()
        self.name = config.name
        self.config = config
        self.engines = config.engines  # pods: one per rank, or one over every rank
        self._api = client.CoreV1Api()
        self._pods: dict[int, dict] = {}
        self._killed: set[str] = set()

    def urls(self) -> list[str]:
        return [f"http://{self._pods[r]['status'].get('podIP')}:{self.config.port}" if r in self._pods else ""
                for r in range(self.engines)]

    def dead(self) -> list[int]:
        return [r for r in range(self.engines)
                if r not in self._pods or not pod_running(self._pods[r])
                or self._pods[r]["metadata"].get("uid") in self._killed]

    async def refresh(self) -> None:
        def list_pods() -> list[dict]:
            response = self._api.list_namespaced_pod(self.config.namespace, label_selector=self.config.selector,
                                                     _preload_content=False)
            return json.loads(response.data)["items"]

        pods = await trio.to_thread.run_sync(list_pods)
        fresh = [p for p in pods if p["metadata"].get("uid") not in self._killed]
        self._pods = pods_by_rank(fresh, self.config.rank_label, self.engines)

    async def start(self, mode: str) -> None:
        """Wait for a live pod on every rank (the controller recreates deleted ones)."""
        while True:
            await self.refresh()
            if not self.dead():
                return
            await trio.sleep(1.0)

    async def kill(self) -> None:
        await self.refresh()
        pods = list(self._pods.values())

        def delete(pod: dict) -> None:
            self._api.delete_namespaced_pod(pod["metadata"]["name"], self.config.namespace, grace_period_seconds=0)

        async with trio.open_nursery() as nursery:
            for pod in pods:
                self._killed.add(pod["metadata"]["uid"])
                log.info("set %s: deleting pod %s", self.name, pod["metadata"]["name"])
                nursery.start_soon(trio.to_thread.run_sync, delete, pod)

    async def stop(self) -> None:
        pass  # pods belong to their controller, not to the coordinator
