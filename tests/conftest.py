import os

import pytest
from hypothesis import HealthCheck, settings

from gms.cuda import cuda_device_count

from .helpers import ServerProcess

# "ci": what CI and the README's test command run (at least 300 examples of 50
# steps for the core machine).  "dev": a quick local loop.
settings.register_profile(
    "ci",
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", parent=settings.get_profile("ci"), max_examples=50)
settings.load_profile(os.environ.get("GMS_HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if cuda_device_count() > 0:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (none found)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Suites that do not depend on how memory is made run on every backend.
BACKENDS = ["host", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def start_server(tmp_path, backend):
    """Start real servers (subprocesses) on the parametrized backend."""
    started: list[ServerProcess] = []

    def start(*args: str, backend_override: str | None = None, socket_path: str | None = None) -> ServerProcess:
        server = ServerProcess(tmp_path, *args, backend=backend_override or backend, socket_path=socket_path)
        started.append(server)
        return server

    yield start
    for server in started:
        server.kill()


@pytest.fixture
def server(start_server) -> ServerProcess:
    return start_server()
