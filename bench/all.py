"""Every benchmark in one command.

    python bench/all.py [--quick] [--out DIR]

CPU ones always (tenants, on-demand weights, host-tier transfers, the disk
tier and a restart's smoke run on the host backend; gms's half of the peers
table; the server's work per request, counted: instructions where valgrind is
installed, Python opcodes where not); GPU ones where a GPU is present (warm
start, sleep/wake, and the same on the CUDA backend).  The engines' benchmarks
(``vllm.py``, ``sglang_gms.py``, ``failover.py``) and Dynamo's side of the
peers table need what bench/README.md names, and run on their own.
Run as root for the tenant benchmark's distinct uids.
Each writes its results under ``--out`` (bench/_common.out_dir).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from _common import add_out

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="each benchmark in its quick mode")
    add_out(parser)
    args = parser.parse_args()
    quick = ["--quick"] if args.quick else []
    out = ["--out", args.out] if args.out else []
    from gms.cuda import cuda_device_count

    count = "instructions" if shutil.which("valgrind") else "opcodes"  # (instructions: a few minutes)
    backends = ["host", "cuda"] if cuda_device_count() else ["host"]
    scale = {"host": "0.002", "cuda": "0.05" if args.quick else "1"}  # restart.py's model, x16.1 GB
    runs = [["cpu_per_request.py", "--count", count]]
    if "cuda" in backends:
        runs += [["warm_start.py"], ["sleep_wake.py"]]
    for backend in backends:
        runs += [["tenants.py", "--backend", backend], ["on_demand.py", "--backend", backend],
                 ["tier_floor.py", "--backend", backend], ["disk_tier.py", "--backend", backend],
                 ["peers/run.py", "--backend", backend, *(["--check"] if args.quick else [])],
                 ["restart.py", "--backend", backend, "--scale", scale[backend]]]
    failed = []
    for run in runs:
        print(f"\n=== {' '.join(run)} ===", flush=True)
        flags = [*quick, *out] if run[0] not in ("peers/run.py", "restart.py") else out  # (no --quick there)
        if subprocess.run([sys.executable, str(HERE / run[0]), *run[1:], *flags]).returncode:
            failed.append(run[0])
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
