import os
import re
import resource

import pytest
from hypothesis import HealthCheck, settings

from gms.cuda import cuda_device_count

from .helpers import ServerProcess, shared_folder

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

# Some tests hold hundreds of fds at once, as a server does: allow what the hard
# limit allows (a user's login shell often sets the soft limit to 1024; gms
# serve raises its own the same way).
_soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if _soft < _hard:
    resource.setrlimit(resource.RLIMIT_NOFILE, (_hard, _hard))


# CI runs the README's test command as a newcomer would, without the optional
# packages, then again only what skipped for want of one, once installed
# (.ci/run): where $GMS_OPTIONAL_SKIPS names a file, each test (or module) that
# skipped because a package would not import is written there as
# "<package> <node id>".
_MISSING = re.compile(r"could not import '([\w.]+)'")


def _note_optional_skip(report) -> None:
    where = os.environ.get("GMS_OPTIONAL_SKIPS")
    if not where or not report.skipped or not isinstance(report.longrepr, tuple):
        return
    found = _MISSING.search(str(report.longrepr[2]))
    if found:
        with open(where, "a", encoding="utf-8") as f:
            f.write(f"{found.group(1).split('.')[0]} {report.nodeid}\n")


def pytest_runtest_logreport(report):
    if report.when == "setup" or report.when == "call":
        _note_optional_skip(report)


def pytest_collectreport(report):
    _note_optional_skip(report)


@pytest.hookimpl(optionalhook=True)  # where pytest-xdist is absent (the GPU image) the hook is unknown
def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts): two test processes where no GPU is, so a
    2-core machine runs the suite in about 60 % of the time (most of a test waits
    on the servers it started); one where a GPU is, since GPU tests measure the
    device's memory, which tests in parallel would share."""
    if cuda_device_count() > 0 or (os.cpu_count() or 1) < 2:
        return 0
    return 2


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


@pytest.fixture
def shared_tmp():
    """A folder under /tmp other uids may enter, removed after the test."""
    with shared_folder() as folder:
        yield folder


@pytest.fixture(scope="session", autouse=True)
def _ray_temp_dir():
    """Ray keeps its sessions under /tmp/ray unless told otherwise: here, in a
    folder of this run's (short, for Ray's socket paths), removed at the end."""
    with shared_folder("gms-ray-") as folder:
        old = os.environ.get("RAY_TMPDIR")
        os.environ["RAY_TMPDIR"] = str(folder)
        try:
            yield folder
        finally:
            if old is None:
                os.environ.pop("RAY_TMPDIR", None)
            else:
                os.environ["RAY_TMPDIR"] = old
