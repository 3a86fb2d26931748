"""vLLM's wheels for an offline GPU host, carried in parts of at most 55 MiB.

A call to the GPU host carries at most 64 MiB beside the checkout, and vLLM
0.26.0 with what the image lacks is about 340 MB.  So the wheels travel in
parts, one part per call to the same warm machine, and are joined and
installed there once every part has arrived.

Here (a machine that reaches PyPI)::

    python3 scripts/gpu_vllm_wheels.py fetch .wheels/vllm          # pip download, hashes checked
    python3 scripts/gpu_vllm_wheels.py split .wheels/vllm .wheels  # .wheels/vllm-part1 .. -partN

On the GPU host, once per part (scripts/gpu-vllm-install.sh wraps this)::

    python3 scripts/gpu_vllm_wheels.py receive .wheels/vllm-partK  # copy to the store; install when complete

``--lock FILE`` (before the verb) picks another release's lock file: the set
is named from it (``scripts/gpu-vllm033-wheels.txt``: parts ``vllm033-partK``,
its own store).  A lock file's ``# prune NAME==VERSION: MEMBER`` lines drop
members a served model never loads from that wheel at split time (a member
ending in ``/`` drops a folder); the wheel's RECORD is rewritten to match, and
the manifest keeps the original's sha256 beside the pruned wheel's.

Each part holds the same MANIFEST.json: every wheel (size, sha256) and every
piece (which wheel, which part, offset, size, sha256).  Wheels are packed
largest first and a wheel is cut where a part fills up, so N parts is the
least the total allows.  Standard library only: it runs under any Python 3.11+.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

PART_BYTES = 55 << 20
ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "scripts" / "gpu-vllm-wheels.txt"
PRUNE = re.compile(r"^#\s*prune\s+(?P<wheel>[^=\s]+)==(?P<version>\S+):\s*(?P<member>\S+)", re.MULTILINE)
MiB = 1 << 20
# Every manylinux tag an x86-64 glibc host may carry (pip matches tags exactly; the image's glibc
# is 2.39): NVIDIA's wheels use _2_18, _2_25 and _2_27 tags the older lists missed.
PLATFORMS = ("manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64",
             *(f"manylinux_2_{n}_x86_64" for n in range(5, 40)))


def sha256(path: Path, start: int = 0, size: int | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        left = os.path.getsize(path) - start if size is None else size
        while left:
            block = f.read(min(left, 8 * MiB))
            if not block:
                raise OSError(f"{path}: shorter than expected")
            digest.update(block)
            left -= len(block)
    return digest.hexdigest()


# -- here: fetch and split ---------------------------------------------------------


def set_name(lock: Path) -> str:
    """``gpu-vllm033-wheels.txt`` -> ``vllm033``: the parts' and the store's name."""
    return lock.name.removeprefix("gpu-").removesuffix("-wheels.txt")


def default_store(name: str) -> Path:
    return Path(os.environ.get("GMS_VLLM_STORE", f"/var/tmp/gms-{name}-wheels"))


def fetch(dest: Path, lock: Path) -> None:
    """Every wheel of the lock file, for CPython 3.12 on x86-64 Linux, hashes checked by pip."""
    dest.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
            "--python-version", "3.12", "--implementation", "cp", "-d", str(dest), "-r", str(lock)]
    for platform in PLATFORMS:
        argv += ["--platform", platform]
    # The constraints file some machines set for torch would make pip refuse the pins.
    subprocess.run(argv, check=True, env={**os.environ, "PIP_CONSTRAINT": ""})


def plan(wheels: list[tuple[str, int]], part_bytes: int) -> list[dict]:
    """Pieces for ``(name, size)`` wheels: largest first, cut where a part is full.  Pure."""
    pieces, part, used = [], 1, 0
    for name, size in sorted(wheels, key=lambda w: (-w[1], w[0])):
        offset, index = 0, 0
        while offset < size:
            if used == part_bytes:
                part, used = part + 1, 0
            n = min(size - offset, part_bytes - used)
            whole = offset == 0 and n == size
            pieces.append({"file": name if whole else f"{name}.{index:03d}", "wheel": name, "part": part,
                           "offset": offset, "size": n})
            offset, used, index = offset + n, used + n, index + 1
    return pieces


def prunes(lock: Path) -> dict[tuple[str, str], list[str]]:
    """The lock file's ``# prune`` lines: (normalized name, version) -> members."""
    out: dict[tuple[str, str], list[str]] = {}
    for m in PRUNE.finditer(lock.read_text()):
        out.setdefault((_norm(m["wheel"]), m["version"]), []).append(m["member"])
    return out


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _dropped(member: str, drops: list[str]) -> bool:
    return any(member == d or (d.endswith("/") and member.startswith(d)) for d in drops)


