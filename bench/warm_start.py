"""Warm start: a new process, from connect to every tensor usable on the GPU.

For Llama-shaped bf16 checkpoints of 1, 8, 24 and 32 GiB, in one run on one GPU:

* gms        a reader imports the committed layout (connect(RO), one metadata
             scan, batched exports, one mapping per 1 GiB pack, a view per tensor)
* floor      the driver calls alone for the same allocations (import, reserve,
             map, set-access), on fds received from the server
* safetensors ``safetensors.torch.load_file(device="cuda")`` from the page cache,
             and from disk after evicting the file (cold)
* CUDA IPC   ``torch.multiprocessing``: a producer holds the tensors on the GPU and
             hands them over a queue; time is the consumer's ``get()``

Every measuring process has CUDA and torch initialised before its clock
starts (an engine has both), and is new (nothing cached from earlier runs).

    python bench/warm_start.py [--quick] [--sizes 1,8,24,32] [--dir /tmp/gms-bench]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import (
    DRIVER_FLOOR,
    Server,
    add_out,
    cpu_name,
    gpu,
    print_table,
    run_json,
    write_results,
)
from llama_checkpoint import GiB, evict, warm, write_checkpoint

HERE = Path(__file__).resolve().parent

GMS_READER = r"""
import json, sys, time, torch
torch.cuda.init(); torch.empty(1, device="cuda")
import gms.torch
import gms.cuda.vmm  # modules are loaded before the clock, as for safetensors
from gms import GMSClientMemoryManager
# Making the manager is process setup, like CUDA's: it grows the fd table
# (9 to 18 ms on the H100 VM, gms/system/fds.py), timed apart as manager_s.
t = time.perf_counter()
mgr = GMSClientMemoryManager(sys.argv[1], device=0)
manager_s = time.perf_counter() - t
t0 = time.perf_counter()
mgr.connect("RO")
t1 = time.perf_counter()
tensors = gms.torch.import_tensors(mgr)
torch.cuda.synchronize()
t2 = time.perf_counter()
entries = mgr.metadata_scan()
t3 = time.perf_counter()
regions = {mp.allocation_id: gms.torch.views.Region(mp.va, mp.size, torch.device("cuda", 0)) for mp in mgr.mappings}
metas = {v: gms.torch.decode(v) for v in {v for _, _, v in entries.values()}}
made = [regions[a].tensor(o, metas[v]) for a, o, v in entries.values()]
t4 = time.perf_counter()
print(json.dumps({"manager_s": manager_s, "connect_s": t1 - t0, "import_s": t2 - t1, "total_s": t2 - t0,
                  "tensors": len(tensors), "allocations": len(mgr.mappings),
                  "scan_s": t3 - t2, "views_s": t4 - t3, "checksum": float(next(iter(tensors.values())).float().sum())}))
"""

SAFETENSORS = r"""
import json, sys, time, torch
torch.cuda.init(); torch.empty(1, device="cuda")
from safetensors.torch import load_file
t0 = time.perf_counter()
tensors = load_file(sys.argv[1], device="cuda:0")
torch.cuda.synchronize()
print(json.dumps({"total_s": time.perf_counter() - t0, "tensors": len(tensors)}))
"""

def publish(socket: str, path: str) -> float:
    """The cold-start writer: checkpoint (page cache) -> gms, 1 GiB packs."""
    script = r"""
