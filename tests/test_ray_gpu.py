"""gms.ray on a real GPU: a one-node Ray cluster placing by bytes, gms holding to them.

Skips without Ray (docs/ray.md says how its wheel reached the offline GPU host).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gms.ray import _core

from .helpers import wait_until

ray = pytest.importorskip("ray", reason="gms.ray needs Ray: pip install 'gms[ray]'")

import gms.ray

from .ray_probe import Probe

pytestmark = pytest.mark.gpu

MiB, GiB = 1 << 20, 1 << 30


def test_placement_and_enforcement_on_a_real_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("GMS_SOCKET_DIR", str(tmp_path))  # the raylet, so its workers, inherit it
    log = open(tmp_path / "gms.log", "wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "gms", "serve", "--backend", "cuda", "--device", "0", "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        path = _core.server_socket(0, "cuda")
        wait_until(lambda: os.path.exists(path), timeout=60, what=path)
        out = subprocess.run([sys.executable, "-m", "gms", "ray-resources", "--backend", "cuda", "--devices", "0"],
                             capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 0, out.stderr
        resources = json.loads(out.stdout)
        (resource, budget), = resources.items()
        uuid = _core.read_state(path).device_uuid
        assert resource == gms.ray.resource_name(uuid) and budget == _core.budget_bytes(_core.read_state(path))

        ray.init(num_cpus=1, num_gpus=0, resources=resources, object_store_memory=75 * MiB,
                 include_dashboard=False, log_to_driver=False)
        try:
            placed = gms.ray.place("2GiB")
            assert placed.gpu == uuid
            assert placed.scheduled_bytes >= 2 * GiB and placed.fraction == placed.rounded.units / 10_000
            worker = gms.ray.remote(gpu_memory="2GiB", num_cpus=0, max_restarts=0)(Probe).remote()
            where = ray.get(worker.where.remote(), timeout=120)
            assert where["gpu"] == uuid and where["socket"] == path
            before = _core.used_bytes(_core.read_state(path))
            data = os.urandom(1 << 16)
            assert ray.get(worker.roundtrip.remote(GiB, data), timeout=120) == data  # real device memory
            past = ray.get(worker.allocate.remote([GiB + 512 * MiB]), timeout=120)
            assert past[0]["scope"] == "session" and past[0]["quota"] == where["bytes"]
            wait_until(lambda: int(ray.available_resources().get(resource, 0)) == budget - where["bytes"],
                       what="Ray books the scheduled bytes")
            worker.crash.remote()
            wait_until(lambda: _core.used_bytes(_core.read_state(path)) == before, timeout=60,
                       what="gms frees the crashed worker's memory")
            wait_until(lambda: int(ray.available_resources().get(resource, 0)) == budget, timeout=60,
                       what="Ray releases the crashed worker's bytes")
        finally:
            ray.shutdown()
    finally:
        server.terminate()
        server.wait(30)
        log.close()
