"""Restore and publish through the host tier against the PCIe floor, timed from the user's call.

Per layout size (Llama-shaped, bf16, 2, 8 and 16 GiB on CUDA), against a
floor of the same bytes in the same run: **publish** is
``commit(residency="system")`` from the call to its return (floor: GPU to
pinned host memory); **restore** is the evicted layout's ``connect(RO)`` and
``gms.torch.import_tensors``, device synchronized (floor: pinned host memory
to the GPU).  Timing runs in ``bench/on_demand.py``'s worker; every
restore's bytes are checked outside the clock.  Each in its own server, one
after the other: ``copier`` (the copier process, a pool of pinned host
memory sized by hand and full before each transfer), ``clients``
(``--no-copier``: the clients copy, the design before), ``auto`` (a default
server; the writer's build paced as a disk read at ``--load-gbps``) and
``auto-now`` (the same, committing as soon as its bytes are on the device).
docs/performance.md, section 7 ("Restore and publish through the copier"),
has the method in full and the figures.  On the host backend both tiers are
memfd: a smoke run whose ratios say nothing of a GPU.

    python bench/tier_floor.py --backend host                    # smoke: 32, 64, 128 MiB, about a minute
    python bench/tier_floor.py --backend cuda --out /tmp/out     # 2, 8, 16 GiB -> /tmp/out/tier_floor_cuda.json
    python bench/tier_floor.py --backend cuda --check            # seconds: the copier's selftest, one small
                                                                 # publish and restore through it, bytes checked
    # knobs: --sizes 2,8,16 --unit GiB --repeats 3 --configs copier,clients,auto,auto-now --pool BYTES
    #        --chunk BYTES --load-gbps 5
    #        --quick (1 and 2 GiB, or 16 and 32 MiB, once each)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

import on_demand  # noqa: E402 - the worker, the shapes and the floor op (bench/on_demand.py)
from _common import Server, add_out, cpu_name, gpu_line, print_table, wait_for, write_results  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
PRESETS = {
    "cuda": {"sizes": "2,8,16", "unit": "GiB", "chunk": 64 * MiB},
    "host": {"sizes": "32,64,128", "unit": "MiB", "chunk": 8 * MiB},
}
CHECK = {"cuda": (0.25, "GiB"), "host": (16, "MiB")}


def layout_bytes(shapes) -> int:
    """What the worker's publish allocates: its packs, each aligned to 2 MiB."""
    from gms.torch.packing import plan_packs

    plan = plan_packs([on_demand.nbytes(shape) for _, shape in shapes])
    return sum(-(-size // (2 * MiB)) * 2 * MiB for size in plan.pack_sizes)


def copier_restores(socket_path: str, layout: str) -> bool:
    """Evict ``layout``, handshake RO on a bare connection: True if the server's copier
    restored it (the answer says ``restore: false``)."""
    from gms.client import admin
    from gms.client.transport import RpcTransport
    from gms.wire import messages as m

    admin.evict(socket_path, layout)
    transport = RpcTransport(socket_path)
    try:
        response, _ = transport.call(m.HandshakeRequest("RO", None, layout), m.HandshakeResponse)
    finally:
        transport.close()
    return response.success and not response.restore


def run_config(name: str, backend: str, sizes: list[tuple[str, list, int]], directory: str,
               pool: int, chunk: int, repeats: int, load_gbps: float = 0.0) -> dict:
    from gms import get_event_history, get_runtime_state
    from gms.client import admin

    flags = {"clients": ["--no-copier"], "copier": ["--host-pool", str(pool), "--host-chunk", str(chunk)]}.get(
        name, ["--host-chunk", str(chunk)])  # auto, auto-now: the pool as a default server sizes it
    out: dict = {"server_flags": flags, "sizes": {}}
    with Server(directory, backend, f"tier-{name}", *flags) as server:
        if name != "clients":
            wait_for(lambda: get_runtime_state(server.socket).copier == "running", 120, "the copier")
        worker = on_demand.Worker(server.socket, backend)
        try:
            def pool_full() -> None:  # made ahead of need: the steady state between transfers
                if name == "copier":
                    wait_for(lambda: get_runtime_state(server.socket).host_pool_bytes >= pool, 300,
                             "the host pool to refill")

            for label, shapes, size in sizes:
                runs = []
                for n in range(repeats):
                    pool_full()
                    published = worker.call("publish", layout="tier", shapes=shapes, seed=1000 + n,
                                            residency="system", load_gbps=load_gbps if name == "auto" else 0)
                    if "error" in published:
                        raise RuntimeError(f"publish failed:\n{published['error']}")
                    pool_full()
                    before = get_runtime_state(server.socket).last_event_seq
                    admin.evict(server.socket, "tier")
                    loaded = worker.call("load", layout="tier", checks=published["checks"])
                    if "error" in loaded:
                        raise RuntimeError(f"restore failed:\n{loaded['error']}")
                    stamps = {e.kind: e.mono_ns for e in get_event_history(server.socket, before).events
                              if e.layout == "tier"}
                    runs.append({
                        "publish_s": published["commit_s"], "restore_s": loaded["total_s"],
                        "connect_s": loaded["connect_s"], "import_s": loaded["import_s"],
                        "server_s": (stamps["RESTORE_LOADING"] - stamps["RESTORE_CLAIMED"]) / 1e9,
                        "copy_s": (stamps["RESTORE_FINISHED"] - stamps["RESTORE_LOADING"]) / 1e9,
                        "verified": loaded["verified"], "bytes": published["bytes"],
                        "pool_after_bytes": get_runtime_state(server.socket).host_pool_bytes,  # idle pinned memory
                    })
                    print(f"  {name} {label}: publish {published['commit_s'] * 1e3:.1f} ms, "
                          f"restore {loaded['total_s'] * 1e3:.1f} ms, bytes ok {loaded['verified']}", flush=True)
                out["sizes"][label] = runs
            state = get_runtime_state(server.socket)
            out["copier_at_end"] = state.copier
        finally:
            worker.close()
    return out


def summarize(results: dict) -> list[dict]:
    rows = []
    for config, got in results["configs"].items():
        for label, runs in got["sizes"].items():
            size = runs[0]["bytes"]
            h2d, d2h = results["floor_h2d_s"][str(size)], results["floor_d2h_s"][str(size)]
            publish = [r["publish_s"] for r in runs]
            restore = [r["restore_s"] for r in runs]
            row = {
                "config": config, "size": label, "bytes": size, "runs": len(runs),
                "publish_best_s": min(publish), "publish_median_s": statistics.median(publish),
                "restore_best_s": min(restore), "restore_median_s": statistics.median(restore),
                "floor_d2h_s": d2h, "floor_h2d_s": h2d,
                "publish_vs_floor": statistics.median(publish) / d2h,
                "restore_vs_floor": statistics.median(restore) / h2d,
                "restore_copy_vs_floor": statistics.median(r["copy_s"] for r in runs) / h2d,
                "restore_server_median_s": statistics.median(r["server_s"] for r in runs),
                "bad_bytes": sum(1 for r in runs if r["verified"] is False),
            }
            rows.append(row)
    return rows


def report(results: dict) -> None:
    print(f"\n{results['hardware']}")
    print_table(
        "publish (commit(residency=system), call to return) and restore (connect(RO) to tensors usable), "
        "medians against the floor of the same bytes",
        [(r["config"], r["size"], r["runs"], f"{r['publish_median_s'] * 1e3:.1f}", f"{r['floor_d2h_s'] * 1e3:.1f}",
          f"{r['publish_vs_floor']:.2f}x", f"{r['restore_median_s'] * 1e3:.1f}", f"{r['floor_h2d_s'] * 1e3:.1f}",
          f"{r['restore_vs_floor']:.2f}x", f"{r['restore_server_median_s'] * 1e3:.1f}",
          f"{r['restore_copy_vs_floor']:.2f}x", r["bad_bytes"]) for r in results["rows"]],
        header=("config", "layout", "runs", "publish ms", "D2H floor ms", "publish / floor", "restore ms",
                "H2D floor ms", "restore / floor", "server ms", "copy / floor", "bad bytes"),
    )


def check(backend: str, directory: str) -> int:
    """The first GPU call: the engine alone, then one publish and restore through a server's copier."""
    from gms import get_runtime_state

    selftest = subprocess.run([sys.executable, "-m", "gms.copier", "--selftest", "--backend", backend],
                              capture_output=True, text=True, timeout=300)
    print(selftest.stdout.strip() or selftest.stderr.strip(), flush=True)
    if selftest.returncode != 0:
        print(f"check FAILED: the copier's selftest exited {selftest.returncode}\n{selftest.stderr[-3000:]}")
        return 1
    size, unit = CHECK[backend]
    shapes = on_demand.shapes_for(int(size * (GiB if unit == "GiB" else MiB)), unit)
    chunk = PRESETS[backend]["chunk"]
    pool = -(-layout_bytes(shapes) // chunk) * chunk  # whole chunks: the server rounds down
    with Server(directory, backend, "tier-check", "--host-pool", str(pool), "--host-chunk", str(chunk)) as server:
        wait_for(lambda: get_runtime_state(server.socket).copier == "running", 120, "the copier")
        wait_for(lambda: get_runtime_state(server.socket).host_pool_bytes >= pool, 120, "the host pool")
        worker = on_demand.Worker(server.socket, backend)
        try:
            published = worker.call("publish", layout="check", shapes=shapes, seed=7, residency="system")
            if "error" in published:
                print(f"check FAILED: publish\n{published['error']}")
                return 1
            by_copier = copier_restores(server.socket, "check")
            loaded = worker.call("load", layout="check", checks=published["checks"])
        finally:
            worker.close()
        state = get_runtime_state(server.socket)
    ok = by_copier and loaded.get("verified") is True and state.copier == "running"
    print(f"check {'OK' if ok else 'FAILED'}: {published['bytes'] / MiB:.0f} MiB published in "
          f"{published['commit_s'] * 1e3:.1f} ms, restored by the copier: {by_copier}, bytes verified: "
          f"{loaded.get('verified')} {loaded.get('error', '')}, copier {state.copier}", flush=True)
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="host", choices=("host", "cuda"))
    parser.add_argument("--sizes", help="layout sizes in --unit (default: 2,8,16 GiB on cuda; 32,64,128 MiB on host)")
    parser.add_argument("--unit", choices=("GiB", "MiB"))
    parser.add_argument("--repeats", type=int, default=3, help="publishes and restores per size and config")
    parser.add_argument("--configs", default="copier,clients,auto,auto-now",
                        help="copier (a pool sized by hand), clients (--no-copier), auto and auto-now (a default server)")
    parser.add_argument("--load-gbps", type=float, default=5.0, help="auto: the build's pace, as a disk read (GB/s)")
    parser.add_argument("--pool", default=None, help="--host-pool for the copier's server (default: the largest layout)")
    parser.add_argument("--chunk", default=None, help="--host-chunk (default 64MiB on cuda)")
    add_out(parser)
    parser.add_argument("--check", action="store_true", help="a quick check of the copier path, then exit")
    parser.add_argument("--quick", action="store_true", help="smaller layouts, one run each")
    args = parser.parse_args()
    from gms.units import parse_bytes

    with tempfile.TemporaryDirectory() as directory:
        if args.check:
            return check(args.backend, directory)
        preset = PRESETS[args.backend]
        unit = args.unit or preset["unit"]
        scale = GiB if unit == "GiB" else MiB
        sizes = []
        quick = {"cuda": "1,2", "host": "16,32"}[args.backend] if args.quick else None
        repeats = 1 if args.quick else args.repeats
        for text in (args.sizes or quick or preset["sizes"]).split(","):
            shapes = on_demand.shapes_for(int(float(text) * scale), unit)
            sizes.append((f"{float(text):g} {unit}", shapes, layout_bytes(shapes)))
        chunk = parse_bytes(args.chunk) if args.chunk else preset["chunk"]
        largest = max(size for _, _, size in sizes)
        pool = -(-(parse_bytes(args.pool) if args.pool else largest) // chunk) * chunk  # whole chunks
        import torch

        hardware = f"CPU {cpu_name()} ({os.cpu_count()} cores), torch {torch.__version__}"
        if args.backend == "cuda":
            hardware = f"GPU {gpu_line()}; {hardware}"
        results: dict = {"backend": args.backend, "hardware": hardware, "repeats": repeats, "pool": pool,
                         "chunk": chunk, "configs": {}}
        # The floors, in the worker the runs use (its floor op: bench/on_demand.py), before any server holds memory.
        helper = on_demand.Worker(os.path.join(directory, "none.sock"), args.backend)
        try:
            floors = helper.call("floor", sizes=sorted({size for _, _, size in sizes}), repeats=3)["floor_s"]
        finally:
            helper.close()
        if args.backend == "cuda":
            results["floor_kind"] = "torch pinned host memory <-> GPU tensor, copy_, best of 3"
            results["floor_h2d_s"], results["floor_d2h_s"] = floors["touched"], floors["d2h"]
        else:
            results["floor_kind"] = "host backend, no PCIe: memcpy into new memfd pages, best of 3 (both ways)"
            results["floor_h2d_s"] = results["floor_d2h_s"] = floors["fresh"]
        t0 = time.perf_counter()
        for config in [c for c in args.configs.split(",") if c]:
            print(f"{config}:", flush=True)
            results["configs"][config] = run_config(config, args.backend, sizes, directory, pool, chunk, repeats,
                                                    args.load_gbps)
        results["seconds"] = time.perf_counter() - t0
        results["rows"] = summarize(results)
        report(results)
        write_results(args.out, f"tier_floor_{args.backend}", on_demand.compact(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
