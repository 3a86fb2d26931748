"""The reliability suite's long mode, by one command (issue 15, docs/reliability.md).

    python bench/soak.py              # long mode: GMS_RELIABILITY=long pytest -n 0 tests/reliability
    python bench/soak.py --ci         # the CI slice (what .ci/run runs), for its size and wall time
    python bench/soak.py -k fuzz      # a part of it (pytest's -k)

Runs the suite in a pytest of its own, collects the figures every test
records (tests/reliability/common.py: record), writes them with the wall
time to reliability_<mode>_2core.json under ``--out`` (bench/_common.out_dir; the
docs cite the copy in docs/results) and
prints the tables docs/reliability.md shows.  Exits with pytest's status.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import add_out, cpu_name, write_results

ROOT = Path(__file__).resolve().parent.parent
def run(mode: str, extra: list[str]) -> tuple[int, float, list[dict], str]:
    with tempfile.TemporaryDirectory(prefix="gms-soak-") as out:
        env = {**os.environ, "GMS_RELIABILITY": mode, "GMS_RELIABILITY_OUT": out}
        started = time.perf_counter()
        proc = subprocess.run(
            # One process (-n 0): each figure measured with no other test beside it.
            [sys.executable, "-m", "pytest", "tests/reliability", "-q", "-n", "0", "-p", "no:cacheprovider", *extra],
            cwd=ROOT, env=env, capture_output=True, text=True,
        )
        wall = time.perf_counter() - started
        path = Path(out) / "records.json"
        records = json.loads(path.read_text()) if path.exists() else []
    summary = next((line for line in reversed(proc.stdout.splitlines()) if re.search(r"\d+ (passed|failed)", line)), "")
    if proc.returncode != 0:
        sys.stdout.write(proc.stdout[-20000:])
        sys.stderr.write(proc.stderr[-5000:])
    return proc.returncode, wall, records, summary.strip("= ")


def _ms(row: dict, key: str) -> str:
    value = row.get(key)
    return "" if value is None else f"{value:.2f}" if value < 10 else f"{value:.1f}"


def _mib(row: dict, key: str) -> str:
    value = row.get(key)
    return "" if value is None else f"{value:.0f}"


def markdown(area: str, rows: list[dict]) -> list[str]:
    """The table docs/reliability.md shows for one area."""
    out = []

    def table(header: tuple, body: list[tuple]) -> None:
        out.append("| " + " | ".join(header) + " |")
        out.append("|" + "|".join(" --- " for _ in header) + "|")
        out.extend("| " + " | ".join(str(c) for c in row) + " |" for row in body)

    if area == "crash":
        def case(name: str) -> tuple[str, str]:
            lock, _, step = name.partition(" ")
            return (lock, step) if lock in ("RW", "RO", "RW_OR_RO") else ("", name)

        table(("lock", "step", "kills", "errors", "next grant p50 ms", "p99 ms", "max ms", "over 50 ms"),
              [(*case(r["name"]), r["kills"], r["errors"], _ms(r, "p50_ms"), _ms(r, "p99_ms"), _ms(r, "max_ms"),
                r.get("over_target", "")) for r in rows])
    elif area == "fuzz":
        table(("run", "frames", "connections", "writers", "fds received", "errors", "frames/s",
               "server RSS before → growth MiB", "server fds before → after", "events refolded"),
              [(r["name"], r.get("frames", ""), r.get("connections", ""), r.get("writers", ""),
                r.get("fds_received", ""), r["errors"], r.get("frames_per_s", ""),
                f"{_mib(r, 'rss_before_mib')} → +{_mib(r, 'rss_growth_mib')}" if "rss_before_mib" in r else "",
                f"{r['fds_before']} → {r['fds_after']}" if "fds_before" in r else "", r.get("events", ""))
               for r in rows])
    elif area == "load":
        table(("load", "errors", "count", "p50 ms", "p99 ms", "max ms", "server RSS before → after (max) MiB",
               "server fds before → after", "event log kept (first seq)"),
              [(r["name"], r["errors"], r.get("count", r.get("events", "")), _ms(r, "p50_ms"), _ms(r, "p99_ms"),
                _ms(r, "max_ms"),
                f"{_mib(r, 'rss_before_mib')} → {_mib(r, 'rss_after_mib')} ({_mib(r, 'rss_max_mib')})"
                if "rss_before_mib" in r else
                (f"{_mib(r, 'rss_mib_first')} → {_mib(r, 'rss_mib_last')}" if "rss_mib_first" in r else ""),
                f"{r['fds_before']} → {r['fds_after']}" if "fds_before" in r else "",
                f"{r['log_kept']} ({r['log_first_seq']})" if "log_kept" in r else
                (f"{r['kept']}" if "kept" in r else ""))
               for r in rows])
    else:
        skip = {"area", "name", "mode", "errors"}
        table(("check", "errors", "figures"),
              [(r["name"], r.get("errors", ""), ", ".join(f"{k} {v}" for k, v in r.items() if k not in skip))
               for r in rows])
    return out


def crash_overall(rows: list[dict]) -> dict:
    grants = sorted(g for row in rows for g in row.get("grants_ms", []))
    if not grants:
        return {}
    return {
        "name": "**all steps**", "kills": len(grants), "errors": sum(row["errors"] for row in rows),
        "p50_ms": grants[len(grants) // 2], "p99_ms": grants[min(len(grants) - 1, int(len(grants) * 0.99))],
        "max_ms": grants[-1], "over_target": sum(g > 50 for g in grants),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ci", action="store_true", help="the CI slice instead of the long mode")
    parser.add_argument("-k", help="only the tests pytest's -k selects")
    parser.add_argument("--from", dest="saved", metavar="JSON", help="print the tables of a saved run")
    add_out(parser)
    args = parser.parse_args()
    mode = "ci" if args.ci else "long"
    extra = ["-k", args.k] if args.k else []
    if args.saved:
        saved = json.loads(Path(args.saved).read_text())
        mode, code, wall = saved["mode"], saved["exit"], saved["wall_s"]
        records, summary = saved["records"], saved["pytest"]
        extra = ["(saved)"]
    else:
        code, wall, records, summary = run(mode, extra)

    areas: dict[str, list[dict]] = {}
    for row in records:
        areas.setdefault(row["area"], []).append(row)
    if areas.get("crash"):
        areas["crash"].append(crash_overall(areas["crash"]))
    for area, rows in areas.items():
        print(f"\n### {area} ({mode} mode)\n")
        print("\n".join(markdown(area, rows)))
    print(f"\npytest: {summary}; wall {wall:.0f} s; exit {code}")
    if not extra:
        write_results(args.out, f"reliability_{mode}_2core", {
            "mode": mode, "cpu": cpu_name(), "cores": os.cpu_count(), "wall_s": round(wall, 1),
            "pytest": summary, "exit": code, "records": records,
        })
    return code


if __name__ == "__main__":
    sys.exit(main())