def prune(wheel: Path, drops: list[str], dest: Path) -> list[str]:
    """``wheel`` without ``drops``, written to ``dest`` (RECORD rewritten); the members dropped.

    A drop that matches nothing is an error: the lock file names a member this release lacks."""
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(dest, "w") as zout:
        names = zin.namelist()
        gone = [n for n in names if _dropped(n, drops)]
        unmatched = [d for d in drops if not any(_dropped(n, [d]) for n in names)]
        if unmatched:
            raise SystemExit(f"{wheel.name}: nothing to prune at {', '.join(unmatched)}")
        for info in zin.infolist():
            if info.filename in gone:
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line for line in data.splitlines(keepends=True)
                                if line.split(b",", 1)[0].decode() not in gone)
            zout.writestr(info, data, compress_type=info.compress_type, compresslevel=6)
    return gone


def _wheel_key(name: str) -> tuple[str, str]:
    dist, version = name.split("-")[:2]
    return _norm(dist), version


def split(src: Path, out: Path, part_bytes: int, lock: Path) -> None:
    wheels = sorted(src.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"no wheels in {src}")
    name = set_name(lock)
    with tempfile.TemporaryDirectory(prefix="gms-pruned-") as pruned:
        manifest = _write_parts(wheels, out, part_bytes, name, prunes(lock), Path(pruned))
    text = json.dumps(manifest, indent=1) + "\n"
    for part in range(1, manifest["parts"] + 1):
        folder = out / f"{name}-part{part}"
        (folder / "MANIFEST.json").write_text(text)
        size = sum(p.stat().st_size for p in folder.iterdir())
        print(f"{folder}: {size / MiB:.1f} MiB, {sum(1 for p in manifest['pieces'] if p['part'] == part)} pieces")
    print(f"{len(wheels)} wheels, {sum(w['size'] for w in manifest['wheels']) / MiB:.1f} MiB in "
          f"{manifest['parts']} parts of at most {part_bytes / MiB:.0f} MiB")


def _write_parts(wheels: list[Path], out: Path, part_bytes: int, name: str, drops: dict, pruned_dir: Path) -> dict:
    """Prune, plan and cut ``wheels`` into ``out/NAME-partK``; the manifest (without writing it)."""
    entries, sources = [], {}
    for w in wheels:
        entry = {"name": w.name, "size": w.stat().st_size, "sha256": sha256(w)}
        if _wheel_key(w.name) in drops:
            target = pruned_dir / w.name
            gone = prune(w, drops[_wheel_key(w.name)], target)
            entry = {"name": w.name, "size": target.stat().st_size, "sha256": sha256(target),
                     "original_sha256": entry["sha256"], "original_size": entry["size"], "pruned": gone}
            print(f"{w.name}: {len(gone)} members pruned, {entry['original_size'] / MiB:.1f} -> "
                  f"{entry['size'] / MiB:.1f} MiB")
            w = target
        sources[entry["name"]] = w
        entries.append(entry)
    manifest = {
        "format": 1, "set": name, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "part_bytes": part_bytes, "wheels": entries,
    }
    pieces = plan([(w["name"], w["size"]) for w in manifest["wheels"]], part_bytes)
    manifest["parts"] = max(p["part"] for p in pieces)
    for part in range(1, manifest["parts"] + 1):
        folder = out / f"{name}-part{part}"
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
    for piece in pieces:
        target = out / f"{name}-part{piece['part']}" / piece["file"]
        with open(sources[piece["wheel"]], "rb") as f, open(target, "wb") as g:
            f.seek(piece["offset"])
            left = piece["size"]
            while left:
                block = f.read(min(left, 8 * MiB))
                g.write(block)
                left -= len(block)
        piece["sha256"] = sha256(target)
    manifest["pieces"] = pieces
    return manifest


# -- there: receive, join, install ---------------------------------------------------


def _status(store: Path, manifest: dict) -> tuple[list[int], list[int]]:
    """Parts whose every piece is in the store, checked; and the parts still missing."""
    ok_file = store / "pieces-ok.json"
    checked = set(json.loads(ok_file.read_text())) if ok_file.exists() else set()
    have, missing = [], []
    for part in range(1, manifest["parts"] + 1):
        files = [p["file"] for p in manifest["pieces"] if p["part"] == part]
        (have if all(f in checked for f in files) else missing).append(part)
    return have, missing


