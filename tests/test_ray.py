"""gms.ray on a real local Ray cluster whose nodes' GPUs are real gms servers.

One cluster for the module (Ray takes seconds to start a node): a head node
with two "GPUs" of 24 GB and 40 GB, and a second node with one of 80 GB.
Each GPU is a ``gms serve --backend host --host-capacity`` process; each node
has its own ``GMS_SOCKET_DIR`` (given to its raylet, so to its workers too),
and advertises what ``gms ray-resources`` prints there, as ``ray start``
would.  Tests that need the core's per-session byte limits skip until the
client has ``connect(limit_bytes=)``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

ray = pytest.importorskip("ray", reason="gms.ray needs Ray: pip install 'gms[ray]'")

import gms.ray
from gms.ray import _core, placement
from gms.ray.errors import GPUMemoryRequestError, NoGPUFitsError, WorkerBindingError

from .helpers import wait_until
from .ray_probe import Probe

GB = 10**9
OBJECT_STORE = 75 << 20  # Ray's smallest useful object store: these tests move no data
NODES = {"head": [24 * GB, 40 * GB], "second": [80 * GB]}

# -- the cluster -----------------------------------------------------------------


def _start_gms(socket_dir: str, device: int, capacity: int, log) -> subprocess.Popen:
    env = {**os.environ, "GMS_SOCKET_DIR": socket_dir}
    return subprocess.Popen(
        [sys.executable, "-m", "gms", "serve", "--backend", "host", "--device", str(device),
         "--host-capacity", str(capacity), "--log-level", "warning"],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )


def _ray_resources(socket_dir: str, devices: int) -> dict[str, int]:
    """What the node would pass to ``ray start --resources``."""
    env = {**os.environ, "GMS_SOCKET_DIR": socket_dir}
    out = subprocess.run(
        [sys.executable, "-m", "gms", "ray-resources", "--backend", "host",
         "--devices", ",".join(map(str, range(devices)))],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from ray.cluster_utils import Cluster

    root = tmp_path_factory.mktemp("ray")
    servers, dirs = [], {}
    log = open(root / "gms.log", "wb")
    for node, sizes in NODES.items():
        dirs[node] = str(root / node)
        os.mkdir(dirs[node])
        servers += [_start_gms(dirs[node], device, size, log) for device, size in enumerate(sizes)]
    cluster = None
    try:
        for node, sizes in NODES.items():
            for device in range(len(sizes)):
                path = _core.server_socket(device, "host", directory=dirs[node])
                wait_until(lambda p=path: os.path.exists(p), timeout=30, what=path)
        resources = {node: _ray_resources(dirs[node], len(sizes)) for node, sizes in NODES.items()}
        node_args = {"num_cpus": 1, "object_store_memory": OBJECT_STORE}
        cluster = Cluster(
            initialize_head=True,
            head_node_args=dict(
                **node_args, include_dashboard=False, resources=resources["head"],
                env_vars={"GMS_SOCKET_DIR": dirs["head"]},
            ),
        )
        second = cluster.add_node(
            **node_args, resources=resources["second"], env_vars={"GMS_SOCKET_DIR": dirs["second"]}
        )
        ray.init(address=cluster.address, log_to_driver=False)
        names = {}
        for node, sizes in NODES.items():
            for (resource, size) in resources[node].items():
                names[size] = resource.removeprefix(gms.ray.RESOURCE_PREFIX)
        yield {
            "gpu": {24: names[24 * GB], 40: names[40 * GB], 80: names[80 * GB]},
            "resources": resources,
            "node": {"head": cluster.head_node.node_id, "second": second.node_id},
            "dirs": dirs,
        }
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        for server in servers:
            server.terminate()
        for server in servers:
            server.wait(30)
        log.close()


def ray_free(gpu: str) -> int:
    """Bytes Ray's books show free on ``gpu`` (not counting this process's recent picks)."""
    return int(ray.available_resources().get(gms.ray.resource_name(gpu), 0))


def ray_total(gpu: str) -> int:
    return int(ray.cluster_resources().get(gms.ray.resource_name(gpu), 0))


@pytest.fixture
def actors(cluster):
    """Actors a test made; killed after it, and Ray's books checked back to full."""
    placement._recent.clear()  # earlier tests' picks must not steer this one's
    made: list = []
    yield made
    for actor in made:
        ray.kill(actor)
    for gpu in cluster["gpu"].values():
        wait_until(lambda g=gpu: ray_free(g) == ray_total(g), timeout=30, what=f"{gpu} released")


