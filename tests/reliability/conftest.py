"""The reliability suite's figures: written as JSON for bench/soak.py, and summed up."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .common import MODE, records


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("GMS_RELIABILITY_OUT")
    if out and records():
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        (path / "records.json").write_text(json.dumps(records(), indent=1))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    rows = records()
    if not rows:
        return
    terminalreporter.section(f"gms reliability figures ({MODE} mode)")
    for row in rows:
        figures = {k: v for k, v in row.items() if k not in ("area", "name", "mode")}
        text = ", ".join(f"{k}={v}" for k, v in figures.items() if not isinstance(v, list | dict))
        terminalreporter.write_line(f"{row['area']:>10} | {row['name']}: {text}")
