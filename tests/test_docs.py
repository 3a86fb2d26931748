"""The README's quick start runs as written: a writer and a reader, in two processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from gms.system import paths

from .helpers import wait_until

ROOT = Path(__file__).resolve().parent.parent


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def test_readme_writer_and_reader(tmp_path, backend):
    # GMS_BACKEND: on a GPU host the README's clients must find the host-backend server too.
    env = {**os.environ, "GMS_SOCKET_DIR": str(tmp_path), "GMS_BACKEND": backend}
    server = subprocess.Popen(
        [sys.executable, "-m", "gms", "serve", "--backend", backend, "--log-level", "warning"],
        env=env,
    )
    try:
        path = paths.socket_path_in(str(tmp_path), paths.device_id(0, backend))
        wait_until(lambda: os.path.exists(path), timeout=30, what=path)
        writer, reader = python_blocks(ROOT / "README.md")[:2]
        for code in (writer, reader):
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "b'hello from the writer'"
    finally:
        server.terminate()
        server.wait(30)


def test_the_architecture_doc_shows_the_rules_table_the_fold_enforces():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "docs_rules.py"), "--check"], cwd=ROOT)
    assert out.returncode == 0, "docs/architecture.md drifted from gms/fsm/rules.py: run scripts/docs_rules.py"