probe = gms.ray.remote(gpu_memory="1GB", num_cpus=0, max_restarts=0)(Probe)


@gms.ray.remote(gpu_memory="30GB", num_cpus=0, max_retries=0)
def where_task() -> dict:
    return Probe().where()


@ray.remote(num_cpus=0, max_retries=0)
def unscheduled_task() -> str:
    try:
        gms.ray.scheduled()
    except WorkerBindingError as exc:
        return str(exc)
    return "scheduled"


def start(actors: list, remote, *args) -> object:
    actor = remote.remote(*args)
    actors.append(actor)
    return actor


# -- the node side ---------------------------------------------------------------


def test_each_gpu_is_one_resource_of_its_gms_budget_in_bytes(cluster):
    gpu = cluster["gpu"]
    assert cluster["resources"]["head"] == {
        gms.ray.resource_name(gpu[24]): 24 * GB,
        gms.ray.resource_name(gpu[40]): 40 * GB,
    }
    assert cluster["resources"]["second"] == {gms.ray.resource_name(gpu[80]): 80 * GB}
    # Ray holds them to the byte, on the node that advertised them.
    by_node = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    assert by_node[cluster["node"]["head"]][gms.ray.resource_name(gpu[40])] == 40 * GB
    assert by_node[cluster["node"]["second"]][gms.ray.resource_name(gpu[80])] == 80 * GB
    views = {v.gpu: v for v in gms.ray.gpus()}
    assert {g: v.total_bytes for g, v in views.items()} == {gpu[24]: 24 * GB, gpu[40]: 40 * GB, gpu[80]: 80 * GB}
    assert views[gpu[80]].node_id == cluster["node"]["second"]


# -- placement by bytes ----------------------------------------------------------


def test_a_request_lands_only_on_a_gpu_that_holds_it(cluster, actors):
    gpu = cluster["gpu"]
    # 30 GB fits the 40 GB and 80 GB GPUs, never the 24 GB one; each task finds its
    # GPU's own gms server on the node it landed on.
    seen = ray.get([where_task.remote() for _ in range(4)], timeout=60)
    for where in seen:
        assert where["gpu"] in (gpu[40], gpu[80])
        assert where["bytes"] == 30 * GB
        node = "second" if where["gpu"] == gpu[80] else "head"
        assert where["node"] == cluster["node"][node]
        assert where["socket_dir"] == cluster["dirs"][node]
        assert where["server_budget"] == ray_total(where["gpu"])
    # 50 GB fits only the 80 GB GPU.
    big = ray.get(where_task.options(gpu_memory="50GB").remote(), timeout=60)
    assert big["gpu"] == gpu[80] and big["node"] == cluster["node"]["second"]


def test_the_same_bytes_are_a_different_share_of_each_gpu(cluster, actors):
    gpu = cluster["gpu"]
    # The seed's example: 20 GB is half a 40 GB GPU and a quarter of an 80 GB one.
    on40 = gms.ray.place("20GB", gpu=gpu[40])
    on80 = gms.ray.place("20GB", gpu=gpu[80])
    assert (on40.fraction, on80.fraction) == (0.5, 0.25)
    assert on40.scheduled_bytes == on80.scheduled_bytes == 20 * GB
    # Its rounding: 10 MB is 0.0003 of the 40 GB GPU (12 MB) and 0.0002 of the 80 GB one (16 MB).
    small40, small80 = gms.ray.place("10MB", gpu=gpu[40]), gms.ray.place("10MB", gpu=gpu[80])
    assert (small40.fraction, small40.scheduled_bytes) == (0.0003, 12 * 10**6)
    assert (small80.fraction, small80.scheduled_bytes) == (0.0002, 16 * 10**6)
    # place() only asks: it counts nothing against the GPUs.
    assert all(v.available_bytes == v.ray_available_bytes for v in gms.ray.gpus())
    # Ray books exactly the rounded bytes.
    a = start(actors, probe.options(gpu_memory="10MB", gpu=gpu[40]))
    b = start(actors, probe.options(gpu_memory="10MB", gpu=gpu[80]))
    assert ray.get(a.where.remote(), timeout=60)["bytes"] == 12 * 10**6
    assert ray.get(b.where.remote(), timeout=60)["bytes"] == 16 * 10**6
    wait_until(lambda: ray_free(gpu[40]) == 40 * GB - 12 * 10**6, what="40 GB GPU booked")
    wait_until(lambda: ray_free(gpu[80]) == 80 * GB - 16 * 10**6, what="80 GB GPU booked")