def receive(part_dir: Path, store: Path | None) -> int:
    """Copy one part into the store and check it; install when every part is there.

    Returns 0 when installed (now or before), 3 while parts are missing, 1 on a bad piece.
    """
    manifest = json.loads((part_dir / "MANIFEST.json").read_text())
    store = store or default_store(manifest.get("set", "vllm"))
    store.mkdir(parents=True, exist_ok=True)
    stored = store / "MANIFEST.json"
    if stored.exists() and json.loads(stored.read_text())["wheels"] != manifest["wheels"]:
        print(f"store {store} holds another wheel set: starting it over")
        shutil.rmtree(store)
        store.mkdir(parents=True)
    stored.write_text(json.dumps(manifest, indent=1) + "\n")
    if (store / "installed").exists():
        print(f"already installed from {store} ({(store / 'installed').read_text().strip()})")
        return 0
    (store / "pieces").mkdir(exist_ok=True)
    ok_file = store / "pieces-ok.json"
    checked = set(json.loads(ok_file.read_text())) if ok_file.exists() else set()
    by_file = {p["file"]: p for p in manifest["pieces"]}
    arrived, size, bad = [], 0, []
    for path in sorted(part_dir.iterdir()):
        piece = by_file.get(path.name)
        if piece is None:
            continue
        target = store / "pieces" / path.name
        shutil.copyfile(path, target)
        digest = sha256(target)
        if digest != piece["sha256"] or target.stat().st_size != piece["size"]:
            bad.append(path.name)
            target.unlink()
            continue
        checked.add(path.name)
        arrived.append(piece["part"])
        size += piece["size"]
    ok_file.write_text(json.dumps(sorted(checked)))
    parts = sorted(set(arrived))
    print(f"arrived: part {', '.join(map(str, parts)) or '?'} of {manifest['parts']} from {part_dir}: "
          f"{len(arrived)} pieces, {size / MiB:.1f} MiB, sha256 {'BAD: ' + ', '.join(bad) if bad else 'ok'}")
    have, missing = _status(store, manifest)
    print(f"store {store}: parts {have or 'none'} checked; missing {missing or 'none'}")
    if bad:
        return 1
    if missing:
        print("  (a fresh machine starts with an empty store: send the missing parts to this same warm machine)")
        return 3
    return install(store, manifest)


def join(store: Path, manifest: dict) -> Path | None:
    """Every wheel joined from its pieces in ``store/wheels``, each sha256 checked; None if one fails."""
    wheels = store / "wheels"
    wheels.mkdir(exist_ok=True)
    started = time.monotonic()
    for wheel in manifest["wheels"]:
        target = wheels / wheel["name"]
        pieces = sorted((p for p in manifest["pieces"] if p["wheel"] == wheel["name"]), key=lambda p: p["offset"])
        with open(target, "wb") as out:
            for piece in pieces:
                with open(store / "pieces" / piece["file"], "rb") as f:
                    shutil.copyfileobj(f, out, 8 * MiB)
        if sha256(target) != wheel["sha256"]:
            print(f"joined {wheel['name']} does not match its sha256: not installing")
            return None
    print(f"joined and checked {len(manifest['wheels'])} wheels "
          f"({sum(w['size'] for w in manifest['wheels']) / MiB:.1f} MiB) in {time.monotonic() - started:.1f} s")
    return wheels


def install(store: Path, manifest: dict) -> int:
    """Join the pieces, check every wheel's sha256, and pip-install them all into this python."""
    wheels = join(store, manifest)
    if wheels is None:
        return 1
    started = time.monotonic()
    argv = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
            "--no-cache-dir", "--disable-pip-version-check", *sorted(str(p) for p in wheels.glob("*.whl"))]
    result = subprocess.run(argv)
    if result.returncode != 0:
        print(f"pip install failed ({result.returncode})")
        return result.returncode
    print(f"installed into {sys.prefix} ({sys.executable}) in {time.monotonic() - started:.1f} s")
    (store / "installed").write_text(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()) + "\n")
    return 0


def check() -> int:
    """Print vLLM's requirements that the installed packages do not meet (information only)."""
    from importlib import metadata

    try:
        from packaging.requirements import Requirement
    except ImportError:
        print("packaging is not installed: cannot check")
        return 0
    env = {"extra": ""}
    unmet = []
    for text in metadata.requires("vllm") or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            unmet.append(f"{req.name}: not installed")
            continue
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            unmet.append(f"{req.name} {version}: vLLM asks {req.specifier}")
    print(f"vllm {metadata.version('vllm')}: {len(unmet)} requirements not met as declared "
          "(packages left out on purpose are listed in scripts/gpu-vllm-wheels.txt):")
    for line in unmet:
        print("  " + line)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lock", type=Path, default=LOCK, help=f"the release's lock file (default {LOCK.name})")
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch")
    f.add_argument("dest", type=Path)
    s = sub.add_parser("split")
    s.add_argument("src", type=Path)
    s.add_argument("out", type=Path)
    s.add_argument("--part-bytes", type=int, default=PART_BYTES)
    r = sub.add_parser("receive")
    r.add_argument("part", type=Path)
    r.add_argument("--store", type=Path, default=None,
                   help="where parts gather (default $GMS_VLLM_STORE, else /var/tmp/gms-SET-wheels)")
    sub.add_parser("check")
    args = p.parse_args(argv)
    if args.cmd == "fetch":
        fetch(args.dest, args.lock)
        return 0
    if args.cmd == "split":
        split(args.src, args.out, args.part_bytes, args.lock)
        return 0
    if args.cmd == "receive":
        return receive(args.part, args.store)
    return check()


if __name__ == "__main__":
    sys.exit(main())
