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

from harness import child_main, fd_count, frame, import_sizes, measure, raw_handshake, stats, throughput

MiB2 = 2 << 20
VALUE = b"v" * 64

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
    env = dict(os.environ)
    roots = [str(peer / "lib"), str(peer / "components" / "src")]
    env["PYTHONPATH"] = os.pathsep.join(roots + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


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

    return GMSRPCClient(p["socket"], lock_type=RequestedLockType(lock))


# -- setup: the committed layout the read rows use ------------------------------------------


def setup(p: dict) -> dict:
    client = _client(p, "rw")
    client.clear_all()  # a writer's connect keeps the old allocations (Dynamo's loaders clear first)
    ids = [client.allocate(MiB2, "weights")[0] for _ in range(4)]
    for i in range(100):
        client.metadata_put(f"key.{i}", ids[i % 4], i, VALUE)
    if not client.commit():
        raise RuntimeError("commit failed")
    return {"ids": ids}


# -- read rows ----------------------------------------------------------------------------


def handshake(p: dict) -> dict:
    from gpu_memory_service.client.rpc import GMSRPCClient
    from gpu_memory_service.common.types import RequestedLockType

    path, ro = p["socket"], RequestedLockType.RO

    def op() -> None:
        GMSRPCClient(path, lock_type=ro).close()

    return stats(measure(op, p["n"], p["warmup"]))


def raw_handshake_row(p: dict) -> dict:
    import msgpack  # only to spell the request's bytes once: msgspec's tagged struct as a map

    request = frame(msgpack.packb({"type": "handshake_request", "lock_type": "ro", "timeout_ms": None}))
    op = raw_handshake(p["socket"], request)
    answer = msgpack.unpackb(op())
    if answer.get("type") != "handshake_response" or answer.get("success") is not True:
        raise RuntimeError(f"unexpected handshake answer {answer!r}")
    return stats(measure(op, p["n"], p["warmup"]))


def export(p: dict) -> dict:
    client = _client(p, "ro")
    allocation_id = p["ids"][0]
    result = stats(measure(lambda: os.close(client.export(allocation_id)), p["n"], p["warmup"]))
    client.close()
    return result


def export_fds(p: dict) -> dict:
    """The server's fd table before and after ``n`` exports on one open session."""
    client = _client(p, "ro")
    allocation_id, pid = p["ids"][0], p["server_pid"]
    before = fd_count(pid)
    for _ in range(p["n"]):
        os.close(client.export(allocation_id))
    after = fd_count(pid)
    client.close()
    time.sleep(0.2)
    return {"exports": p["n"], "before": before, "after": after, "added": after - before,
            "after_close": fd_count(pid)}


def metadata_get(p: dict) -> dict:
    client = _client(p, "ro")
    if client.metadata_get("key.42") != (p["ids"][42 % 4], 42, VALUE):
        raise RuntimeError("metadata_get answered something else")
    return stats(measure(lambda: client.metadata_get("key.42"), p["n"], p["warmup"]))


def rpc_throughput(p: dict) -> dict:
    def make_op():
        client = _client(p, "ro")
        return lambda: client.metadata_get("key.42")

    return throughput(make_op, p["processes"], p["duration"], first_cpu=3 if p.get("pin") else None)


# -- write rows (each ends without a commit: the server clears what it made) ---------------------


def allocate(p: dict) -> dict:
    client = _client(p, "rw")
    result = stats(measure(lambda: client.allocate(MiB2, "bench"), p["n"], p["warmup"]))
    client.close()
    return result


def allocate_export(p: dict) -> dict:
    """Dynamo's allocate makes no fd; its first export does (gms's allocate exports eagerly)."""
    client = _client(p, "rw")

    def op() -> None:
        allocation_id, _ = client.allocate(MiB2, "bench")
        os.close(client.export(allocation_id))

    result = stats(measure(op, p["n"], p["warmup"]))
    client.close()
    return result


def metadata_put(p: dict) -> dict:
    client = _client(p, "rw")
    allocation_id, _ = client.allocate(MiB2, "bench")
    keys = iter(range(10**9))
    result = stats(measure(lambda: client.metadata_put(f"k.{next(keys)}", allocation_id, 0, VALUE),
                           p["n"], p["warmup"]))
    client.close()
    return result


# -- import a committed model in a fresh process --------------------------------------------------


def import_build(p: dict) -> dict:
    client = _client(p, "rw")
    client.clear_all()
    sizes = import_sizes(p["check"])
    for size in sizes:
        client.allocate(size, "weights")
    if not client.commit():
        raise RuntimeError("commit failed")
    return {"allocations": len(sizes), "bytes": sum(sizes)}


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


ROWS = {
    "setup": setup, "handshake": handshake, "raw_handshake": raw_handshake_row, "export": export,
    "export_fds": export_fds, "metadata_get": metadata_get, "throughput": rpc_throughput,
    "allocate": allocate, "allocate_export": allocate_export, "metadata_put": metadata_put,
    "import_build": import_build, "import_read": import_read,
}

if __name__ == "__main__":
    sys.exit(child_main(ROWS))