def test_workers_of_different_sizes_share_one_gpu(cluster, actors):
    gpu = cluster["gpu"][80]
    sizes = [10 * GB, 20 * GB, 30 * GB]
    sharing = [start(actors, probe.options(gpu_memory=size, gpu=gpu)) for size in sizes]
    seen = ray.get([a.where.remote() for a in sharing], timeout=60)
    assert [w["bytes"] for w in seen] == sizes
    assert {w["gpu"] for w in seen} == {gpu}
    assert {w["socket"] for w in seen} == {seen[0]["socket"]}  # one gms server for all three
    wait_until(lambda: ray_free(gpu) == 20 * GB, what="80 GB GPU booked 60 GB")
    # Ray never promises the GPU past its bytes: 30 GB more waits ...
    waiting = start(actors, probe.options(gpu_memory="30GB", gpu=gpu))
    ready, _ = ray.wait([waiting.where.remote()], timeout=2)
    assert not ready
    # ... until a neighbour leaves.
    ray.kill(sharing[1])
    assert ray.get(waiting.where.remote(), timeout=60)["bytes"] == 30 * GB


def test_a_burst_of_requests_spreads_over_the_gpus_that_hold_them(cluster, actors):
    # Submitted faster than Ray's books change: without counting its own recent picks,
    # every one would pick the best fit at the time, the 24 GB GPU, and three would wait.
    burst = [start(actors, probe.options(gpu_memory="20GB")) for _ in range(4)]
    seen = ray.get([a.where.remote() for a in burst], timeout=60)
    per_gpu = {}
    for where in seen:
        per_gpu[where["gpu"]] = per_gpu.get(where["gpu"], 0) + 1
    gpu = cluster["gpu"]
    assert per_gpu.get(gpu[24], 0) <= 1 and per_gpu.get(gpu[40], 0) <= 2
    assert sum(per_gpu.values()) == 4


def test_a_pick_ray_already_booked_is_not_counted_twice(cluster, actors):
    gpu = cluster["gpu"]
    first = start(actors, probe.options(gpu_memory="50GB"))
    assert ray.get(first.where.remote(), timeout=60)["gpu"] == gpu[80]
    wait_until(lambda: ray_free(gpu[80]) == 30 * GB, what="Ray's books show the 50 GB")
    # Best fit is now the 80 GB GPU's last 30 GB, unless the 50 GB counted twice.
    second = start(actors, probe.options(gpu_memory="30GB"))
    assert ray.get(second.where.remote(), timeout=60)["gpu"] == gpu[80]


def test_bytes_come_back_to_ray_when_a_worker_exits_or_crashes(cluster, actors):
    gpu = cluster["gpu"][40]
    leaving = start(actors, probe.options(gpu_memory="15GB", gpu=gpu))
    crashing = start(actors, probe.options(gpu_memory="25GB", gpu=gpu))
    ray.get([leaving.where.remote(), crashing.where.remote()], timeout=60)
    wait_until(lambda: ray_free(gpu) == 0, what="40 GB GPU full")
    leaving.exit.remote()
    wait_until(lambda: ray_free(gpu) == 15 * GB, timeout=30, what="15 GB back after exit")
    crashing.crash.remote()
    wait_until(lambda: ray_free(gpu) == 40 * GB, timeout=30, what="25 GB back after crash")


# -- requests that cannot be made ------------------------------------------------


def test_a_request_that_fits_nowhere_fails_at_once(cluster):
    started = time.monotonic()
    with pytest.raises(NoGPUFitsError, match="fits on no GPU") as caught:
        where_task.options(gpu_memory="81GB").remote()
    assert time.monotonic() - started < 10  # an answer, not a wait in Ray's queue
    assert caught.value.largest_bytes == 80 * GB
    assert cluster["gpu"][80] in str(caught.value)
    with pytest.raises(NoGPUFitsError, match="fits on no GPU"):
        gms.ray.place("30GB", gpu=cluster["gpu"][24])
    with pytest.raises(NoGPUFitsError, match="no live node advertises"):
        gms.ray.place("1GB", gpu="GPU-00000000-0000-0000-0000-000000000000")
    with pytest.raises(NoGPUFitsError, match="accelerator type 'A100'"):
        gms.ray.options("1GB", accelerator_type="A100")


