"""On-demand weights: a catalog larger than the GPU budget, Zipf requests, restores against the PCIe floor.

One server (``gms serve --gpu-budget B``) holds a catalog of Llama-shaped
models published with ``commit(residency="system")``; Zipf traces over it
(and one long trace: gms must never fail a load) are timed per request from
a new manager's ``connect(RO)`` (which restores an evicted model) to tensors
usable, by one reader process with torch and CUDA up; a request is a *hit* or
a *restore* by the server's restore counter, and its bytes are checked after
it, outside the clock.  Against, in the same worker and run: a pinned host
to device copy of the same bytes (the PCIe floor; on the host backend a
memcpy into new memfd pages) and ``safetensors`` from the page cache and
cold.  docs/performance.md, section 7, describes the method in full and
keeps the figures (and those of the parts retired to git).

    # host backend, small (8-64 MiB models, 96 MiB budget): about 1 minute on the 2-core host
    python bench/on_demand.py --backend host
    # CUDA, as root for the cold reads (drop_caches): 2-16 GiB models, 60 GiB over a 24 GiB
    # budget; at most about 7 minutes: --time-limit 420 (the default on cuda) cuts the
    # 1000-request trace short
    sudo GMS_BENCH_OUT=/tmp/out .venv/bin/python bench/on_demand.py --backend cuda
    #   -> /tmp/out/on_demand_cuda.json (docs/results/on_demand_h100.json for bench/plot.py)
    # smaller on the GPU (about 1.5 minutes): --quick (1, 2, 4 GiB models, 6 GiB budget, 30/200 requests)
    # knobs: --sizes 2,2,4,4,8,8,16,16 --unit GiB --budget 24GiB --exponents 0.8,1.1,1.5
    #        --requests 100 --long-loads 1000 --long-exponent 1.1 --safetensors-sizes 2,8
    #        --time-limit S --dir /big/disk
    python bench/plot.py  # the plot, from docs/results/on_demand_*.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from _common import add_out, gpu_line, percentile
from llama_checkpoint import evict, nbytes, warm, write_safetensors

HERE = Path(__file__).resolve()
MiB, GiB = 1 << 20, 1 << 30
REPLY = "@@"  # a worker's answers are the stdout lines that start with this

DEFAULTS = {
    "cuda": {"sizes": "2,2,4,4,8,8,16,16", "unit": "GiB", "budget": "24GiB", "safetensors": "2,8"},
    "host": {"sizes": "8,8,16,16,32,32,64,64", "unit": "MiB", "budget": "96MiB", "safetensors": "16,64"},
}
QUICK = {
    "cuda": {"sizes": "1,1,2,2,4,4", "unit": "GiB", "budget": "6GiB", "safetensors": "1"},
    "host": {"sizes": "8,8,16,16,32,32", "unit": "MiB", "budget": "48MiB", "safetensors": "16"},
}


# -- model shapes ---------------------------------------------------------------------------


def shapes_for(total: int, unit: str) -> list[tuple[str, list[int]]]:
    """A Llama-shaped model of about ``total`` bytes: Llama-3.2-3B's shapes for
    GiB models (as ``bench/warm_start.py``), the same structure scaled down
    (hidden 512) for MiB models."""
    import llama_checkpoint

    if unit == "GiB":
        return [(name, list(shape)) for name, shape in llama_checkpoint.llama_shapes(total)]
    hidden, inter, kv, vocab = 512, 1408, 128, 1000

    def layer(i: int) -> list[tuple[str, list[int]]]:
        p = f"model.layers.{i}."
        return [(p + "input_layernorm.weight", [hidden]), (p + "self_attn.q_proj.weight", [hidden, hidden]),
                (p + "self_attn.k_proj.weight", [kv, hidden]), (p + "self_attn.v_proj.weight", [kv, hidden]),
                (p + "self_attn.o_proj.weight", [hidden, hidden]), (p + "post_attention_layernorm.weight", [hidden]),
                (p + "mlp.gate_proj.weight", [inter, hidden]), (p + "mlp.up_proj.weight", [inter, hidden]),
                (p + "mlp.down_proj.weight", [hidden, inter])]

    shapes = [("model.embed_tokens.weight", [vocab, hidden])]
    ends = [("model.norm.weight", [hidden]), ("lm_head.weight", [vocab, hidden])]
    used = sum(nbytes(s) for _, s in shapes + ends)
    i = 0
    while used + sum(nbytes(s) for _, s in layer(i)) <= total or i == 0:
        shapes += layer(i)
        used += sum(nbytes(s) for _, s in layer(i))
        i += 1
    return shapes + ends


# -- the worker: a reader (or the publisher) with torch and CUDA up before any clock ----------------


def worker_main(socket_path: str, backend: str) -> None:
    import torch

    cuda = backend == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.init()
        torch.empty(1, device=device)
        import gms.cuda.vmm  # loaded before the clock, as an engine has it
    import ctypes
    import mmap

    import gms.torch
    from gms import GMSClientMemoryManager
    from gms.torch import TensorMeta, encode, plan_packs
    from gms.torch.views import Region

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def check(va: int, size: int, alloc_size: int) -> list[int]:
        """Sums of the first and last MiB of an allocation's bytes."""
        base = Region(va, size, device).base
        k = min(MiB, alloc_size)
        return [int(base[:k].to(torch.int64).sum()), int(base[alloc_size - k : alloc_size].to(torch.int64).sum())]

    def publish(cmd: dict) -> dict:
        shapes = cmd["shapes"]
        plan = plan_packs([nbytes(shape) for _, shape in shapes])
        t0 = time.perf_counter()
        mgr = GMSClientMemoryManager(socket_path, device=0, layout=cmd["layout"])
        mgr.connect("RW")
        generator = torch.Generator(device=device)
        generator.manual_seed(cmd["seed"])
        packs = []
        for size in plan.pack_sizes:
            va = mgr.create_mapping(size=size, tag="weights")
            mapping = next(mp for mp in mgr.mappings if mp.va == va)
            Region(va, mapping.size, device).base[:size].random_(generator=generator)
            packs.append(mapping)
        sync()
        filled = time.perf_counter()
        if cmd.get("load_gbps"):  # the build takes as long as reading its bytes from disk at that rate would
            time.sleep(max(0.0, sum(mp.size for mp in packs) / (cmd["load_gbps"] * 1e9) - (filled - t0)))
        entries = []
        for (name, shape), placement in zip(shapes, plan.placements):
            stride = [1] * len(shape)
            for i in range(len(shape) - 2, -1, -1):
                stride[i] = stride[i + 1] * shape[i + 1]
            meta = TensorMeta(torch.bfloat16, tuple(shape), tuple(stride))
            entries.append((name, packs[placement.pack].allocation_id, placement.offset, encode(meta)))
        for start in range(0, len(entries), 4096):
            mgr.metadata_put_many(entries[start : start + 4096])
        checks = {str(mp.layout_slot): check(mp.va, mp.size, mp.alloc_size) for mp in packs}
        committing = time.perf_counter()
        mgr.commit(residency=cmd["residency"])
        done = time.perf_counter()
        mgr.close()
        return {"publish_s": done - t0, "fill_s": filled - t0, "commit_s": done - committing,
                "allocations": len(packs), "bytes": sum(mp.size for mp in packs), "tensors": len(entries),
                "checks": checks}

    def load(cmd: dict) -> dict:
        t = time.perf_counter()
        mgr = GMSClientMemoryManager(socket_path, device=0, layout=cmd["layout"])
        t0 = time.perf_counter()
        mgr.connect("RO")
        t1 = time.perf_counter()
        tensors = gms.torch.import_tensors(mgr)
        sync()
        t2 = time.perf_counter()
        verified = None
        if cmd.get("checks"):
            got = {str(mp.layout_slot): check(mp.va, mp.size, mp.alloc_size) for mp in mgr.mappings}
            verified = got == cmd["checks"]
        mgr.close()
        return {"manager_s": t0 - t, "connect_s": t1 - t0, "import_s": t2 - t1, "total_s": t2 - t0,
                "tensors": len(tensors), "verified": verified}

    def safetensors(cmd: dict) -> dict:
        from safetensors.torch import load_file

        t0 = time.perf_counter()
        tensors = load_file(cmd["path"], device=str(device))
        sync()
        total = time.perf_counter() - t0
        del tensors
        if cuda:
            torch.cuda.empty_cache()
        return {"total_s": total}

    def floor(cmd: dict) -> dict:
        """Copy each size once per repeat; best of the repeats."""
        largest = max(cmd["sizes"])
        out = {}
        if cuda:
            src = torch.empty(largest, dtype=torch.uint8, pin_memory=True)
            src.fill_(1)
            dst = torch.empty(largest, dtype=torch.uint8, device=device)
        else:
            src = torch.ones(largest, dtype=torch.uint8)
            dst = torch.zeros(largest, dtype=torch.uint8)  # touched: no page faults in the copy
            out["fresh"] = {}
            for size in cmd["sizes"]:  # into new memfd pages, as the host backend's restore copies
                best = float("inf")
                for _ in range(cmd["repeats"]):
                    fd = os.memfd_create("floor")
                    os.ftruncate(fd, size)
                    pages = mmap.mmap(fd, size)
                    target = (ctypes.c_char * size).from_buffer(pages)
                    t0 = time.perf_counter()
                    ctypes.memmove(ctypes.addressof(target), src.data_ptr(), size)
                    best = min(best, time.perf_counter() - t0)
                    del target
                    pages.close()
                    os.close(fd)
                out["fresh"][str(size)] = best
        out["touched"] = {}
        out["d2h"] = {}  # the other way (a publish's host copy): GPU -> pinned host memory on CUDA
        for size in cmd["sizes"]:
            for key, copy in (("touched", lambda n=size: dst[:n].copy_(src[:n], non_blocking=True)),
                              ("d2h", lambda n=size: src[:n].copy_(dst[:n], non_blocking=True))):
                best = float("inf")
                for _ in range(cmd["repeats"]):
                    sync()
                    t0 = time.perf_counter()
                    copy()
                    sync()
                    best = min(best, time.perf_counter() - t0)
                out[key][str(size)] = best
        del src, dst
        if cuda:
            torch.cuda.empty_cache()
            # torch keeps freed pinned blocks cached: give the host RAM back to the host tier
            getattr(torch._C, "_host_emptyCache", lambda: None)()
        return {"floor_s": out}

    ops = {"publish": publish, "load": load, "safetensors": safetensors, "floor": floor}
    print(REPLY + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        try:
            out = ops[cmd["op"]](cmd)
        except Exception:  # noqa: BLE001 - the orchestrator records it (a failed load is a result)
            out = {"error": traceback.format_exc()}
        print(REPLY + json.dumps(out), flush=True)


class Worker:
    def __init__(self, socket_path: str, backend: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE), "--worker", socket_path, "--backend", backend],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
        )
        self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
        raise RuntimeError(f"the worker exited ({self.proc.wait()})")

    def call(self, op: str, **kwargs) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kwargs}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(120)


