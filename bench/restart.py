"""gms restarts without losing a byte: a live take-over and a SIGKILL, under load.

An 8B model's 291 tensors published with sentinel bytes, three reader
processes holding RO with every tensor mapped and issuing steady requests (a
``metadata_get``, then a read of that tensor through its mapping), a fourth
holding a KV cache in an RW layout, and a ``system`` layout evicted.  Then
**take-over** (``gms serve --take-over``: failed requests, must be 0; p99
during against before; the pause; the card's memory and every layout's ids
and hash unchanged; the old processes gone) and **SIGKILL** of the new
server (seconds to a server serving the same layouts; each reader's first
request after; the KV build lost and rebuilt; the evicted layout restored,
bytes checked).  docs/performance.md, section 9, has the method in full and
the figures.

One command:

    python bench/restart.py --out /tmp/restart                          # CUDA (the H100), full size
    scripts/gpu-suite.sh bench restart                                  # the same, into $OUT
    python bench/restart.py --backend host --scale 0.002 --out /tmp/restart-smoke

What the keeper adds to a request is counted by ``bench/cpu_per_request.py``
(with and without it); the ``--keeper-cost`` timing this script had is in git
(docs/performance.md, section 9).

``--scale`` multiplies every tensor's size (the structure, 291 tensors, is
kept).  Writes restart_<backend>.json and .md under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import add_out, cpu_name, percentile, wait_served, write_results  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
SENTINEL = 4096

# -- the model ------------------------------------------------------------------------


def llama3_8b_tensors(scale: float) -> list[tuple[str, int]]:
    """(name, bytes) of Llama-3-8B's tensors in bf16, each scaled (at least a page)."""
    vocab, hidden, inter, layers, kv = 128256, 4096, 14336, 32, 1024
    shapes = [("model.embed_tokens.weight", vocab * hidden)]
    for n in range(layers):
        p = f"model.layers.{n}."
        shapes += [
            (p + "self_attn.q_proj.weight", hidden * hidden), (p + "self_attn.k_proj.weight", kv * hidden),
            (p + "self_attn.v_proj.weight", kv * hidden), (p + "self_attn.o_proj.weight", hidden * hidden),
            (p + "mlp.gate_proj.weight", inter * hidden), (p + "mlp.up_proj.weight", inter * hidden),
            (p + "mlp.down_proj.weight", hidden * inter), (p + "input_layernorm.weight", hidden),
            (p + "post_attention_layernorm.weight", hidden),
        ]
    shapes += [("model.norm.weight", hidden), ("lm_head.weight", vocab * hidden)]
    return [(name, max(2 * SENTINEL, int(2 * elements * scale))) for name, elements in shapes]


