"""The reliability suite's figures: written as JSON for bench/soak.py, and summed up.

A test's rows ride on its report (``user_properties``), so they reach the
process that prints the summary whether the suite runs in one process or in
several (pytest-xdist: the workers run the tests, the controller reports)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from .common import MODE, take_records

_FIGURES = "gms_figures"
_shown: list[dict] = []  # every row reported, in the process that reports


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "teardown":
        outcome.get_result().user_properties.append((_FIGURES, take_records()))


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        for name, rows in report.user_properties:
            if name == _FIGURES:
                _shown.extend(rows)


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("GMS_RELIABILITY_OUT")
    if out and _shown and not hasattr(session.config, "workerinput"):
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        (path / "records.json").write_text(json.dumps(_shown, indent=1))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _shown:
        return
    terminalreporter.section(f"gms reliability figures ({MODE} mode)")
    for row in _shown:
        figures = {k: v for k, v in row.items() if k not in ("area", "name", "mode")}
        text = ", ".join(f"{k}={v}" for k, v in figures.items() if not isinstance(v, list | dict))
        terminalreporter.write_line(f"{row['area']:>10} | {row['name']}: {text}")
