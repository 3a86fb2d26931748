"""Shared by the bench scripts: hardware names, tables, JSON results."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary_us(samples_s: list[float]) -> dict[str, float]:
    return {
        "p50_us": percentile(samples_s, 0.50) * 1e6,
        "p99_us": percentile(samples_s, 0.99) * 1e6,
        "mean_us": statistics.fmean(samples_s) * 1e6,
        "n": len(samples_s),
    }


def print_table(title: str, rows: list[tuple], header: tuple | None = None) -> None:
    rows = [tuple(str(c) for c in row) for row in rows]
    if header:
        rows.insert(0, tuple(header))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print(f"\n{title}")
    for n, row in enumerate(rows):
        print("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if header and n == 0:
            print("  " + "  ".join("-" * w for w in widths))


def write_json(path: str, results: dict) -> None:
    results = {"date": time.strftime("%Y-%m-%d"), "host": platform.node(), **results}
    out = os.environ.get("GMS_BENCH_OUT")
    target = Path(out) / Path(path).name if out else Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {target}")
