"""Same-run benchmark: gms against Dynamo's GPU Memory Service, on one GPU.

Both servers run at once, each in its own process on a private socket; every
row runs in a fresh client process per side, through that side's own client,
sides interleaved (gms, Dynamo, gms, ...) over the repeats; medians of the
repeats are reported.  Rows: RO handshake through the client and over a raw
socket; export; the server's fd table after 2,000 exports; metadata get; RPC
throughput with 8 client processes; allocate; allocate + first export;
metadata put; and importing Llama-3-8B's 291 allocations (16 GB) in a fresh
process (gms's batched path as an extra row).

    python bench/peers/run.py --dynamo .peers/dynamo              # full (~4 min on the H100)
    python bench/peers/run.py --dynamo .peers/dynamo --quick      # one repeat, fewer requests
    python bench/peers/run.py --dynamo .peers/dynamo --check      # 10 of each: does every row run?
    python bench/peers/run.py --backend host [--check]            # gms's half alone, no GPU

Dynamo's package is read from the folder given (bench/peers/README.md says how
to fetch it); without it, gms runs alone and the table says so.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from _common import add_out, cpu_name, gpu_line, tree_env, versions, write_results  # noqa: E402

# requests per row: (full, quick, check); warm-up calls are a tenth, at least 2
SIZES = {
    "handshake": (2000, 500, 10), "raw_handshake": (2000, 500, 10), "export": (2000, 500, 10),
    "export_fds": (2000, 2000, 10), "metadata_get": (5000, 1000, 10), "allocate": (1000, 300, 10),
    "allocate_export": (1000, 300, 10), "metadata_put": (2000, 500, 10),
}
READ_ROWS = ["handshake", "raw_handshake", "export", "export_fds", "metadata_get", "throughput"]
WRITE_ROWS = ["allocate", "allocate_export", "metadata_put"]  # after the reads: a writer clears the layout

TITLES = {
    "handshake": "handshake RO (connect, handshake, close), client",
    "raw_handshake": "handshake RO, raw socket (no client library)",
    "allocate": "allocate 2 MiB",
    "export": "export (fd)",
    "allocate_export": "allocate 2 MiB + first export",
    "export_fds": "server fds added by {n:,} exports",
    "metadata_put": "metadata put",
    "metadata_get": "metadata get",
    "throughput": "RPC throughput, {processes} client processes (metadata get)",
    "floor_connect": "floor: connect, one frame each way, close, on a bare {frameworks} server",
    "floor_round_trip": "floor: one frame each way on an open connection, bare {frameworks} server",
    "floor_throughput": "floor: throughput, {processes} client processes, one frame each way, bare {frameworks} server",
    "handshake_nopoll": "handshake RO, client, gms not polling (`GMS_CLIENT_SPIN_US=0`; extra)",
    "metadata_get_nopoll": "metadata get, gms not polling (extra)",
    "import": "import {allocations} allocations ({size}), fresh process, one call each",
    "import_batched": "import, gms batched (`create_mappings`; extra)",
}
ORDER = ["handshake", "handshake_nopoll", "raw_handshake", "floor_connect", "allocate", "export", "allocate_export",
         "export_fds", "metadata_put", "metadata_get", "metadata_get_nopoll", "floor_round_trip", "throughput",
         "floor_throughput", "import", "import_batched"]
FLOOR_ROWS = ["floor_connect", "floor_round_trip", "floor_throughput"]
RATE_ROWS = ("throughput", "floor_throughput")  # requests per second, all processes together
EXTRA = {"handshake_nopoll": "handshake", "metadata_get_nopoll": "metadata_get", "import_batched": "import"}


# --pin: every client process on CPU 0, each server (all its threads) on a CPU of
# its own, the throughput row's processes on CPUs 3 and up.  Where a client and
# its server run decides what a wake-up costs (bench/rpc_profile.py --cpus), and
# unpinned the scheduler decides differently from process to process.
CLIENT_CPU, SERVER_CPUS = 0, {"gms": 1, "dynamo": 2}


def pin_process(pid: int, cpu: int) -> None:
    for task in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(task), {cpu})


class Side:
    """One implementation: its server process and how to run a row against it."""

    def __init__(self, name: str, script: Path, env: dict, socket: str, pid: int) -> None:
        self.name, self.script, self.env, self.socket, self.pid = name, script, env, socket, pid

    def run(self, row: str, params: dict) -> dict:
        params = {"socket": self.socket, "server_pid": self.pid, **params}
        pin = (lambda: os.sched_setaffinity(0, {CLIENT_CPU})) if params.get("pin") else None
        out = subprocess.run([sys.executable, str(self.script), row, json.dumps(params)],
                             capture_output=True, text=True, env=self.env, timeout=600, preexec_fn=pin)
        if out.returncode != 0:
            return {"error": out.stderr[-2500:] or out.stdout[-2500:]}
        return json.loads(out.stdout.strip().splitlines()[-1])


def start_floor(kind: str, directory: str) -> tuple[str, subprocess.Popen]:
    """A bare server of gms's framework (trio) or Dynamo's (asyncio): bench/peers/floors.py."""
    path = os.path.join(directory, f"floor-{kind}.sock")
    proc = subprocess.Popen([sys.executable, str(HERE / "floors.py"), "serve", kind, path], env=tree_env(str(ROOT)))
    deadline = time.monotonic() + 60
    while True:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
            return path, proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the bare {kind} server did not start") from None
            time.sleep(0.02)
        finally:
            probe.close()


# -- aggregation ---------------------------------------------------------------------------


def median_of(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if key in r]
    return statistics.median(values) if values else None


def summarize(row: str, runs: list[dict]) -> dict:
    good = [r for r in runs if "error" not in r]
    out: dict = {"runs": runs, "errors": len(runs) - len(good)}
    if not good:
        return out
    if row == "export_fds":
        out.update(added=median_of(good, "added"), exports=good[0]["exports"])
    elif row in RATE_ROWS:
        out.update(ops_per_s=median_of(good, "ops_per_s"), processes=good[0]["processes"])
    elif row.startswith("import"):
        out.update({k: median_of(good, k) for k in ("total_ms", "setup_ms", "connect_ms", "list_ms", "map_ms")
                    if median_of(good, k) is not None})
        out.update(min_ms=min(r["total_ms"] for r in good), max_ms=max(r["total_ms"] for r in good),
                   allocations=good[0]["allocations"], bytes=good[0]["bytes"])
    else:
        out.update(p50_us=median_of(good, "p50_us"), p99_us=median_of(good, "p99_us"))
    return out


def ratio(g: float | None, d: float | None, higher_is_better: bool = False) -> str:
    if not g or not d:
        return ""
    r = g / d
    better = r > 1 if higher_is_better else r < 1
    factor = max(r, 1 / r)
    return f"{r:.2f} ({factor:.1f}x {'faster' if better else 'slower'})"


def cell(row: str, s: dict | None) -> str:
    if not s:
        return ""
    if len(s) <= 2:  # runs and errors only: every run failed
        return "failed"
    if row == "export_fds":
        return f"+{s['added']:,.0f}"
    if row in RATE_ROWS:
        return f"{s['ops_per_s']:,.0f} /s"
    if row.startswith("import"):
        spread = f" ({s['min_ms']:.0f}-{s['max_ms']:.0f})" if s["min_ms"] != s["max_ms"] else ""
        return f"{s['total_ms']:.1f} ms{spread}"
    return f"{s['p50_us']:,.0f} / {s['p99_us']:,.0f} µs"


def table(results: dict) -> str:
    rows, sides = results["rows"], results["sides"]
    lines = ["| metric | gms | Dynamo | gms/Dynamo |", "| --- | --- | --- | --- |"]
    for row in ORDER:
        if row not in rows:
            continue
        g, d = rows[row].get("gms"), rows[row].get("dynamo")
        if row in EXTRA:  # gms alone: against Dynamo's figure in the row it varies
            d = rows.get(EXTRA[row], {}).get("dynamo")
        first = g or d or {}
        size = first.get("bytes", 0)
        size = f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.0f} MiB"
        title = TITLES[row].format(n=first.get("exports", 0), processes=first.get("processes", 0),
                                   allocations=first.get("allocations", 0), size=size,
                                   frameworks=" / ".join(results.get("floors", {}).values()))
        if row != "export_fds" and row not in RATE_ROWS and not row.startswith("import") and row not in EXTRA:
            title += " p50 / p99"
        if row == "export_fds":
            r = ""
        elif row in RATE_ROWS:
            r = ratio(g and g.get("ops_per_s"), d and d.get("ops_per_s"), higher_is_better=True)
        elif row.startswith("import"):
            r = ratio(g and g.get("total_ms"), d and d.get("total_ms"))
        else:
            r = " / ".join(x for x in (ratio(g and g.get("p50_us"), d and d.get("p50_us")),
                                       ratio(g and g.get("p99_us"), d and d.get("p99_us"))) if x)
        lines.append(f"| {title} | {cell(row, g)} | {cell(row, d) if 'dynamo' in sides or d else 'not run'}"
                     f" | {r} |")
    notes = []
    for row in ("import", "import_batched"):  # where an import's time goes, per side
        for name, s in rows.get(row, {}).items():
            if s and "total_ms" in s:
                parts = ", ".join(f"{k[:-3]} {s[k]:.1f}" for k in ("setup_ms", "connect_ms", "list_ms", "map_ms") if k in s)
                notes.append(f"* {row}, {name}: {parts} ms")
    if notes:
        lines += ["", "Where an import's time goes (medians; setup: creating gms's manager; "
                      "Dynamo's connect is its manager's constructor):", *notes]
    return "\n".join(lines)


# -- the run ------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dynamo", type=Path, help="the peer's folder (lib/gpu_memory_service, components/src/dynamo)")
    parser.add_argument("--backend", default="cuda", choices=("cuda", "host"), help="gms's backend (Dynamo: cuda only)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="one repeat, fewer requests (~1.5 min)")
    mode.add_argument("--check", action="store_true", help="10 requests a row, one repeat: validates every row")
    parser.add_argument("--repeats", type=int, help="client processes per row and side (default 3; 1 quick/check)")
    parser.add_argument("--processes", type=int, default=8, help="client processes for the throughput row")
    parser.add_argument("--dynamo-log-level", default="WARNING", help="INFO: Dynamo's server as shipped")
    parser.add_argument("--pin", action="store_true",
                        help="clients on CPU 0, gms's server on CPU 1, Dynamo's on CPU 2, throughput processes on 3+")
    add_out(parser)
    args = parser.parse_args()
    level = 2 if args.check else 1 if args.quick else 0
    mode_name = ("full", "quick", "check")[level]
    repeats = args.repeats or (3 if level == 0 else 1)
    duration = (2.0, 1.0, 0.3)[level]
    started = time.monotonic()

    peer = args.dynamo.resolve() if args.dynamo else None
    notes = []
    if peer is None or not (peer / "lib" / "gpu_memory_service" / "server" / "rpc.py").exists():
        notes.append(f"Dynamo's folder {'not given' if peer is None else f'{peer} not found'}: gms only.")
        peer = None
    elif args.backend != "cuda":
        notes.append("Dynamo's server needs CUDA: gms only on the host backend.")
        peer = None
    if args.pin and (os.cpu_count() or 1) < 4:
        notes.append("--pin needs 4 CPUs or more: unpinned.")
        args.pin = False
    for note in notes:
        print(note, flush=True)

    import dynamo_side
    import floors as floors_mod
    import gms_side

    results: dict = {
        "mode": mode_name, "backend": args.backend, "repeats": repeats, "gpu": gpu_line(), "cpu": cpu_name(),
        "cores": os.cpu_count(), "python": sys.version.split()[0], "notes": notes,
        "versions": versions("torch", "cuda-bindings", "trio", "msgpack", "cattrs", "attrs", "msgspec", "uvloop"),
        "dynamo_log_level": args.dynamo_log_level if peer else None, "pinned": args.pin, "rows": {},
    }
    if peer is not None:
        source = peer / "SOURCE.json"
        results["dynamo"] = json.loads(source.read_text()) if source.exists() else {"path": str(peer)}
    failures = []
    with tempfile.TemporaryDirectory(prefix="gms-peers-") as directory:
        gms_server = gms_side.start_server(directory, args.backend)
        sides = [Side("gms", HERE / "gms_side.py", tree_env(str(ROOT)), gms_server.socket, gms_server.proc.pid)]
        dynamo_server = None
        try:
            if peer is not None:
                try:
                    dynamo_server = dynamo_side.start_server(peer, directory, args.dynamo_log_level)
                    sides.append(Side("dynamo", HERE / "dynamo_side.py", dynamo_side.peer_env(peer),
                                      dynamo_server.socket, dynamo_server.pid))
                except RuntimeError as exc:  # gms's half still runs; the failure is reported
                    failures.append(str(exc))
                    print(exc, file=sys.stderr, flush=True)
            results["sides"] = [s.name for s in sides]
            if args.pin:
                for side in sides:
                    pin_process(side.pid, SERVER_CPUS[side.name])

            def run_row(row: str, params: dict, key: str | None = None, only: list[Side] | None = None) -> None:
                runs: dict[str, list] = {s.name: [] for s in only or sides}
                for _ in range(repeats):
                    for side in only or sides:  # interleaved: drift hits both sides alike
                        got = side.run(row, {**params, **side_params.get(side.name, {}), "pin": args.pin})
                        runs[side.name].append(got)
                        if "error" in got:
                            failures.append(f"{side.name} {row}: {got['error']}")
                results["rows"][key or row] = {name: summarize(row, r) for name, r in runs.items()}
                print(f"{key or row}: " + ", ".join(f"{n} {cell(row, results['rows'][key or row][n])}"
                                                   for n in runs), flush=True)

            side_params: dict[str, dict] = {}
            for side in sides:
                got = side.run("setup", {"backend": args.backend, "check": args.check})
                if "error" in got:
                    raise RuntimeError(f"{side.name} setup failed:\n{got['error']}")
                side_params[side.name] = {"ids": got["ids"]}
            for row in READ_ROWS + WRITE_ROWS:
                if row in RATE_ROWS:
                    run_row(row, {"processes": args.processes, "duration": duration})
                else:
                    n = SIZES[row][level]
                    run_row(row, {"n": n, "warmup": max(2, n // 10)})
                if row in ("handshake", "metadata_get"):
                    # gms's client polls for its answers; where the scheduler puts the
                    # woken server on the polling client's CPU, the poll delays it
                    run_row(row, {"n": n, "warmup": max(2, n // 10), "spin_us": 0}, key=f"{row}_nopoll",
                            only=sides[:1])
            for side in sides:
                got = side.run("import_build", {"check": args.check})
                if "error" in got:
                    failures.append(f"{side.name} import_build: {got['error']}")
            common = {"backend": args.backend, "check": args.check, "batched": False}
            run_row("import_read", common, key="import")
            run_row("import_read", {**common, "batched": True}, key="import_batched", only=sides[:1])
            floors = [start_floor(kind, directory) for kind in ("trio", "asyncio")]
            try:
                results["floors"] = {"gms": floors_mod.loop_name("trio"), "dynamo": floors_mod.loop_name("asyncio")}
                floor_sides = [Side(name, HERE / "floors.py", tree_env(str(ROOT)), path, proc.pid)
                               for name, (path, proc) in zip(("gms", "dynamo"), floors)]
                if args.pin:
                    for side in floor_sides:
                        pin_process(side.pid, SERVER_CPUS[side.name])
                for row in FLOOR_ROWS:
                    n = SIZES["raw_handshake"][level]
                    params = {"processes": args.processes, "duration": duration} if row in RATE_ROWS else {}
                    run_row(row, {"n": n, "warmup": max(2, n // 10), **params}, only=floor_sides)
            finally:
                for _, proc in floors:
                    proc.kill()
                    proc.wait()
        finally:
            if dynamo_server is not None:
                dynamo_server.terminate()
                try:
                    dynamo_server.wait(60)
                except subprocess.TimeoutExpired:
                    dynamo_server.kill()
                results["dynamo_server_log_tail"] = Path(dynamo_server.log_path).read_text(errors="replace")[-2000:]
            gms_server.stop()

    results["table_md"] = table(results)
    results["failures"] = failures
    results["wall_s"] = time.monotonic() - started
    header = (f"Same run, {mode_name} mode, {repeats} repeat(s): {results['gpu']}; "
              f"{results['cores']} cores of {results['cpu']}; gms backend {args.backend}"
              + ("; pinned (clients CPU 0, servers CPUs 1 and 2)" if args.pin else "")
              + (f"; Dynamo at {results['dynamo'].get('commit', '?')[:12]}, log level {args.dynamo_log_level}"
                 if peer else "; Dynamo not run"))
    print(f"\n{header}\n\n{results['table_md']}\n\ngms/Dynamo: times below 1 and throughput above 1 mean gms is ahead.")
    print(f"wall time {results['wall_s']:.0f} s")
    write_results(args.out, f"peers_{args.backend}_{mode_name}", results, f"{header}\n\n{results['table_md']}\n")
    if failures:
        print("\nFAILED rows:\n" + "\n\n".join(failures), file=sys.stderr)
        sys.exit(1)
    print("every row ran" if args.check else "")


if __name__ == "__main__":
    main()