def compact(value):
    """Floats to 7 decimals (0.1 µs in seconds): the per-request rows stay readable in git."""
    if isinstance(value, float):
        return round(value, 7)
    if isinstance(value, dict):
        return {k: compact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [compact(v) for v in value]
    return value


# -- the trace -----------------------------------------------------------------------------------


def popularity(models: int, seed: int) -> list[int]:
    """rank -> model: which model is the most popular, the next, ..."""
    order = list(range(models))
    random.Random(seed).shuffle(order)
    return order


def zipf_trace(order: list[int], exponent: float, length: int, seed: int) -> list[int]:
    rng = random.Random(f"{seed}-{exponent}")
    weights = [1 / (rank + 1) ** exponent for rank in range(len(order))]
    return [order[rank] for rank in rng.choices(range(len(order)), weights, k=length)]


def run_trace(server_socket: str, worker: Worker, catalog: list[dict], trace: list[int], budget: int, label: str,
              deadline: float = float("inf")) -> list[dict]:
    from gms import get_event_history, get_runtime_state

    rows = []
    for i, model in enumerate(trace):
        if time.perf_counter() > deadline and i >= 50:
            print(f"  {label}: the time limit cuts the trace at {i} requests", flush=True)
            break
        entry = catalog[model]
        before = get_runtime_state(server_socket)
        layout = before.layout(entry["name"])
        got = worker.call("load", layout=entry["name"], checks=entry["checks"])
        after = get_runtime_state(server_socket)
        evictions = sum(r.evictions for r in after.layouts) - sum(r.evictions for r in before.layouts)
        restored = after.layout(entry["name"]).restores > layout.restores
        row = {"i": i, "model": model, "bytes": entry["bytes"], "hit": not restored and "error" not in got,
               "tier_before": layout.tier, "evictions": evictions, "used_frac": after.used_bytes / budget}
        if "error" in got:
            row["error"] = got["error"][-2000:]
        else:
            row.update({k: got[k] for k in ("total_s", "connect_s", "import_s", "manager_s", "verified")})
        if restored:  # where the restore's time went, from the event log's stamps
            stamps = {e.kind: e.mono_ns for e in get_event_history(server_socket, before.last_event_seq).events
                      if e.layout == entry["name"]}
            if {"RESTORE_CLAIMED", "RESTORE_LOADING", "RESTORE_FINISHED"} <= stamps.keys():
                row["server_s"] = (stamps["RESTORE_LOADING"] - stamps["RESTORE_CLAIMED"]) / 1e9  # evict, create
                row["copy_s"] = (stamps["RESTORE_FINISHED"] - stamps["RESTORE_LOADING"]) / 1e9  # map, copy, sync
        rows.append(row)
        if (i + 1) % 100 == 0:
            print(f"  {label}: {i + 1}/{len(trace)}", flush=True)
    return rows


def summarize(rows: list[dict], floors: dict[int, float]) -> dict:
    ok = [r for r in rows if "error" not in r]
    hits = [r["total_s"] for r in ok if r["hit"]]
    restores = [r for r in ok if not r["hit"]]
    ratios = [r["total_s"] / floors[r["bytes"]] for r in restores]
    out = {
        "requests": len(rows), "failures": len(rows) - len(ok), "hit_rate": len(hits) / len(ok) if ok else float("nan"),
        "hits": len(hits), "restores": len(restores),
        "unverified": sum(1 for r in ok if r["verified"] is False),
        "evictions": sum(r["evictions"] for r in rows),
    }
    if hits:
        out.update(hit_p50_ms=percentile(hits, 0.5) * 1e3, hit_p99_ms=percentile(hits, 0.99) * 1e3, hit_max_ms=max(hits) * 1e3)
    if restores:
        times = [r["total_s"] for r in restores]
        out.update(
            restore_p50_ms=percentile(times, 0.5) * 1e3, restore_p99_ms=percentile(times, 0.99) * 1e3,
            restore_gib_per_s_p50=percentile([r["bytes"] / GiB / r["total_s"] for r in restores], 0.5),
            restore_vs_floor_p50=percentile(ratios, 0.5), restore_vs_floor_p99=percentile(ratios, 0.99),
            restore_vs_floor_max=max(ratios),
        )
    by_size = {}
    for size in sorted({r["bytes"] for r in restores}):
        times = [r["total_s"] for r in restores if r["bytes"] == size]
        by_size[str(size)] = {"n": len(times), "p50_ms": percentile(times, 0.5) * 1e3, "floor_ms": floors[size] * 1e3,
                              "vs_floor_p50": percentile(times, 0.5) / floors[size],
                              "gib_per_s_p50": size / GiB / percentile(times, 0.5),
                              "floor_gib_per_s": size / GiB / floors[size]}
    out["restores_by_size"] = by_size
    return out


def publish_catalog(socket_path: str, backend: str, catalog: list[dict], seed: int) -> None:
    """Every model once, residency system, from a process that then exits."""
    publisher = Worker(socket_path, backend)
    try:
        for n, entry in enumerate(catalog):
            got = publisher.call("publish", layout=entry["name"], shapes=entry["shapes"],
                                 seed=seed * 1000 + n, residency="system")
            if "error" in got:
                raise RuntimeError(f"publishing {entry['name']} failed:\n{got['error']}")
            entry.update(got)
            print(f"published {entry['name']}: {got['bytes'] / GiB:.2f} GiB in {got['publish_s']:.2f} s "
                  f"(commit with the host copy {got['commit_s']:.2f} s)", flush=True)
    finally:
        publisher.close()


def safetensors_phase(worker: Worker, catalog: list[dict], st_sizes: list[float], directory: str,
                      results: dict) -> None:
    """The same models from safetensors files: page cache, then cold."""
    for size in st_sizes:
        entry = next((e for e in catalog if e["nominal"] == size), None)
        if entry is None:
            print(f"safetensors: no model of size {size:g} in the catalog; skipped", flush=True)
            continue
        path = os.path.join(directory, f"{entry['name']}.safetensors")
        write_safetensors(path, entry["shapes"])
        try:
            warm(path)
            cached = min(worker.call("safetensors", path=path)["total_s"] for _ in range(2))
            dropped = evict(path)
            cold = worker.call("safetensors", path=path)["total_s"]
        finally:
            os.unlink(path)
        results["safetensors"].append({"model": entry["name"], "bytes": entry["bytes"], "cached_s": cached,
                                       "cold_s": cold, "drop_caches": dropped})
        print(f"safetensors {entry['name']}: cached {cached:.2f} s, cold {cold:.2f} s "
              f"(drop_caches {'ok' if dropped else 'refused: fadvise only'})", flush=True)


def report(results: dict, floors: dict[int, float]) -> None:
    from _common import print_table

    from gms.units import format_bytes

    traces = results["traces"]
    print_table(
        f"on-demand: catalog {results['catalog_bytes'] / GiB:.2f} GiB, budget {results['budget'] / GiB:.2f} GiB "
        f"({results['catalog_over_budget']:.1f}x); ms until usable",
        [(t["exponent"], t["summary"]["requests"], f"{t['summary']['hit_rate']:.2f}",
          f"{t['summary'].get('hit_p50_ms', float('nan')):.1f}", f"{t['summary'].get('hit_p99_ms', float('nan')):.1f}",
          f"{t['summary'].get('restore_p50_ms', float('nan')):.1f}",
          f"{t['summary'].get('restore_p99_ms', float('nan')):.1f}",
          f"{t['summary'].get('restore_gib_per_s_p50', float('nan')):.1f}",
          f"{t['summary'].get('restore_vs_floor_p50', float('nan')):.2f}x",
          t["summary"]["failures"], t["summary"]["unverified"]) for t in traces],
        header=("zipf s", "requests", "hit rate", "hit p50", "hit p99", "restore p50", "restore p99",
                "restore GiB/s", "vs floor", "failed", "bad bytes"),
    )
    # Restores of each model size over every trace, against its floor and safetensors.
    rows = []
    for size in sorted(floors):
        times = [r["total_s"] for t in traces for r in t["rows"] if r["bytes"] == size and not r["hit"] and "error" not in r]
        st = next((s for s in results["safetensors"] if s["bytes"] == size), None)
        entry = {"bytes": size, "restores": len(times), "floor_s": floors[size],
                 "floor_gib_per_s": size / GiB / floors[size]}
        if times:
            p50 = percentile(times, 0.5)
            entry.update(restore_p50_s=p50, restore_p99_s=percentile(times, 0.99), vs_floor_p50=p50 / floors[size],
                         restore_gib_per_s_p50=size / GiB / p50)
            parts = [r for t in traces for r in t["rows"] if r["bytes"] == size and "copy_s" in r]
            if parts:
                copy = percentile([r["copy_s"] for r in parts], 0.5)
                entry.update(copy_p50_s=copy, copy_vs_floor_p50=copy / floors[size],
                             server_p50_s=percentile([r["server_s"] for r in parts], 0.5))
        if st:
            entry.update(safetensors_cached_s=st["cached_s"], safetensors_cold_s=st["cold_s"])
            if times:
                entry.update(cached_vs_restore=st["cached_s"] / entry["restore_p50_s"],
                             cold_vs_restore=st["cold_s"] / entry["restore_p50_s"])
        rows.append(entry)
    results["by_size"] = rows
    print_table(
        "restores by model size, every trace",
        [(format_bytes(r["bytes"]), r["restores"], f"{r.get('restore_p50_s', float('nan')) * 1e3:.1f}",
          f"{r.get('restore_p99_s', float('nan')) * 1e3:.1f}", f"{r['floor_s'] * 1e3:.1f}",
          f"{r.get('vs_floor_p50', float('nan')):.2f}x", f"{r.get('server_p50_s', float('nan')) * 1e3:.1f}",
          f"{r.get('copy_p50_s', float('nan')) * 1e3:.1f}", f"{r.get('copy_vs_floor_p50', float('nan')):.2f}x",
          f"{r.get('restore_gib_per_s_p50', float('nan')):.2f}",
          f"{r['floor_gib_per_s']:.2f}", f"{r['safetensors_cached_s'] * 1e3:.0f}" if "safetensors_cached_s" in r else "-",
          f"{r['safetensors_cold_s'] * 1e3:.0f}" if "safetensors_cold_s" in r else "-") for r in rows],
        header=("model", "restores", "p50 ms", "p99 ms", "floor ms", "p50 / floor", "server ms", "copy ms",
                "copy / floor", "GiB/s", "floor GiB/s",
                "safetensors cached ms", "cold ms"),
    )


# -- main -------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="host", choices=("host", "cuda"))
    parser.add_argument("--quick", action="store_true", help="a smaller catalog and shorter traces")
    parser.add_argument("--sizes", help="model sizes, in --unit (default: see DEFAULTS)")
    parser.add_argument("--unit", choices=("GiB", "MiB"))
    parser.add_argument("--budget", help="gms serve --gpu-budget")
    parser.add_argument("--exponents", default="0.8,1.1,1.5")
    parser.add_argument("--requests", type=int, default=None, help="requests per exponent (default 100)")
    parser.add_argument("--long-loads", type=int, default=None, help="the long trace's length (1000)")
    parser.add_argument("--long-exponent", type=float, default=1.1)
    parser.add_argument("--safetensors-sizes", help="models (by size, in --unit) also loaded from safetensors")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds for the whole run (default 420 on cuda): the long trace stops early, "
                             "and says so")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--dir", default=None, help="where safetensors files go (default: a temp folder)")
    add_out(parser)
    parser.add_argument("--worker", metavar="SOCKET", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker_main(args.worker, args.backend)

    sys.path.insert(0, str(HERE.parent))
    from _common import Server, cpu_name, write_results

    from gms import get_runtime_state
    from gms.units import parse_bytes

    t_run = time.perf_counter()
    limit = args.time_limit or (420.0 if args.backend == "cuda" else None)
    preset = (QUICK if args.quick else DEFAULTS)[args.backend]
    unit = args.unit or preset["unit"]
    scale = GiB if unit == "GiB" else MiB
    sizes = [float(s) for s in (args.sizes or preset["sizes"]).split(",")]
    budget = parse_bytes(args.budget or preset["budget"])
    requests = args.requests or (30 if args.quick else 100)
    long_loads = args.long_loads or (200 if args.quick else 1000)
    exponents = [float(e) for e in args.exponents.split(",")]
    st_sizes = [float(s) for s in (args.safetensors_sizes if args.safetensors_sizes is not None
                                   else preset["safetensors"]).split(",") if s]

    catalog = []
    for n, size in enumerate(sizes):
        shapes = shapes_for(int(size * scale), unit)
        catalog.append({"name": f"m{n}-{size:g}{unit.lower()}", "nominal": size, "unit": unit, "shapes": shapes,
                        "tensor_bytes": sum(nbytes(s) for _, s in shapes)})
    import torch

    results: dict = {
        "backend": args.backend, "cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
        "budget": budget, "seed": args.seed, "exponents": exponents, "long_exponent": args.long_exponent,
        "reader": "one worker process (torch, CUDA up), a new manager and connection per request",
        "time_limit_s": limit, "traces": [], "safetensors": [],
    }
    if args.backend == "cuda":
        results["gpu"] = gpu_line()

    def save() -> None:
        results["seconds"] = time.perf_counter() - t_run
        write_results(args.out, f"on_demand_{args.backend}", compact(results))

    def left() -> float:
        return float("inf") if limit is None else limit - (time.perf_counter() - t_run)

    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        with Server(directory, args.backend, "ondemand", "--gpu-budget", str(budget)) as server:
            publish_catalog(server.socket, args.backend, catalog, args.seed)
            total = sum(e["bytes"] for e in catalog)
            state = get_runtime_state(server.socket)
            results.update(
                catalog=[{k: v for k, v in e.items() if k not in ("shapes", "checks")} for e in catalog],
                catalog_bytes=total, catalog_over_budget=total / budget,
                capacity_bytes=state.capacity_bytes, host_tier_bytes=state.host_used_bytes,
            )
            print(f"catalog {total / GiB:.2f} GiB = {total / budget:.2f}x the budget of {budget / GiB:.2f} GiB",
                  flush=True)
            order = popularity(len(catalog), args.seed)
            results["popularity"] = [catalog[m]["name"] for m in order]
            # The long trace runs last, so a time limit cuts it, not the rest.
            plan = [(e, requests) for e in exponents if e != args.long_exponent]
            if long_loads or args.long_exponent in exponents:
                plan.append((args.long_exponent, max(long_loads, requests if args.long_exponent in exponents else 0)))
            worker = Worker(server.socket, args.backend)  # the reader, the floors and safetensors
            try:
                got = worker.call("floor", sizes=sorted({e["bytes"] for e in catalog}), repeats=3)["floor_s"]
                results["floor_touched_s"] = got["touched"]
                if args.backend == "cuda":
                    results["floor_kind"] = "torch pinned host memory -> GPU, copy_ into a tensor, best of 3"
                    floors = {int(k): v for k, v in got["touched"].items()}
                else:
                    results["floor_kind"] = ("host backend, no PCIe: memcpy into new memfd pages (as a restore "
                                             "copies), best of 3; floor_touched_s: into pages touched before")
                    floors = {int(k): v for k, v in got["fresh"].items()}
                results["floor_s"] = {str(k): v for k, v in floors.items()}
                for n, (exponent, length) in enumerate(plan):
                    last = n == len(plan) - 1
                    if last:  # before the long trace, which the time limit may cut
                        safetensors_phase(worker, catalog, st_sizes, directory, results)
                        save()
                    deadline = time.perf_counter() + left() if last else float("inf")
                    trace = zipf_trace(order, exponent, length, args.seed)
                    # What is on the GPU as the trace starts, least recently used first
                    # (PyTorch's run of the same trace starts from the same set).
                    names = [e["name"] for e in catalog]
                    initial = [names.index(r.name) for r in sorted(
                        (r for r in get_runtime_state(server.socket).layouts if r.tier == "device"),
                        key=lambda r: -(r.last_use_s or 0.0))]
                    t0 = time.perf_counter()
                    rows = run_trace(server.socket, worker, catalog, trace, budget, f"s={exponent}", deadline)
                    summary = summarize(rows, floors)
                    summary["seconds"] = time.perf_counter() - t0
                    summary["truncated"] = len(rows) < len(trace)
                    results["traces"].append({"exponent": exponent, "trace": trace[: len(rows)],
                                              "initial_resident": initial, "summary": summary, "rows": rows})
                    print(f"s={exponent}: {len(rows)} requests{' (cut by the time limit)' if summary['truncated'] else ''}, "
                          f"hit rate {summary['hit_rate']:.2f}, hits p50 {summary.get('hit_p50_ms', float('nan')):.1f} ms, "
                          f"restores p50 {summary.get('restore_p50_ms', float('nan')):.1f} ms "
                          f"({summary.get('restore_vs_floor_p50', float('nan')):.2f}x the floor), "
                          f"failures {summary['failures']}", flush=True)
                    save()
                if not plan:
                    safetensors_phase(worker, catalog, st_sizes, directory, results)
            finally:
                worker.close()
        long = next((t for t in results["traces"] if t["exponent"] == args.long_exponent), None)
        if long:  # how full the budget ran, request after request: VMM memory has no arena to cut
            used = [r["used_frac"] for r in long["rows"]]
            results["long_trace"] = {
                "loads": len(long["rows"]), "failures": long["summary"]["failures"],
                "restores": long["summary"]["restores"], "evictions": long["summary"]["evictions"],
                "occupancy_mean": statistics.fmean(used), "occupancy_min_after_warmup": min(used[len(used) // 10:]),
            }
    report(results, floors)
    save()


if __name__ == "__main__":
    main()
