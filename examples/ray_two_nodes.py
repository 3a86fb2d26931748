"""The seed's example on one machine: a Ray cluster of a 40 GB node and an 80 GB node.

    python examples/ray_two_nodes.py

Each node's "GPU" is a real gms server on the host backend (``gms serve
--backend host --host-capacity ...``) in the node's own GMS_SOCKET_DIR; each
node advertises what ``gms ray-resources`` prints there, as ``ray start
--resources`` would.  The driver then asks for GPU memory by bytes.
docs/ray.md shows this script's output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import ray
from ray.cluster_utils import Cluster

import gms.ray
from gms.ray import _core

GB = 10**9
NODES = {"node-40": 40 * GB, "node-80": 80 * GB}


class Worker:
    def where(self) -> str:
        mine = gms.ray.scheduled()  # the GPU and bytes Ray scheduled this actor with
        return f"{mine.bytes / GB:g} GB on {mine.gpu}"

    def allocate_past_its_bytes(self) -> str:
        memory = gms.ray.connect()  # limit_bytes = the scheduled bytes
        limit = gms.ray.scheduled().bytes
        memory.allocate_handle(limit // 2)
        try:
            memory.allocate_handle(limit)
        except gms.QuotaExceededError as exc:
            return f"QuotaExceededError: used {exc.used}, asked {exc.asked}, limit {exc.quota} ({exc.scope})"
        return "allocated past its bytes (not expected)"


def start_node_servers(root: str) -> tuple[list[subprocess.Popen], dict[str, dict]]:
    servers, resources = [], {}
    for node, capacity in NODES.items():
        env = {**os.environ, "GMS_SOCKET_DIR": os.path.join(root, node)}
        os.mkdir(env["GMS_SOCKET_DIR"])
        servers.append(subprocess.Popen(
            [sys.executable, "-m", "gms", "serve", "--backend", "host", "--host-capacity", str(capacity),
             "--log-level", "warning"], env=env))
        path = _core.server_socket(0, "host", directory=env["GMS_SOCKET_DIR"])
        while not os.path.exists(path):
            time.sleep(0.05)
        out = subprocess.run([sys.executable, "-m", "gms", "ray-resources", "--backend", "host"],
                             env=env, capture_output=True, text=True, check=True)
        print(f"{node}: gms ray-resources -> {out.stdout.strip()}")
        resources[node] = {"resources": json.loads(out.stdout), "env_vars": {"GMS_SOCKET_DIR": env["GMS_SOCKET_DIR"]}}
    return servers, resources


def books(gpu_names: dict[str, str]) -> str:
    free = ray.available_resources()
    return ", ".join(
        f"{node} {int(free.get(gms.ray.resource_name(gpu), 0)) / GB:g} of {NODES[node] / GB:g} GB free"
        for node, gpu in gpu_names.items()
    )


def main() -> None:
    root = tempfile.mkdtemp(prefix="gms-ray-")
    servers, nodes = start_node_servers(root)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "object_store_memory": 75 << 20, "include_dashboard": False, **nodes["node-40"]})
    cluster.add_node(num_cpus=1, object_store_memory=75 << 20, **nodes["node-80"])
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        gpu_names = {
            node: next(iter(spec["resources"])).removeprefix(gms.ray.RESOURCE_PREFIX)
            for node, spec in nodes.items()
        }
        print("\nThe same request is a different share of each GPU (gms.ray.place):")
        for ask in ("20GB", "10GB", "10MB"):
            for node, gpu in gpu_names.items():
                p = gms.ray.place(ask, gpu=gpu)
                print(f"  {ask:>5} on {node}: num_gpus {p.fraction:g}, Ray books {p.scheduled_bytes:,} bytes")

        print("\nActors by bytes (gms.ray.remote):")
        worker = gms.ray.remote(gpu_memory="20GB", num_cpus=0)(Worker)
        actors = []
        for ask in ("50GB", "30GB", "20GB", "10GB"):
            actors.append(worker.options(gpu_memory=ask).remote())
            print(f"  {ask:>5} -> {ray.get(actors[-1].where.remote())}")
        time.sleep(1)  # Ray's available counts follow grants within ~100 ms
        print(f"  Ray's books: {books(gpu_names)}")
        try:
            worker.options(gpu_memory="90GB").remote()
        except gms.ray.NoGPUFitsError as exc:
            print(f"  90GB -> NoGPUFitsError: {exc}")
        try:
            gms.ray.remote(gpu_memory="20GB", num_gpus=0.5)(Worker)
        except ValueError as exc:
            print(f"  20GB with num_gpus=0.5 -> ValueError: {exc}")

        print("\nInside an actor (gms.ray.connect):")
        print(f"  {ray.get(actors[-1].allocate_past_its_bytes.remote())}")
        for actor in actors:
            ray.kill(actor)
        time.sleep(1)
        print(f"  after the actors end, Ray's books: {books(gpu_names)}")
    finally:
        ray.shutdown()
        cluster.shutdown()
        for server in servers:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