import json, sys, time, torch
torch.cuda.init()
import gms.torch
from gms import GMSClientMemoryManager
mgr = GMSClientMemoryManager(sys.argv[1], device=0)
mgr.connect("RW")
t0 = time.perf_counter()
gms.torch.load_safetensors(mgr, sys.argv[2], progress=False)
mgr.commit()
print(json.dumps({"total_s": time.perf_counter() - t0}))
"""
    return run_json(script, socket, path)["total_s"]


def run_file(script: Path, *args: str) -> dict:
    out = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"{script.name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def best(runs: list[dict], key: str = "total_s") -> dict:
    return min(runs, key=lambda r: r[key])


def measure(size_gib: int, directory: str, repeats: int, cold: bool, ipc: bool) -> dict:
    path = os.path.join(directory, f"llama-{size_gib}gib.safetensors")
    shapes = write_checkpoint(path, size_gib * GiB)
    size = os.path.getsize(path)
    row: dict = {"size_gib": size_gib, "bytes": size, "tensors": len(shapes)}
    try:
        warm(path)
        with Server(directory) as server:
            row["publish_s"] = publish(server.socket, path)
            runs = [run_json(GMS_READER, server.socket) for _ in range(repeats)]
            row["gms"] = best(runs)
            row["gms_runs_s"] = [r["total_s"] for r in runs]
            floors = [run_json(DRIVER_FLOOR, server.socket) for _ in range(repeats)]
            row["floor_s"] = best(floors, "floor_s")["floor_s"]
        warm(path)
        row["safetensors_cached_s"] = best([run_json(SAFETENSORS, path) for _ in range(repeats)])["total_s"]
        if ipc:
            row["cuda_ipc_s"] = best([run_file(HERE / "ipc_handoff.py", path) for _ in range(max(1, repeats - 1))])["total_s"]
        if cold:
            evict(path)
            row["safetensors_cold_s"] = run_json(SAFETENSORS, path)["total_s"]
    finally:
        os.unlink(path)
    g = row["gms"]["total_s"]
    row["gib_per_s"] = size / GiB / g
    row["x_safetensors_cached"] = row["safetensors_cached_s"] / g
    if "safetensors_cold_s" in row:
        row["x_safetensors_cold"] = row["safetensors_cold_s"] / g
    if "cuda_ipc_s" in row:
        row["x_cuda_ipc"] = row["cuda_ipc_s"] / g
    row["x_floor"] = g / row["floor_s"]
    row["x_floor_plus_views"] = g / (row["floor_s"] + row["gms"]["views_s"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 GiB, one run each, no cold read")
    parser.add_argument("--sizes", default="1,8,24,32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp folder)")
    add_out(parser)
    args = parser.parse_args()
    sizes = [1] if args.quick else [int(s) for s in args.sizes.split(",")]
    repeats = 1 if args.quick else args.repeats

    import torch

    def save() -> None:  # after every size: a long run cut short keeps what it measured
        write_results(args.out, "warm_start", {
            "gpu": torch.cuda.get_device_name(0), "cpu": cpu_name(), "torch": torch.__version__,
            "driver": gpu()["driver"],
            "rows": rows,
        })

    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        for size in sizes:
            rows.append(measure(size, directory, repeats, cold=not args.quick, ipc=True))
            r = rows[-1]
            print(f"{size} GiB: gms {r['gms']['total_s'] * 1e3:.1f} ms, safetensors {r['safetensors_cached_s']:.2f} s",
                  flush=True)
            save()
    print_table(
        "warm start: new process, connect to every tensor usable on the GPU",
        [(f"{r['size_gib']} GiB", r["tensors"], r["gms"]["allocations"],
          f"{r['gms']['total_s'] * 1e3:.1f}", f"{r['gms']['manager_s'] * 1e3:.1f}", f"{r['gms']['connect_s'] * 1e3:.1f}", f"{r['gms']['scan_s'] * 1e3:.1f}",
          f"{r['floor_s'] * 1e3:.1f}", f"{r['gms']['views_s'] * 1e3:.1f}",
          f"{r['safetensors_cached_s']:.2f}", f"{r.get('safetensors_cold_s', float('nan')):.2f}",
          f"{r.get('cuda_ipc_s', float('nan')):.2f}", f"{r['gib_per_s']:,.0f}",
          f"{r['x_safetensors_cached']:,.0f}x", f"{r['x_floor']:.1f}x")
         for r in rows],
        header=("model", "tensors", "allocs", "gms ms", "(setup ms)", "connect ms", "scan ms", "floor ms", "views ms", "st cached s", "st cold s",
                "cuda ipc s", "gms GiB/s", "vs st cached", "gms/floor"),
    )


if __name__ == "__main__":
    main()
