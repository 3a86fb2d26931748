"""The server's event loop while a big layout's memory comes and goes.

A layout of N allocations (default 1,000 of 16 MiB: 15.6 GiB) is built, then
its memory is released and made again three ways, each the way a user does it:

* abort     its writer disconnects without committing (RW_ABORT: every allocation released)
* evict     committed with residency ``system``, then ``gms evict`` (every GPU allocation released)
* restore   a reader connects to the evicted layout (the server makes every allocation again)

All the while a probe thread opens a connection every millisecond and asks
for the last event (a history probe: the state alone, no memory call), and
times each answer.  An answer can only be late if the event loop was busy:
its longest delay during a phase is the loop's longest stall there.  Before
the lanes, ``cuMemRelease`` and ``cuMemCreate`` ran on the loop, one
allocation after another.

    python bench/loop_stall.py [--backend cuda] [--count 1000] [--size-mib 16]
    # before/after in one run (another commit's tree), interleaved, same host:
    python bench/loop_stall.py --compare /tmp/gms-before --json docs/results/loop_stall_h100.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import Server, cpu_name, percentile, print_table, tree_env, write_json  # noqa: E402

PHASES = ("abort", "evict", "restore")


PROBER = r"""
import json, sys, time
from gms.client.probes import get_event_history
samples = []
sys.stdout.write("ready\n"); sys.stdout.flush()
while not sys.stdin.closed:
    t0 = time.perf_counter()
    get_event_history(sys.argv[1], since_seq=None, limit=1)
    samples.append((t0, time.perf_counter() - t0))
    time.sleep(max(0.0, 0.001 - (time.perf_counter() - t0)))
    if len(samples) % 64 == 0 and select.select([sys.stdin], [], [], 0)[0]:
        break
print(json.dumps(samples))
""".replace("import json, sys, time", "import json, select, sys, time")


class Prober:
    """A history probe every millisecond, in a process of its own (so the clients'
    work in this one cannot delay it); (start time, latency) of each.  The
    clock is CLOCK_MONOTONIC in both processes."""

    def __init__(self, socket_path: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", PROBER, socket_path],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"
        self.samples: list[tuple[float, float]] = []

    def finish(self) -> None:
        self.proc.stdin.write("stop\n")
        self.proc.stdin.close()
        self.samples = [tuple(s) for s in json.loads(self.proc.stdout.read())]
        self.proc.wait(30)

    def window(self, start: float, end: float) -> list[float]:
        return [latency for t0, latency in self.samples if start <= t0 <= end]


def build(socket_path: str, count: int, size: int, residency: str | None):
    from gms import GMSClientMemoryManager

    writer = GMSClientMemoryManager(socket_path, layout="big")
    writer.connect("RW")
    for n in range(count):
        allocation_id, _ = writer.allocate_handle(size, tag="weights")
        writer.metadata_put(f"t{n}", allocation_id, 0, b"")
    if residency is not None:
        writer.commit(residency)
        writer.close()
    return writer


def phases(socket_path: str, count: int, size: int, prober: Prober) -> dict[str, dict]:
    """Run the three phases; returns their (start, end) times."""
    from gms import GMSClientMemoryManager
    from gms.client import admin

    windows: dict[str, tuple[float, float]] = {}

    def timed(name: str, action) -> None:
        time.sleep(0.2)  # quiet probes before
        start = time.perf_counter()
        action()
        windows[name] = (start, time.perf_counter() + 0.2)  # the lanes may still be releasing
        time.sleep(0.2)

    writer = build(socket_path, count, size, None)
    timed("abort", writer.abort)
    writer.close()
    build(socket_path, count, size, "system")
    timed("evict", lambda: admin.evict(socket_path, "big"))

    def restore() -> None:
        reader = GMSClientMemoryManager(socket_path, layout="big")
        reader.connect("RO")
        reader.close()

    timed("restore", restore)
    return windows


def stalls(prober: Prober, windows: dict[str, tuple[float, float]]) -> dict[str, dict]:
    out = {}
    for name, (start, end) in windows.items():
        busy, quiet = prober.window(start, end), prober.window(start - 0.2, start)
        out[name] = {
            "seconds": end - 0.2 - start, "probes": len(busy),
            "max_ms": max(busy) * 1e3, "p99_ms": percentile(busy, 0.99) * 1e3,
            "p50_ms": percentile(busy, 0.5) * 1e3, "quiet_p50_ms": percentile(quiet, 0.5) * 1e3,
        }
    return out


def measure(backend: str, count: int, size: int) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        with Server(directory, backend, "stall") as server:
            prober = Prober(server.socket)
            try:
                windows = phases(server.socket, count, size, prober)
            finally:
                prober.finish()
    return stalls(prober, windows)


def compare(before: str, args) -> dict:
    here = str(Path(__file__).resolve().parent.parent)
    runs: dict[str, list] = {"before": [], "after": []}
    for _ in range(args.runs):
        for label, tree in (("before", str(Path(before).resolve())), ("after", here)):
            out = subprocess.run(
                [sys.executable, __file__, "--backend", args.backend, "--count", str(args.count),
                 "--size-mib", str(args.size_mib), "--json", "-"],
                env=tree_env(tree), cwd=tree, capture_output=True, text=True, check=True,
            )
            runs[label].append(json.loads(out.stdout.strip().splitlines()[-1]))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--size-mib", type=int, default=16)
    parser.add_argument("--compare", metavar="TREE", help="another commit's tree, run first, interleaved")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--json", default="bench/results/loop_stall.json")
    args = parser.parse_args()
    size = args.size_mib << 20
    meta = {"cpu": cpu_name(), "backend": args.backend, "allocations": args.count, "allocation_mib": args.size_mib,
            "layout_gib": args.count * size / (1 << 30)}
    if not args.compare:
        results = measure(args.backend, args.count, size)
        if args.json == "-":
            print(json.dumps(results))
            return
        print_table(f"longest stall of the event loop ({meta['layout_gib']:.1f} GiB in {args.count} allocations)",
                    [(p, f"{r['max_ms']:.1f}", f"{r['p99_ms']:.2f}", f"{r['seconds']:.2f}") for p, r in results.items()],
                    header=("phase", "max ms", "p99 ms", "phase s"))
        write_json(args.json, {**meta, **results})
        return
    runs = compare(args.compare, args)
    rows = []
    for phase in PHASES:
        before = max(run[phase]["max_ms"] for run in runs["before"])
        after = max(run[phase]["max_ms"] for run in runs["after"])
        rows.append((phase, f"{before:.1f}", f"{after:.1f}", f"{before / after:.1f}x"))
    print_table(f"longest stall of the event loop, before and after ({meta['layout_gib']:.1f} GiB, {args.count} allocations)",
                rows, header=("phase", "before max ms", "after max ms", "before/after"))
    write_json(args.json, {**meta, "before_tree": args.compare, **runs})


if __name__ == "__main__":
    main()
