"""scripts/gpu_vllm_wheels.py: a release's wheels pruned, cut into parts, and joined again.

What a GPU lease carries (docs/vllm.md, "Installing on an offline GPU host"),
on made-up wheels: a lock file's ``# prune`` lines drop members (the RECORD
rewritten to match), the parts hold every byte once, and receiving them all
in any order joins wheels whose sha256 is the manifest's.  No pip, no network.
"""

from __future__ import annotations

import importlib.util
import json
import os
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("gpu_vllm_wheels", ROOT / "scripts" / "gpu_vllm_wheels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wheel(folder: Path, name: str, version: str, members: dict[str, bytes]) -> Path:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    record = "".join(f"{m},sha256=x,{len(d)}\n" for m, d in members.items())
    with zipfile.ZipFile(path, "w") as z:
        for member, data in members.items():
            z.writestr(member, data)
        z.writestr(f"{name}-{version}.dist-info/RECORD", record + f"{name}-{version}.dist-info/RECORD,,\n")
    return path


def test_pruned_wheels_travel_in_parts_and_join_whole(tmp_path, monkeypatch):
    g = _script()
    src = tmp_path / "src"
    src.mkdir()
    big = os.urandom(300_000)
    _wheel(src, "eng", "1.0", {"eng/__init__.py": b"x = 1\n", "eng/_fa2.so": big, "eng/kernels/a.so": big,
                               "eng/kernels/b.so": big, "eng/_fa3.so": os.urandom(200_000)})
    _wheel(src, "small", "2.0", {"small/__init__.py": b"y = 2\n"})
    lock = tmp_path / "gpu-eng-wheels.txt"
    lock.write_text("# prune eng==1.0: eng/_fa2.so   a kernel for other GPUs\n"
                    "# prune eng==1.0: eng/kernels/  a folder\n")
    out = tmp_path / "parts"
    g.split(src, out, 100_000, lock)
    parts = sorted(out.glob("eng-part*"), key=lambda p: int(p.name.split("part")[1]))
    assert len(parts) == 3  # the pruned wheel (about 200 KB) and the small one, in 100 KB parts
    manifest = json.loads((parts[0] / "MANIFEST.json").read_text())
    eng = next(w for w in manifest["wheels"] if w["name"].startswith("eng-"))
    assert eng["pruned"] == ["eng/_fa2.so", "eng/kernels/a.so", "eng/kernels/b.so"] and eng["size"] < 250_000

    monkeypatch.setattr(g, "install", lambda store, manifest: 0)  # joining is checked below, pip is not run
    store = tmp_path / "store"
    assert [g.receive(p, store) for p in reversed(parts)] == [3, 3, 0]
    wheels = g.join(store, manifest)
    with zipfile.ZipFile(wheels / eng["name"]) as z:
        assert sorted(z.namelist()) == ["eng-1.0.dist-info/RECORD", "eng/__init__.py", "eng/_fa3.so"]
        assert b"_fa2" not in z.read("eng-1.0.dist-info/RECORD") and b"kernels/" not in z.read("eng-1.0.dist-info/RECORD")


def test_a_prune_line_that_matches_nothing_stops_the_split(tmp_path):
    g = _script()
    src = tmp_path / "src"
    src.mkdir()
    _wheel(src, "eng", "1.0", {"eng/__init__.py": b""})
    lock = tmp_path / "gpu-eng-wheels.txt"
    lock.write_text("# prune eng==1.0: eng/gone.so\n")
    with pytest.raises(SystemExit, match="nothing to prune at eng/gone.so"):
        g.split(src, tmp_path / "parts", 100_000, lock)