def sentinel(n: int) -> bytes:
    return (n.to_bytes(4, "little") * (SENTINEL // 4))


# -- processes of the bench --------------------------------------------------------------


def publish(path: str, layout: str, tensors, residency: str = "device") -> dict:
    from gms import GMSClientMemoryManager, RequestedLockType

    writer = GMSClientMemoryManager(path, layout=layout)
    writer.connect(RequestedLockType.RW)
    started = time.monotonic()
    for n, (name, size) in enumerate(tensors):
        va = writer.create_mapping(size=size, tag=layout)
        writer.write(va, sentinel(n))
        writer.write(va + size - SENTINEL, sentinel(n))
        allocation_id = next(mp.allocation_id for mp in writer.mappings if mp.va == va)
        writer.metadata_put(name, allocation_id, 0, str(n).encode())
    writer.commit(residency)
    writer.close()
    return {"layout": layout, "tensors": len(tensors), "bytes": sum(s for _, s in tensors),
            "publish_s": time.monotonic() - started}


def layouts(path: str) -> dict:
    """name -> (hash, sorted allocation ids), through RO sessions."""
    from gms import GMSClientMemoryManager, RequestedLockType, get_runtime_state

    out = {}
    for row in get_runtime_state(path).layouts:
        if not row.committed or row.tier != "device":
            out[row.name] = {"hash": row.memory_layout_hash, "tier": row.tier, "state": row.state}
            continue
        reader = GMSClientMemoryManager(path, layout=row.name)
        reader.connect(RequestedLockType.RO)
        out[row.name] = {"hash": reader.get_memory_layout_hash(), "tier": row.tier, "state": row.state,
                         "ids": sorted(h.allocation_id for h in reader.list_handles())}
        reader.close()
    return out


READER = r"""
import json, os, random, sys, time
from gms import GMSClientMemoryManager, RequestedLockType
path, out, stop, pause = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
mgr = GMSClientMemoryManager(path, reconnect_timeout_s=120.0)
mgr.connect(RequestedLockType.RO)
handles = sorted(mgr.list_handles(), key=lambda h: h.layout_slot)
vas = mgr.create_mappings([h.allocation_id for h in handles])
keys = mgr.metadata_list()
index = {k: int(mgr.metadata_get(k)[2]) for k in keys}
rows = []
with open(out, "w") as log:
    print(json.dumps({"ready": time.time()}), file=log, flush=True)
    while not os.path.exists(stop):
        key = random.choice(keys)
        n = index[key]
        t0 = time.time()
        try:
            found = mgr.metadata_get(key)
            data = mgr.read(vas[n], 4096)
            ok = found is not None and data == n.to_bytes(4, "little") * 1024
            err = "" if ok else "wrong bytes"
        except Exception as exc:
            ok, err = False, f"{type(exc).__name__}: {exc}"
        rows.append([t0, time.time() - t0, ok, err, mgr.reconnects])
        if len(rows) >= 200:
            log.write("".join(json.dumps(r) + "\n" for r in rows)); log.flush(); rows = []
        time.sleep(pause)
    log.write("".join(json.dumps(r) + "\n" for r in rows))
mgr.close()
"""

KV = r"""
import json, os, sys, time
from gms import GMSClientMemoryManager, RequestedLockType, BuildLostError
path, out, stop, step, total = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
events = []
def build(mgr):
    mgr.connect(RequestedLockType.RW)
    made, first = 0, None
    while made < total:
        va = mgr.create_mapping(size=step, tag="kv")
        mgr.write(va, b"k" * 4096)
        first = first or next(mp.allocation_id for mp in mgr.mappings if mp.va == va)
        made += step
    return first
mgr = GMSClientMemoryManager(path, layout="kv_cache")
first = build(mgr)
events.append({"t": time.time(), "event": "built", "bytes": total})
while not os.path.exists(stop):
    t0 = time.time()
    try:
        mgr.metadata_put("step", first, 0, str(t0).encode())
        events.append({"t": t0, "event": "ok", "latency_s": time.time() - t0})
    except BuildLostError as exc:
        events.append({"t": t0, "event": "build_lost", "error": str(exc)})
        mgr.close()
        mgr = GMSClientMemoryManager(path, layout="kv_cache")
        first = build(mgr)
        events.append({"t": time.time(), "event": "rebuilt", "bytes": total, "took_s": time.time() - t0})
    except Exception as exc:
        events.append({"t": t0, "event": "failed", "error": f"{type(exc).__name__}: {exc}"})
    time.sleep(0.01)
json.dump(events, open(out, "w"))
mgr.close()
"""


def memory(path: str) -> dict:
    """What the server holds (its own count: device and host tier) and, on CUDA,
    the card's used memory (NVML, through the server's probe).  Measured once the
    server's copier runs: its CUDA context takes device memory of its own, so
    before and after compare one copier's context with one (a new server's copier
    starts after it serves)."""
    from gms import get_runtime_state

    deadline = time.time() + 60
    while (state := get_runtime_state(path)).copier not in ("running", "off") and time.time() < deadline:
        time.sleep(0.1)
    used = None
    if state.backend == "cuda" and state.device_free_bytes is not None:
        used = state.capacity_bytes - state.device_free_bytes
    return {"held_bytes": state.server_handle_bytes + state.host_handle_bytes, "device_used_bytes": used,
            "copier": state.copier}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def serve(path: str, backend: str, log: Path, *extra: str) -> subprocess.Popen:
    """``gms serve`` at info (its log tells a take-over's pause), ready when returned."""
    proc = subprocess.Popen([sys.executable, "-m", "gms", "serve", "--backend", backend, "--socket", path,
                             "--log-level", "info", *extra], stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    wait_served(path, proc, str(log), timeout=120)
    return proc


def read_rows(files) -> list[list]:
    rows = []
    for f in files:
        for line in Path(f).read_text().splitlines():
            row = json.loads(line)
            if isinstance(row, list):
                rows.append(row)
    return rows


def window(rows, start: float, end: float) -> dict:
    inside = [r for r in rows if start <= r[0] <= end]
    lat = [r[1] for r in inside]
    return {
        "requests": len(inside), "failed": sum(1 for r in inside if not r[2]),
        "p50_ms": percentile(lat, 0.5) * 1e3 if lat else None,
        "p99_ms": percentile(lat, 0.99) * 1e3 if lat else None,
        "max_ms": max(lat) * 1e3 if lat else None,
        "errors": sorted({r[3] for r in inside if not r[2]})[:5],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="cuda", choices=("cuda", "host"))
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every tensor's size (1: 16.1 GB)")
    parser.add_argument("--readers", type=int, default=3)
    parser.add_argument("--kv-bytes", type=int, default=None, help="the KV cache (default 8 GiB x scale)")
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--settle-s", type=float, default=3.0)
    parser.add_argument("--pause-s", type=float, default=0.002, help="between a reader's requests")
    add_out(parser)
    parser.add_argument("--no-spare", action="store_true",
                        help="the keepers keep no spare server standing by (the baseline of a spare's gain)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gms-restart-", dir="/tmp"))
    path = str(work / "gms.sock")
    tensors = llama3_8b_tensors(args.scale)
    kv_total = args.kv_bytes or max(4 * MiB, int(8 * GiB * args.scale))
    kv_step = max(2 * MiB, kv_total // 16)
    results: dict = {
        "backend": args.backend, "cpu": cpu_name(), "scale": args.scale, "readers": args.readers,
        "model": {"tensors": len(tensors), "bytes": sum(s for _, s in tensors), "shapes": "Llama-3-8B, bf16"},
        "kv_cache_bytes": kv_total,
    }
    procs: list[subprocess.Popen] = []
    stop = work / "stop"
    try:
        spare = ("--no-spare",) if args.no_spare else ()
        old = serve(path, args.backend, work / "old.log", *spare)
        procs.append(old)
        results["publish"] = publish(path, "weights", tensors)
        cold = [(f"cold.{n}", max(2 * SENTINEL, int(256 * MiB * args.scale))) for n in range(4)]
        results["publish_cold"] = publish(path, "cold", cold, residency="system")
        from gms.client import admin

        admin.evict(path, "cold")
        reader_logs = [work / f"reader{n}.jsonl" for n in range(args.readers)]
        readers = [subprocess.Popen([sys.executable, "-c", READER, path, str(f), str(stop), str(args.pause_s)])
                   for f in reader_logs]
        kv_log = work / "kv.json"
        kv = subprocess.Popen([sys.executable, "-c", KV, path, str(kv_log), str(stop), str(kv_step), str(kv_total)])
        procs += readers + [kv]
        while not all(f.exists() and f.read_text().startswith('{"ready"') for f in reader_logs):
            time.sleep(0.1)
        time.sleep(args.warmup_s)

        # 1. take-over
        from gms import get_runtime_state

        before_layouts = layouts(path)
        memory_before = memory(path)
        old_server = get_runtime_state(path).pid
        t0 = time.time()
        new = serve(path, args.backend, work / "new.log", "--take-over", *spare)
        procs.append(new)
        while get_runtime_state(path).pid == old_server:
            time.sleep(0.01)
        t1 = time.time()
        old.wait(120)
        time.sleep(args.settle_s)
        after_layouts = layouts(path)
        pause = re.search(r"after a pause of ([0-9.]+) ms", (work / "old.log").read_text())
        rows = read_rows(reader_logs)
        results["take_over"] = {
            "launch_to_serving_s": t1 - t0,
            "pause_ms": float(pause.group(1)) if pause else None,
            "before": window(rows, t0 - args.warmup_s, t0),
            "during": window(rows, t0, t1 + 0.5),
            "after": window(rows, t1 + 0.5, time.time()),
            "memory_before": memory_before, "memory_after": memory(path),
            "layouts_unchanged": before_layouts == after_layouts,
            "old_server_pid_gone": not alive(old_server), "old_keeper_pid_gone": not alive(old.pid),
            "old_keeper_exit": old.returncode,
        }

        # 2. SIGKILL (with a spare: once one stands by, as it does SPARE_AFTER_S after its server served)
        standing = None
        deadline = time.monotonic() + 60
        while not args.no_spare and standing is None and time.monotonic() < deadline:
            found = re.search(r"pid (\d+) standing by", (work / "new.log").read_text())
            standing = int(found.group(1)) if found else None
            time.sleep(0.05)
        standing_rss = rss_bytes(standing) if standing is not None else None  # what a spare holds idle
        server = get_runtime_state(path).pid
        kill_at = time.time()
        os.kill(server, signal.SIGKILL)
        while True:
            try:
                state = get_runtime_state(path, timeout=60)
            except Exception:  # noqa: BLE001 - the gap
                continue
            if state.pid != server and state.layout("weights").memory_layout_hash == before_layouts["weights"]["hash"]:
                break
        serving_at = time.time()
        time.sleep(args.settle_s)
        rows = read_rows(reader_logs)
        firsts = []
        for f in reader_logs:
            mine = [r for r in read_rows([f]) if r[0] >= kill_at]
            ok = [r for r in mine if r[2]]
            firsts.append({"first_ok_after_kill_s": ok[0][0] + ok[0][1] - kill_at if ok else None,
                           "its_latency_s": ok[0][1] if ok else None, "reconnects": ok[0][4] if ok else None,
                           "failed": sum(1 for r in mine if not r[2])})
        copier_at_restore = memory(path)["copier"]  # the restarted server's: it maps the chunks it adopted
        restore_started = time.time()
        from gms import GMSClientMemoryManager, RequestedLockType

        restorer = GMSClientMemoryManager(path, layout="cold")
        restorer.connect(RequestedLockType.RO)
        handles = sorted(restorer.list_handles(), key=lambda h: h.layout_slot)
        vas = restorer.create_mappings([h.allocation_id for h in handles])
        restored_ok = all(restorer.read(va, SENTINEL) == sentinel(n) for n, va in enumerate(vas))
        restore_s = time.time() - restore_started
        restorer.close()
        results["sigkill"] = {
            "to_serving_same_layouts_s": serving_at - kill_at,
            "spare": {"standing_by": standing, "took_the_node": standing is not None and state.pid == standing,
                      "rss_bytes": standing_rss},
            "readers": firsts,
            "around_the_kill": window(rows, kill_at, serving_at + 1.0),
            "layouts_unchanged": layouts(path) == {**after_layouts, "cold": layouts(path).get("cold")},
            "host_tier_restore_s": restore_s, "host_tier_bytes_ok": restored_ok,
            "host_tier_restored_with_copier": copier_at_restore,
        }
        stop.touch()
        for proc in readers + [kv]:
            proc.wait(120)
        kv_events = json.loads(kv_log.read_text())
        results["kv_cache"] = {
            "failed_during_take_over": sum(1 for e in kv_events if e["event"] == "failed" and t0 <= e["t"] <= t1 + 1),
            "failed_in_all": sum(1 for e in kv_events if e["event"] == "failed"),
            "build_lost_after_kill": any(e["event"] == "build_lost" for e in kv_events),
            "rebuilt_in_s": next((e["took_s"] for e in kv_events if e["event"] == "rebuilt"), None),
        }
    finally:
        stop.touch()
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    name = f"restart_{args.backend}"
    print(markdown(results))
    write_results(args.out, name, results, markdown(results))
    ok = results["take_over"]["during"]["failed"] == 0 and results["take_over"]["layouts_unchanged"]
    return 0 if ok else 1


def _ms(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def markdown(r: dict) -> str:
    t, k = r["take_over"], r["sigkill"]
    before, after = t["memory_before"], t["memory_after"]
    held = f"{before['held_bytes'] / GiB:.3f} -> {after['held_bytes'] / GiB:.3f} GiB"
    used = ("- (host backend)" if before["device_used_bytes"] is None else
            f"{before['device_used_bytes'] / GiB:.2f} -> {after['device_used_bytes'] / GiB:.2f} GiB")
    lines = [
        f"# gms restart ({r['backend']}, {r['model']['tensors']} tensors, {r['model']['bytes'] / GiB:.2f} GiB,"
        f" {r['readers']} readers, KV {r['kv_cache_bytes'] / GiB:.2f} GiB)",
        "",
        "| take-over | before | during | after |",
        "| --- | --- | --- | --- |",
        f"| requests | {t['before']['requests']} | {t['during']['requests']} | {t['after']['requests']} |",
        f"| failed | {t['before']['failed']} | {t['during']['failed']} | {t['after']['failed']} |",
        f"| p50 ms | {_ms(t['before']['p50_ms'])} | {_ms(t['during']['p50_ms'])} | {_ms(t['after']['p50_ms'])} |",
        f"| p99 ms | {_ms(t['before']['p99_ms'])} | {_ms(t['during']['p99_ms'])} | {_ms(t['after']['p99_ms'])} |",
        f"| max ms | {_ms(t['before']['max_ms'])} | {_ms(t['during']['max_ms'])} | {_ms(t['after']['max_ms'])} |",
        "",
        "| take-over | |",
        "| --- | --- |",
        f"| pause (old server's measure) | {_ms(t['pause_ms'])} ms |",
        f"| launch to serving | {t['launch_to_serving_s']:.2f} s |",
        f"| memory the server holds | {held} |",
        f"| the card's used memory (NVML) | {used} |",
        f"| ids and hashes unchanged | {t['layouts_unchanged']} |",
        f"| old server / keeper gone | {t['old_server_pid_gone']} / {t['old_keeper_pid_gone']} |",
        f"| KV writer failures | {r['kv_cache']['failed_during_take_over']} |",
        "",
        "| SIGKILL | |",
        "| --- | --- |",
        f"| to a server with the same layouts | {k['to_serving_same_layouts_s']:.3f} s |",
        f"| a spare standing by took the node | {k['spare']['took_the_node']} |",
        f"| readers' first request after (s, from the kill) | "
        f"{', '.join(_ms(x['first_ok_after_kill_s']) for x in k['readers'])} |",
        f"| readers' failed requests | {sum(x['failed'] for x in k['readers'])} |",
        f"| max latency around the kill | {_ms(k['around_the_kill']['max_ms'])} ms |",
        f"| layouts unchanged | {k['layouts_unchanged']} |",
        f"| KV cache build lost, rebuilt in | {r['kv_cache']['build_lost_after_kill']}, "
        f"{_ms(r['kv_cache']['rebuilt_in_s'])} s |",
        f"| evicted layout restored afterwards | {k['host_tier_restore_s']:.2f} s, bytes ok: "
        f"{k['host_tier_bytes_ok']} (copier {k['host_tier_restored_with_copier']}) |",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
