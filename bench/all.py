"""Every benchmark in one command.

    python bench/all.py [--quick]

CPU ones always (tenants, on-demand weights and host-tier transfers on the
host backend; the server's work per request, counted: instructions where
valgrind is installed, Python opcodes where not); GPU ones where a GPU is
present (warm start, sleep/wake, tenants, on-demand weights and host-tier
transfers on the CUDA backend).
Run as root for the tenant benchmark's distinct uids.
Each writes its JSON under bench/results/ (or $GMS_BENCH_OUT).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="each benchmark in its quick mode")
    args = parser.parse_args()
    quick = ["--quick"] if args.quick else []
    from gms.cuda import cuda_device_count

    runs = [["tenants.py", "--backend", "host"],
            ["on_demand.py", "--backend", "host"], ["tier_floor.py", "--backend", "host"]]
    count = "instructions" if shutil.which("valgrind") else "opcodes"  # (instructions: a few minutes)
    runs.append(["cpu_per_request.py", "--count", count])
    if cuda_device_count():
        runs += [["warm_start.py"], ["sleep_wake.py"], ["tenants.py", "--backend", "cuda"],
                 ["on_demand.py", "--backend", "cuda"], ["tier_floor.py", "--backend", "cuda"]]
    failed = []
    for run in runs:
        print(f"\n=== {' '.join(run)} ===", flush=True)
        if subprocess.run([sys.executable, str(HERE / run[0]), *run[1:], *quick]).returncode:
            failed.append(run[0])
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