def test_num_gpus_and_gpu_memory_together_are_refused():
    with pytest.raises(ValueError, match="mutually exclusive"):
        gms.ray.remote(gpu_memory="20GB", num_gpus=0.5)(Probe)
    with pytest.raises(ValueError, match="mutually exclusive"):
        gms.ray.options("20GB", num_gpus=1)
    with pytest.raises(ValueError, match="mutually exclusive"):
        probe.options(num_gpus=0.25)
    with pytest.raises(GPUMemoryRequestError, match="gms.ray's own"):
        gms.ray.options("20GB", resources={gms.ray.resource_name("GPU-x"): 1})
    with pytest.raises(ValueError, match="not a byte count"):
        gms.ray.remote(gpu_memory="20G")(Probe)


def test_outside_a_gms_ray_worker_there_is_nothing_to_bind(cluster):
    assert "not scheduled with GPU memory" in ray.get(unscheduled_task.remote(), timeout=60)
    with pytest.raises(WorkerBindingError, match="inside a Ray task or actor"):
        gms.ray.scheduled()


# -- enforcement by gms (the core's session limits) ------------------------------


MiB = 1 << 20


def test_a_worker_cannot_allocate_past_its_scheduled_bytes(cluster, actors):
    # 64 MiB on the 40 GB GPU rounds to 17/10,000 of it: 68,000,000 bytes.
    worker = start(actors, probe.options(gpu_memory="64MiB", gpu=cluster["gpu"][40]))
    assert ray.get(worker.where.remote(), timeout=60)["bytes"] == 68_000_000
    within, past = ray.get(worker.allocate.remote([64 * MiB, 4 * MiB]), timeout=60)
    assert within == "ok"
    assert past["scope"] == "session" and past["quota"] == 68_000_000
    assert past["used"] + past["asked"] > past["quota"]


def test_the_quota_error_reaches_the_driver_as_itself(cluster, actors):
    # Ray pickles an actor's exception to the driver; an error that cannot be
    # rebuilt from its pickle arrives as ray.exceptions.UnserializableException.
    worker = start(actors, probe.options(gpu_memory="8MiB", gpu=cluster["gpu"][24]))
    with pytest.raises(gms.QuotaExceededError) as caught:
        ray.get(worker.allocate_raising.remote(64 * MiB), timeout=60)
    assert caught.value.scope == "session" and caught.value.asked >= 64 * MiB


def test_workers_share_a_gpu_through_one_server_each_held_to_its_bytes(cluster, actors):
    gpu = cluster["gpu"][80]
    sizes = [32 * MiB, 64 * MiB, 128 * MiB]
    workers = [start(actors, probe.options(gpu_memory=size, gpu=gpu)) for size in sizes]
    outcomes = ray.get([w.allocate.remote([size]) for w, size in zip(workers, sizes)], timeout=60)
    assert outcomes == [["ok"], ["ok"], ["ok"]]
    socket = ray.get(workers[0].where.remote(), timeout=60)["socket"]
    assert _core.used_bytes(_core.read_state(socket)) >= sum(sizes)
    # One going past its bytes is refused; its neighbours keep theirs.
    (refused,) = ray.get(workers[0].allocate.remote([32 * MiB]), timeout=60)
    assert refused["scope"] == "session"
    assert ray.get(workers[2].allocate.remote([]), timeout=60) == []


def test_gms_frees_a_workers_memory_when_it_exits_or_crashes(cluster, actors):
    gpu = cluster["gpu"][24]
    for end in ("exit", "crash"):
        worker = start(actors, probe.options(gpu_memory="64MiB", gpu=gpu))
        socket = ray.get(worker.where.remote(), timeout=60)["socket"]
        before = _core.used_bytes(_core.read_state(socket))
        assert ray.get(worker.allocate.remote([32 * MiB]), timeout=60) == ["ok"]
        assert _core.used_bytes(_core.read_state(socket)) >= before + 32 * MiB
        getattr(worker, end).remote()
        wait_until(lambda s=socket, b=before: _core.used_bytes(_core.read_state(s)) == b,
                   timeout=30, what=f"gms frees the memory after {end}")
