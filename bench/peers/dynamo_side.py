"""Dynamo's side of the same-run benchmark: its server (``python -m
dynamo.gpu_memory_service``, asyncio + uvloop) and each row through its own
client (``GMSRPCClient``; ``GMSClientMemoryManager`` for the import), one row
per process.  Its package comes from the peer's folder (``--dynamo``) on this
process's PYTHONPATH: nothing here is imported by gms, and nothing of it is
vendored (bench/peers/README.md).

    python bench/peers/dynamo_side.py ROW PARAMS_JSON   (run by bench/peers/run.py)
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from harness import child_main, measure, stats
from rows import Client, raw_handshake_row, rows

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ (as harness does), for _common
from _common import tree_env  # noqa: E402

# Starts the server the way ``python -m dynamo.gpu_memory_service`` does (the
# package's __init__, then server.main(), which installs uvloop), with one
# change of setting: the root log level.  The server logs at INFO by default,
# two lines per handshake (a lock transition each way); gms runs its bench
# servers at WARNING, so by default both do.  --dynamo-log-level INFO runs it
# as shipped.
LAUNCH = r"""
import logging, sys
level, sys.argv = sys.argv[1], ["dynamo.gpu_memory_service", *sys.argv[2:]]
from dynamo.gpu_memory_service import server
logging.getLogger().setLevel(level)
server.main()
"""


def peer_env(peer: Path) -> dict:
    """This process's environment with Dynamo's two source roots in front."""
    return tree_env(str(peer / "lib"), str(peer / "components" / "src"))


def _raise_fd_limit() -> None:
    # gms's server raises its own soft limit to the hard one (gms/cli/serve.py);
    # Dynamo's leaks one fd per export, so give it the same room.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def start_server(peer: Path, directory: str, log_level: str = "WARNING"):
    """Dynamo's server on a private socket, in its own process; ready when returned."""
    socket_path = os.path.join(directory, "dynamo.sock")
    log = open(os.path.join(directory, "dynamo-server.log"), "wb")
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCH, log_level, "--device", "0", "--socket-path", socket_path],
        env=peer_env(peer), stdout=log, stderr=subprocess.STDOUT, preexec_fn=_raise_fd_limit,
    )
    deadline = time.monotonic() + 180  # it imports torch first
    while not os.path.exists(socket_path):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            tail = Path(log.name).read_text(errors="replace")[-3000:]
            raise RuntimeError(f"Dynamo's server did not start:\n{tail}")
        time.sleep(0.05)
    time.sleep(0.2)  # bound before listening: let it listen
    proc.socket, proc.log_path = socket_path, log.name
    return proc


def _client(p: dict, lock: str):
    from gpu_memory_service.client.rpc import GMSRPCClient
    from gpu_memory_service.common.types import RequestedLockType

    return GMSRPCClient(p["socket"], lock_type=RequestedLockType(lock.lower()))


def open_client(p: dict, lock: str, fresh: bool = False) -> Client:
    """Dynamo's RPC client, connected by its constructor.  ``fresh``: its
    writer's connect keeps the old allocations, so a writer that loads a model
    clears them first, as Dynamo's loaders do."""
    client = _client(p, lock)
    if fresh:
        client.clear_all()

    def commit() -> None:
        if not client.commit():
            raise RuntimeError("commit failed")

    return Client(allocate=client.allocate, export=client.export, metadata_put=client.metadata_put,
                  metadata_get=client.metadata_get, commit=commit, close=client.close)


# -- read rows ----------------------------------------------------------------------------


def handshake(p: dict) -> dict:
    from gpu_memory_service.client.rpc import GMSRPCClient
    from gpu_memory_service.common.types import RequestedLockType

    path, ro = p["socket"], RequestedLockType.RO

    def op() -> None:
        GMSRPCClient(path, lock_type=ro).close()

    return stats(measure(op, p["n"], p["warmup"]))


def raw_handshake(p: dict) -> dict:
    """The request as Dynamo's msgspec spells its tagged struct: a map."""
    request = {"type": "handshake_request", "lock_type": "ro", "timeout_ms": None}
    return raw_handshake_row(p, request, "handshake_response")


# -- import a committed model in a fresh process --------------------------------------------------


def import_read(p: dict) -> dict:
    """From the manager's creation (its constructor connects) to every allocation
    mapped, one ``import_allocation`` each: Dynamo's read path.  CUDA and torch are
    initialised and the modules loaded before the clock, as in an engine."""
    import torch

    torch.cuda.init()
    torch.empty(1, device="cuda")
    from gpu_memory_service.client.memory_manager import GMSClientMemoryManager
    from gpu_memory_service.common.types import RequestedLockType

    clock = time.perf_counter_ns
    t0 = clock()
    mgr = GMSClientMemoryManager(p["socket"], mode=RequestedLockType.RO, device=0)
    t1 = clock()
    allocations = mgr.list_allocations()
    t2 = clock()
    for a in allocations:
        mgr.import_allocation(a["allocation_id"])
    torch.cuda.synchronize()
    t3 = clock()
    mapped = mgr.total_bytes
    mgr.close()
    return {"total_ms": (t3 - t0) / 1e6, "connect_ms": (t1 - t0) / 1e6, "list_ms": (t2 - t1) / 1e6,
            "map_ms": (t3 - t2) / 1e6, "allocations": len(allocations), "bytes": mapped}


ROWS = {**rows(open_client), "handshake": handshake, "raw_handshake": raw_handshake,
        "import_read": import_read}

if __name__ == "__main__":
    sys.exit(child_main(ROWS))
