"""Where a reader's import of a Llama-shaped layout spends its time, phase by phase.

A writer lays out a 24 GiB (``--size-gib``) bf16 Llama-shaped model as 1 GiB
packs and one metadata entry per tensor, without copying bytes.  New reader
processes (CUDA and torch loaded, as an engine has them) then time each step
of ``gms.torch.import_tensors`` on its own:

* creating the manager (it makes room in the fd table: gms/fds.py)
* connect(RO); the metadata scan, first and again (from the server's cache)
* one batched export of every allocation, then the same into an fd table
  that is full, as every import was before the manager made room
* create_mappings (export + import + map + set-access), regions, views
* gc: every collection during the reader's run, and its time

    python bench/import_phases.py [--quick] [--size-gib 24] [--backend cuda|host]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from _common import Server, cpu_name, print_table, run_json, write_json
from llama_checkpoint import GiB, llama_shapes

READER = r"""
import gc, json, os, sys, time
import torch
cuda = sys.argv[2] == "cuda"
if cuda:
    torch.cuda.init(); torch.empty(1, device="cuda")
    import gms.cuda.vmm
import gms.torch
from gms import GMSClientMemoryManager
from gms.fds import _table
from gms.torch.encoding import decode
from gms.torch.views import Region

collections = []
def on_gc(phase, info, started=[0.0]):
    if phase == "start":
        started[0] = time.perf_counter()
    else:
        collections.append((info["generation"], (time.perf_counter() - started[0]) * 1e3))
gc.callbacks.append(on_gc)

ms = {}
def phase(name, fn):
    start = time.perf_counter()
    out = fn()
    ms[name] = (time.perf_counter() - start) * 1e3
    return out

table_before = _table()
mgr = phase("create manager", lambda: GMSClientMemoryManager(sys.argv[1], device=0))
table_after = _table()
phase("connect", lambda: mgr.connect("RO"))
entries = phase("scan", mgr.metadata_scan)
phase("scan again", mgr.metadata_scan)
ids = sorted({alloc for alloc, _, _ in entries.values()})

def export_and_close():
    for _, fd in mgr.export_handles(ids):
        os.close(fd)
phase("export all", export_and_close)
size, used = _table()
fillers = [os.open(os.devnull, os.O_RDONLY) for _ in range(size - used)]  # the table is full now
phase("export all, fd table full", export_and_close)
for fd in fillers:
    os.close(fd)

phase("create_mappings", lambda: mgr.create_mappings(ids))
device = torch.device("cuda", 0) if cuda else torch.device("cpu")
regions = phase("regions", lambda: {mp.allocation_id: Region(mp.va, mp.size, device) for mp in mgr.mappings})
metas = phase("decode distinct", lambda: {v: decode(v) for v in {v for _, _, v in entries.values()}})
phase("views", lambda: [regions[a].tensor(o, metas[v]) for a, o, v in entries.values()])
if cuda:
    phase("synchronize", torch.cuda.synchronize)
print(json.dumps({"ms": ms, "tensors": len(entries), "allocations": len(ids), "fd_table": [table_before, table_after],
                  "gc": collections}))
"""


def build_layout(socket: str, size_gib: int) -> None:
    import torch

    from gms import GMSClientMemoryManager
    from gms.torch.encoding import TensorMeta, encode
    from gms.torch.packing import plan_packs

    shapes = llama_shapes(size_gib * GiB)
    writer = GMSClientMemoryManager(socket, device=0)
    writer.connect("RW")
    plan = plan_packs([2 * torch.Size(shape).numel() for _, shape in shapes], GiB)
    ids = [writer.allocate_handle(size, "weights")[0] for size in plan.pack_sizes]
    rows = []
    for (name, shape), placement in zip(shapes, plan.placements):
        stride = tuple(torch.empty(shape, device="meta").stride())
        rows.append((name, ids[placement.pack], placement.offset, encode(TensorMeta(torch.bfloat16, shape, stride))))
    writer.metadata_put_many(rows)
    writer.commit()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 GiB, one reader")
    parser.add_argument("--size-gib", type=int, default=24)
    parser.add_argument("--readers", type=int, default=3)
    parser.add_argument("--backend", default="cuda", choices=("cuda", "host"))
    parser.add_argument("--json", default="bench/results/import_phases.json")
    args = parser.parse_args()
    size_gib, readers = (8, 1) if args.quick else (args.size_gib, args.readers)

    with tempfile.TemporaryDirectory() as directory:
        with Server(directory, backend=args.backend) as server:
            build_layout(server.socket, size_gib)
            runs = [run_json(READER, server.socket, args.backend) for _ in range(readers)]
    phases = list(runs[0]["ms"])
    print_table(
        f"{size_gib} GiB, {runs[0]['tensors']} tensors in {runs[0]['allocations']} allocations, "
        f"{args.backend} backend: ms per phase, one column per new reader process",
        [(name, *(f"{r['ms'][name]:.2f}" for r in runs), f"{statistics.median(r['ms'][name] for r in runs):.2f}")
         for name in phases],
        header=("phase", *(f"reader {i + 1}" for i in range(len(runs))), "median"),
    )
    for i, r in enumerate(runs):
        (size0, used0), (size1, _) = r["fd_table"]
        slow = [f"gen{g} {t:.1f} ms" for g, t in r["gc"] if t >= 0.5]
        print(f"reader {i + 1}: fd table {size0} slots ({used0} used) -> {size1} after creating the manager; "
              f"{len(r['gc'])} collections" + (f", of them {', '.join(slow)}" if slow else ""))
    write_json(args.json, {"backend": args.backend, "cpu": cpu_name(), "size_gib": size_gib, "runs": runs})


if __name__ == "__main__":
    main()
