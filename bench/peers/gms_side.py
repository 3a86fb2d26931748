"""gms's side of the same-run benchmark: its server, and each row through its
own client (``GMSClientMemoryManager``), one row per process.

    python bench/peers/gms_side.py ROW PARAMS_JSON     (run by bench/peers/run.py)
"""

from __future__ import annotations

import os
import sys
import time

from harness import child_main, measure, stats
from rows import Client, raw_handshake_row, rows


def start_server(directory: str, backend: str):
    """``gms serve`` in its own process (bench/_common.Server), ready when returned."""
    from _common import Server

    return Server(directory, backend, "gms")


def _manager(p: dict):
    from gms import GMSClientMemoryManager

    if p.get("spin_us") is not None:  # read when a connection is made: 0 turns polling off
        os.environ["GMS_CLIENT_SPIN_US"] = str(p["spin_us"])
    return GMSClientMemoryManager(p["socket"])


def open_client(p: dict, lock: str, fresh: bool = False) -> Client:
    """gms's manager, connected.  ``fresh`` is nothing here: gms has no clear-all
    request, and a writer that does not commit leaves nothing behind."""
    mgr = _manager(p)
    mgr.connect(lock)
    return Client(allocate=mgr.allocate_handle, export=mgr.export_handle, metadata_put=mgr.metadata_put,
                  metadata_get=mgr.metadata_get, commit=mgr.commit, close=mgr.close)


def handshake(p: dict) -> dict:
    mgr = _manager(p)

    def op() -> None:
        mgr.connect("RO")
        mgr.abort()

    return stats(measure(op, p["n"], p["warmup"]))


def raw_handshake(p: dict) -> dict:
    """The request as docs/protocol.md defines it."""
    return raw_handshake_row(p, {"type": "HandshakeRequest", "lock_type": "RO"}, "HandshakeResponse")


# -- import a committed model in a fresh process --------------------------------------------------


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


ROWS = {**rows(open_client), "handshake": handshake, "raw_handshake": raw_handshake,
        "import_read": import_read}

if __name__ == "__main__":
    sys.exit(child_main(ROWS))
