"""The bench scripts' harness: a server to measure, hardware names, tables, and where results go
(``--out``: every script's one flag for it)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

# The driver calls alone (import, reserve, map, set-access per allocation) on
# fds a real server exported: the floor a gms import is measured against.
DRIVER_FLOOR = r"""
import json, sys, time
from cuda.bindings import driver as cu
from gms import GMSClientMemoryManager
from gms.cuda import vmm
mapper = vmm.VmmMapper(0)
mgr = GMSClientMemoryManager(sys.argv[1], device=0)
mgr.connect("RO")
exported = mgr.export_handles([h.allocation_id for h in mgr.list_handles()])
access = mapper._access[False]
t0 = time.perf_counter()
for info, fd in exported:
    _, handle = cu.cuMemImportFromShareableHandle(fd, vmm._POSIX_FD)
    _, va = cu.cuMemAddressReserve(info.aligned_size, mapper.granularity, 0, 0)
    cu.cuMemMap(va, info.aligned_size, 0, handle, 0)
    cu.cuMemSetAccess(va, info.aligned_size, access, 1)
print(json.dumps({"floor_s": time.perf_counter() - t0, "allocations": len(exported)}))
"""


def run_json(script: str, *args: str, timeout: float = 300) -> dict:
    """Run a Python snippet in a new process; its last stdout line is JSON."""
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"benchmark process failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def wait_for(predicate, timeout: float, what: str, poll: float = 0.05) -> None:
    """Until ``predicate()`` is true; RuntimeError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


def wait_served(socket_path: str, proc: subprocess.Popen, where: str = "", timeout: float = 60) -> None:
    """Until the server ``proc`` started answers on ``socket_path`` (``timeout`` s at
    most; ``where``: its log, named in the error)."""
    from gms import get_runtime_state
    from gms.errors import GMSError

    deadline = time.monotonic() + timeout
    while True:
        try:
            get_runtime_state(socket_path, timeout=1)
            return
        except GMSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"gms server did not start{': see ' + where if where else ''}") from None
            time.sleep(0.05)


class Server:
    """``gms serve`` in a subprocess on a private socket, ready when constructed."""

    def __init__(self, directory: str, backend: str = "cuda", name: str = "bench", *args: str,
                 log: str | None = None) -> None:
        self.socket = os.path.join(directory, f"{name}.sock")
        level = os.environ.get("GMS_BENCH_SERVER_LOG", "warning")  # info: the copier's per-copy timings
        self._log = open(log, "wb") if log else None  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "gms", "serve", "--backend", backend,
                                      "--socket", self.socket, "--log-level", level, *args],
                                     stdout=self._log, stderr=subprocess.STDOUT if log else None)
        wait_served(self.socket, self.proc, log or "")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(120)
        if self._log is not None:
            self._log.close()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


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


def dumps(results) -> str:
    """JSON indented by 2, where a list of scalars, and each row of a list that is a
    dict of scalars, take one line (a trace of thousands of samples is one line, not
    thousands)."""
    def scalar(v):
        return isinstance(v, (int, float, str, bool)) or v is None

    def flat(value):
        return isinstance(value, list) and all(scalar(v) for v in value)

    def walk(value, depth, row=False):
        pad = "  " * (depth + 1)
        if row and isinstance(value, dict) and all(scalar(v) for v in value.values()):
            return json.dumps(value)
        if isinstance(value, dict) and value:
            # keys as json.dumps writes them: a number's or None's as a string
            items = [f"{pad}{json.dumps(k if isinstance(k, str) else json.dumps(k))}: {walk(v, depth + 1)}"
                     for k, v in value.items()]
            return "{\n" + ",\n".join(items) + "\n" + "  " * depth + "}"
        if isinstance(value, list) and value and not flat(value):
            return "[\n" + ",\n".join(pad + walk(v, depth + 1, row=True) for v in value) + "\n" + "  " * depth + "]"
        return json.dumps(value)

    return walk(results, 0)


RESULTS = Path(__file__).resolve().parent / "results"


def tree_env(*roots: str, **extra: str) -> dict[str, str]:
    """This environment with ``roots`` first on PYTHONPATH (a checkout's gms, a peer's
    sources) and the caller's path after them: where a GPU host keeps its packages."""
    path = os.pathsep.join(filter(None, [*roots, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def add_out(parser) -> None:
    """Every benchmark's one flag for where its results go."""
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="folder for the results (default: $GMS_BENCH_OUT, else bench/results)")


def out_dir(out: str | None) -> Path:
    """``--out``, else ``$GMS_BENCH_OUT``, else bench/results; made if missing."""
    folder = Path(out or os.environ.get("GMS_BENCH_OUT") or RESULTS)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_results(out: str | None, name: str, results: dict, markdown: str | None = None) -> Path:
    """``NAME.json`` (the date and host first) and, given one, ``NAME.md`` in ``out_dir(out)``."""
    folder = out_dir(out)
    target = folder / f"{name}.json"
    target.write_text(dumps({"date": time.strftime("%Y-%m-%d"), "host": platform.node(), **results}) + "\n")
    if markdown is not None:
        (folder / f"{name}.md").write_text(markdown)
    print(f"\nwrote {target}")
    return target


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def gpu() -> dict:
    """The first GPU's name, driver and memory, as nvidia-smi says them ("?" where it cannot)."""
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        name, driver, total = q.stdout.strip().splitlines()[0].split(", ")
    except (OSError, IndexError, ValueError, subprocess.SubprocessError):
        name = driver = total = "?"
    return {"name": name, "driver": driver, "memory": total}


def gpu_line() -> str:
    """``NAME, driver DRIVER``: the GPU in a result's one line ("no GPU" where none answers)."""
    g = gpu()
    return "no GPU" if g["name"] == "?" else f"{g['name']}, driver {g['driver']}"


def versions(*names: str) -> dict:
    """Python's version and each named distribution's (None where not installed)."""
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out
