"""gms's side of the same-run benchmark: its server, and each row through its
own client (``GMSClientMemoryManager``), one row per process.

    python bench/peers/gms_side.py ROW PARAMS_JSON     (run by bench/peers/run.py)
"""

from __future__ import annotations

import os
import sys
import time

from harness import child_main, fd_count, frame, import_sizes, measure, raw_handshake, stats, throughput

MiB2 = 2 << 20
VALUE = b"v" * 64


def start_server(directory: str, backend: str):
    """``gms serve`` in its own process (bench/_common.Server), ready when returned."""
    from _common import Server

    return Server(directory, backend, "gms")


def _manager(p: dict):
    from gms import GMSClientMemoryManager

    if p.get("spin_us") is not None:  # read when a connection is made: 0 turns polling off
        os.environ["GMS_CLIENT_SPIN_US"] = str(p["spin_us"])
    return GMSClientMemoryManager(p["socket"])


# -- setup: the committed layout the read rows use ------------------------------------------


def setup(p: dict) -> dict:
    mgr = _manager(p)
    mgr.connect("RW")
    ids = [mgr.allocate_handle(MiB2, "weights")[0] for _ in range(4)]
    for i in range(100):  # one request each, as Dynamo's side must do it
        mgr.metadata_put(f"key.{i}", ids[i % 4], i, VALUE)
    mgr.commit()
    mgr.close()
    return {"ids": ids}


# -- read rows ----------------------------------------------------------------------------


def handshake(p: dict) -> dict:
    mgr = _manager(p)

    def op() -> None:
        mgr.connect("RO")
        mgr.abort()

    return stats(measure(op, p["n"], p["warmup"]))


def raw_handshake_row(p: dict) -> dict:
    import msgpack  # only to spell the request's bytes once, as docs/protocol.md defines them

    request = frame(msgpack.packb({"type": "HandshakeRequest", "lock_type": "RO"}, use_bin_type=True))
    op = raw_handshake(p["socket"], request)
    answer = msgpack.unpackb(op())
    if answer.get("type") != "HandshakeResponse" or answer.get("success") is not True:
        raise RuntimeError(f"unexpected handshake answer {answer!r}")
    return stats(measure(op, p["n"], p["warmup"]))


def export(p: dict) -> dict:
    mgr = _manager(p)
    mgr.connect("RO")
    allocation_id = p["ids"][0]
    result = stats(measure(lambda: os.close(mgr.export_handle(allocation_id)), p["n"], p["warmup"]))
    mgr.close()
    return result


def export_fds(p: dict) -> dict:
    """The server's fd table before and after ``n`` exports on one open session."""
    mgr = _manager(p)
    mgr.connect("RO")
    allocation_id, pid = p["ids"][0], p["server_pid"]
    before = fd_count(pid)
    for _ in range(p["n"]):
        os.close(mgr.export_handle(allocation_id))
    after = fd_count(pid)
    mgr.close()
    time.sleep(0.2)
    return {"exports": p["n"], "before": before, "after": after, "added": after - before,
            "after_close": fd_count(pid)}


def _reader(p: dict):
    mgr = _manager(p)
    mgr.connect("RO")
    return mgr


def metadata_get(p: dict) -> dict:
    mgr = _reader(p)
    if mgr.metadata_get("key.42") != (p["ids"][42 % 4], 42, VALUE):
        raise RuntimeError("metadata_get answered something else")
    return stats(measure(lambda: mgr.metadata_get("key.42"), p["n"], p["warmup"]))


def rpc_throughput(p: dict) -> dict:
    def make_op():
        mgr = _reader(p)
        return lambda: mgr.metadata_get("key.42")

    return throughput(make_op, p["processes"], p["duration"], first_cpu=3 if p.get("pin") else None)


# -- write rows (each ends without a commit: the server drops what it made) ---------------------


def _writer(p: dict):
    mgr = _manager(p)
    mgr.connect("RW")
    return mgr


def allocate(p: dict) -> dict:
    mgr = _writer(p)
    result = stats(measure(lambda: mgr.allocate_handle(MiB2, "bench"), p["n"], p["warmup"]))
    mgr.close()
    return result


def allocate_export(p: dict) -> dict:
    mgr = _writer(p)

    def op() -> None:
        allocation_id, _ = mgr.allocate_handle(MiB2, "bench")
        os.close(mgr.export_handle(allocation_id))

    result = stats(measure(op, p["n"], p["warmup"]))
    mgr.close()
    return result


def metadata_put(p: dict) -> dict:
    mgr = _writer(p)
    allocation_id, _ = mgr.allocate_handle(MiB2, "bench")
    keys = iter(range(10**9))
    result = stats(measure(lambda: mgr.metadata_put(f"k.{next(keys)}", allocation_id, 0, VALUE),
                           p["n"], p["warmup"]))
    mgr.close()
    return result


# -- import a committed model in a fresh process --------------------------------------------------


def import_build(p: dict) -> dict:
    mgr = _writer(p)
    sizes = import_sizes(p["check"])
    for size in sizes:
        mgr.allocate_handle(size, "weights")
    mgr.commit()
    mgr.close()
    return {"allocations": len(sizes), "bytes": sum(sizes)}


def import_read(p: dict) -> dict:
    """From the manager's creation to every allocation mapped, one ``create_mapping``
    each (``p["batched"]``: one ``create_mappings`` for all).  CUDA and torch are
    initialised and the modules loaded before the clock, as in an engine."""
    cuda = p["backend"] == "cuda"
    if cuda:
        import torch

        torch.cuda.init()
        torch.empty(1, device="cuda")
        import gms.cuda.vmm  # noqa: F401
    from gms import GMSClientMemoryManager

    clock = time.perf_counter_ns
    t0 = clock()
    mgr = GMSClientMemoryManager(p["socket"], device=0)
    t1 = clock()
    mgr.connect("RO")
    t2 = clock()
    ids = [h.allocation_id for h in mgr.list_handles()]
    t3 = clock()
    if p["batched"]:
        mgr.create_mappings(ids)
    else:
        for allocation_id in ids:
            mgr.create_mapping(allocation_id)
    if cuda:
        torch.cuda.synchronize()
    t4 = clock()
    mapped = sum(m.size for m in mgr.mappings)
    mgr.close()
    return {"total_ms": (t4 - t0) / 1e6, "setup_ms": (t1 - t0) / 1e6, "connect_ms": (t2 - t1) / 1e6,
            "list_ms": (t3 - t2) / 1e6, "map_ms": (t4 - t3) / 1e6, "allocations": len(ids), "bytes": mapped}


ROWS = {
    "setup": setup, "handshake": handshake, "raw_handshake": raw_handshake_row, "export": export,
    "export_fds": export_fds, "metadata_get": metadata_get, "throughput": rpc_throughput,
    "allocate": allocate, "allocate_export": allocate_export, "metadata_put": metadata_put,
    "import_build": import_build, "import_read": import_read,
}

if __name__ == "__main__":
    sys.exit(child_main(ROWS))
