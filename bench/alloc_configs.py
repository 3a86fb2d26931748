"""Allocate 2 MiB in a tight loop against ``gms serve`` on the GPU, per server configuration.

One writer, 3,000 allocations (the first 200 not counted), p50 / p90 / p99 /
max per configuration: the default (a keeper, a copier, the allocation
stock, the self-sizing host pool), and with each of them off in turn; and
with the memory made on the event loop instead of the GPU lane (the
backend's ``loop_bytes`` raised in the server's process).

    python bench/alloc_configs.py [--rounds 1] [--json PATH]

GPU only.  The fifteenth session's runs on an H200 (as a probe with these
configurations, before it was kept here): docs/results/alloc_configs_h200.txt.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import cpu_name, percentile, wait_served, write_json  # noqa: E402

SERVER = r"""
import sys
import gms.cuda.vmm as vmm
vmm.VmmBackend.loop_bytes = int(sys.argv[1])
from gms.cli import main
sys.exit(main(["serve", "--backend", "cuda", "--socket", sys.argv[2], "--log-level", "warning", *sys.argv[3:]]))
"""
LOOP_BYTES = 8 << 20
CONFIGS = {
    "default": (0, []),
    "no pool": (0, ["--host-pool", "0"]),
    "no stock": (0, ["--alloc-stock", "0", "--host-pool", "0"]),
    "no stock, no keeper": (0, ["--alloc-stock", "0", "--host-pool", "0", "--no-keeper"]),
    "no stock, no copier": (0, ["--alloc-stock", "0", "--host-pool", "0", "--no-copier"]),
    "no stock, no keeper, no copier": (0, ["--alloc-stock", "0", "--host-pool", "0", "--no-keeper", "--no-copier"]),
    "made on the loop, no keeper, no copier":
        (LOOP_BYTES, ["--alloc-stock", "0", "--host-pool", "0", "--no-keeper", "--no-copier"]),
    "no keeper": (0, ["--no-keeper", "--host-pool", "0"]),
}


def run(name: str, n: int = 3000) -> dict:
    from gms import GMSClientMemoryManager

    loop_bytes, flags = CONFIGS[name]
    sock = os.path.join(tempfile.mkdtemp(), "s.sock")
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(loop_bytes), sock, *flags])
    try:
        wait_served(sock, server)
        writer = GMSClientMemoryManager(sock)
        writer.connect("RW")
        samples = []
        for _ in range(n):
            started = time.perf_counter_ns()
            writer.allocate_handle(2 << 20, "b")
            samples.append((time.perf_counter_ns() - started) / 1e3)
        writer.close()
    finally:
        server.terminate()
        server.wait()
    samples = samples[200:]
    row = {"config": name, **{f"p{q}_us": round(percentile(samples, q / 100), 1) for q in (50, 90, 99)},
           "max_us": round(max(samples), 1)}
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", default="bench/results/alloc_configs.json")
    args = parser.parse_args()
    rows = [run(name) for _ in range(args.rounds) for name in CONFIGS]
    write_json(args.json, {"cpu": cpu_name(), "rows": rows})


if __name__ == "__main__":
    main()
