"""Tenants: allocate latency with 1 to 64 tenants, a killed tenant.

One server with a policy of 64 tenants.  **load**: N tenants (1, 4, 16, 64),
one process and one uid each, allocate and free; the allocate request timed
from send to answer, closed loop and open loop (``--rate`` split over the
clients), against N clients of ONE tenant in the same run.  **kill**: a
tenant holding 100 written allocations is SIGKILLed; timed from the kill to
the server's ``RW_ABORT`` and ``SESSION_CLOSED``, to a probe seeing its bytes
at 0 (and on CUDA the device's free memory back); on the host backend
against the kernel's own share of the same exit.  As root, each client is its
tenant for its ``connect()`` (``effective_ids``); not root, every client is one
tenant and the JSON says so.  docs/performance.md, section 6, has the method
in full and the figures.

    # host backend, as root (3 rounds: about 3.5 minutes on the 2-core host; --quick: 40 s)
    sudo .venv/bin/python bench/tenants.py --backend host
    # CUDA, as root (about 4 minutes on the H100 host; --repeats 1: about 1.5; --quick: under 1)
    sudo GMS_BENCH_OUT=/tmp/out .venv/bin/python bench/tenants.py --backend cuda
    #   -> /tmp/out/tenants_cuda.json (docs/results/tenants_h100.json)
    # knobs: --tenants 1,4,16,64 --repeats 3 --duration 3 --rate 1000 (host) / 400 (cuda)
    #        --size 2MiB --kill-repeats 5 --kill-allocations 100 --kill-size 2MiB
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import traceback

from _common import Server, add_out, cpu_name, gpu_line, percentile, print_table, write_results

UID_BASE = 41000  # tenant i has uid UID_BASE + i; ids no account on the machine uses
SHARED_UID = UID_BASE + 500  # the one-tenant baseline: N clients, one uid
VICTIM_UID = UID_BASE + 600
MiB = 1 << 20


# -- identity -----------------------------------------------------------------------


@contextlib.contextmanager
def effective_ids(uid: int | None):
    """Be ``uid`` (and gid ``uid``) for what is done inside; root again after.
    The kernel records the effective ids at ``connect()`` (``SO_PEERCRED``), so
    the server sees this tenant; the saved set-user-ID gives root back."""
    if uid is None:
        yield
        return
    os.setegid(uid)
    os.seteuid(uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def policy_toml(tenants: int) -> str:
    blocks = [
        f'[[tenant]]\nname = "t{i}"\nuids = [{UID_BASE + i}]\nquota = "1GiB"\nwrite = ["t{i}-*"]\n'
        for i in range(tenants)
    ]
    blocks.append(f'[[tenant]]\nname = "shared"\nuids = [{SHARED_UID}]\nquota = "64GiB"\nwrite = ["s-*"]\n')
    blocks.append(f'[[tenant]]\nname = "victim"\nuids = [{VICTIM_UID}]\nquota = "64GiB"\nwrite = ["victim-*"]\n')
    return "\n".join(blocks)


# -- the load: one client per process ------------------------------------------------------


def client(path, uid, layout, size, ready, go, start, duration, rate, out) -> None:
    from gms.client.transport import RpcTransport
    from gms.wire import messages as m

    with effective_ids(uid):
        transport = RpcTransport(path)  # connect() here: the server sees this uid
    transport.call(m.HandshakeRequest("RW", None, layout), m.HandshakeResponse)

    def cycle() -> tuple[float, float]:
        t0 = time.perf_counter()
        allocated, _ = transport.call(m.AllocateRequest(size, "bench"), m.AllocateResponse)
        t1 = time.perf_counter()
        transport.call(m.FreeAllocationRequest(allocated.allocation_id), m.FreeAllocationResponse)
        return t1 - t0, time.perf_counter() - t1

    for _ in range(20):
        cycle()
    ready.release()  # connected and warm: the clock starts once every client is
    go.wait()
    now = time.perf_counter
    while now() < start.value:
        time.sleep(0.0005)
    end = start.value + duration
    allocs, frees = [], []
    if rate:  # open loop: a schedule at ``rate`` per second, from a random phase
        period = 1.0 / rate
        due = start.value + random.random() * period
        while due < end:
            wait = due - now()
            if wait > 0:
                time.sleep(wait)
            a, f = cycle()
            allocs.append(a)
            frees.append(f)
            due += period
    else:
        while now() < end:
            a, f = cycle()
            allocs.append(a)
            frees.append(f)
    transport.close()
    out.put((allocs, frees, None))


def _client_main(*args) -> None:
    out = args[-1]
    try:
        client(*args)
    except BaseException:  # noqa: BLE001 - reported to the parent, which stops the run
        args[4].release()  # ready: do not keep the parent waiting
        out.put(([], [], traceback.format_exc()))


def run_load(path: str, uids: list[int | None], layouts: list[str], size: int, duration: float,
             rate: float, probe) -> dict:
    """Clients i = 0.. with ``uids[i]`` on ``layouts[i]``; ``rate`` is the total (0: closed loop)."""
    ctx = multiprocessing.get_context("fork")
    ready, go, start, out = ctx.Semaphore(0), ctx.Event(), ctx.Value("d", 0.0), ctx.Queue()
    per_client = rate / len(uids) if rate else 0.0
    procs = [ctx.Process(target=_client_main,
                         args=(path, uid, layout, size, ready, go, start, duration, per_client, out))
             for uid, layout in zip(uids, layouts)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.acquire(timeout=300)
    seen = probe()  # every client holds its session now
    start.value = time.perf_counter() + 0.5
    go.set()
    allocs: list[float] = []
    frees: list[float] = []
    errors = []
    for _ in procs:
        a, f, error = out.get(timeout=duration * 2 + 300)
        allocs += a
        frees += f
        if error:
            errors.append(error)
    for p in procs:
        p.join()
    if errors or not allocs:
        raise RuntimeError("a client failed:\n" + "".join(errors[:2]))
    return {
        "clients": len(uids),
        "tenants_seen": seen,
        "rate_per_s": rate or None,
        "alloc_p50_us": percentile(allocs, 0.50) * 1e6,
        "alloc_p99_us": percentile(allocs, 0.99) * 1e6,
        "alloc_max_us": max(allocs) * 1e6,
        "alloc_mean_us": statistics.fmean(allocs) * 1e6,
        "free_p50_us": percentile(frees, 0.50) * 1e6,
        "free_p99_us": percentile(frees, 0.99) * 1e6,
        "cycles_per_s": len(allocs) / duration,
        "n": len(allocs),
    }


def tenant_sessions(path: str, prefix: str):
    """A probe: how many distinct tenants named ``prefix``* hold sessions now."""
    from gms import get_runtime_state

    def probe() -> int:
        return sum(1 for t in get_runtime_state(path).tenants if t.name.startswith(prefix) and t.sessions)

    return probe


# -- a killed tenant ------------------------------------------------------------------


def _victim(path, backend, uid, count, size, ready_fd) -> None:
    from gms import GMSClientMemoryManager
    from gms.cuda import open_mapper

    open_mapper(backend, 0)  # the driver opened as root: device files need not admit the uid
    mgr = GMSClientMemoryManager(path, layout="victim-kv")
    with effective_ids(uid):
        mgr.connect("RW")
    block = os.urandom(size)
    for _ in range(count):
        va = mgr.create_mapping(size=size, tag="kv")
        mgr.write(va, block)  # real, touched memory, as a KV cache is
    os.write(ready_fd, b"x")
    while True:
        time.sleep(60)


def kill_once(path: str, backend: str, uid: int | None, count: int, size: int, poll_s: float = 0.001) -> dict:
    from gms import get_event_history, get_runtime_state

    tenant = "victim" if uid is not None else "default"
    before = get_runtime_state(path)
    base_handles = before.server_handle_count
    free_before = before.device_free_bytes
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the victim: never returns
        os.close(r)
        try:
            _victim(path, backend, uid, count, size, w)
        finally:
            os._exit(1)
    os.close(w)
    try:
        if os.read(r, 1) != b"x":
            raise RuntimeError("the victim died before it was ready")
    finally:
        os.close(r)
    held = get_runtime_state(path)
    row = held.tenant(tenant)
    assert row.used_bytes >= count * size and held.server_handle_count == base_handles + count, (row, held)
    seq = held.last_event_seq
    killed = time.monotonic_ns()
    os.kill(pid, signal.SIGKILL)
    polls = 0
    while True:
        # A probe every millisecond: a tighter loop takes the CPU the server and
        # the dying process need (on 2 cores); the event stamps are exact anyway.
        time.sleep(poll_s)
        state = get_runtime_state(path)
        polls += 1
        if state.tenant(tenant).used_bytes == 0 and state.server_handle_count == base_handles:
            seen = time.monotonic_ns()
            break
        if time.monotonic_ns() - killed > 30e9:
            raise RuntimeError("the killed tenant's bytes were not freed in 30 s")
    os.waitpid(pid, 0)
    driver_ms = None
    if backend == "cuda" and free_before is not None:  # the memory itself, as NVML sees it
        while get_runtime_state(path).device_free_bytes < free_before - 64 * MiB:
            if time.monotonic_ns() - killed > 30e9:
                break
        driver_ms = (time.monotonic_ns() - killed) / 1e6
    events = {e.kind: e for e in get_event_history(path, seq, layout="victim-kv").events}
    return {
        "allocations": count,
        "bytes": row.used_bytes,
        "server_abort_ms": (events["RW_ABORT"].mono_ns - killed) / 1e6,
        "session_closed_ms": (events["SESSION_CLOSED"].mono_ns - killed) / 1e6,
        "probe_saw_free_ms": (seen - killed) / 1e6,
        "probe_polls": polls,
        "handles_left": state.server_handle_count - base_handles,
        "host_handles": state.host_handle_count,
        "tenant_used_after": state.tenant(tenant).used_bytes,
        "device_memory_back_ms": driver_ms,
    }


def kill_floor(count: int, size: int) -> dict:
    """The kernel's part, without gms (host backend): a process that mapped and
    wrote ``count`` memfds of ``size`` is SIGKILLed (until waitpid returns), then
    the memfds' last fds are closed (their pages freed, as the server's release)."""
    import mmap

    fds = []
    for _ in range(count):
        fd = os.memfd_create("floor")
        os.ftruncate(fd, size)
        fds.append(fd)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            block = os.urandom(size)
            maps = [mmap.mmap(fd, size) for fd in fds]
            for m in maps:
                m[:] = block
            os.write(w, b"x")
            while True:
                time.sleep(60)
        finally:
            os._exit(1)
    os.close(w)
    os.read(r, 1)
    os.close(r)
    t0 = time.monotonic_ns()
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    t1 = time.monotonic_ns()
    for fd in fds:
        os.close(fd)
    t2 = time.monotonic_ns()
    return {"exit_ms": (t1 - t0) / 1e6, "release_ms": (t2 - t1) / 1e6}


# -- main ----------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="host", choices=("host", "cuda"))
    parser.add_argument("--quick", action="store_true", help="1 and 4 tenants, 1 s per point")
    parser.add_argument("--tenants", default="1,4,16,64")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per point")
    parser.add_argument("--rate", type=float, default=None,
                        help="open loop: total allocations/s over all clients (default 1000 host, 400 cuda)")
    parser.add_argument("--size", default="2MiB", help="bytes per allocation")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every point (medians reported)")
    parser.add_argument("--kill-repeats", type=int, default=5)
    parser.add_argument("--kill-allocations", type=int, default=100)
    parser.add_argument("--kill-size", default="2MiB")
    add_out(parser)
    args = parser.parse_args()
    from gms.units import parse_bytes

    counts = [1, 4] if args.quick else [int(n) for n in args.tenants.split(",")]
    duration = 1.0 if args.quick else args.duration
    repeats = 1 if args.quick else args.repeats
    rate = args.rate or (1000.0 if args.backend == "host" else 400.0)
    size, kill_size = parse_bytes(args.size), parse_bytes(args.kill_size)
    root = os.geteuid() == 0
    name = f"tenants_{args.backend}"
    results: dict = {
        "backend": args.backend, "cpu": cpu_name(), "cores": os.cpu_count(), "root": root,
        "identities": "distinct uids (effective ids at connect)" if root else "not root: every client is one uid, one tenant",
        "duration_s": duration, "repeats": repeats, "open_rate_per_s": rate, "size": size, "load": [], "kill": [],
    }
    if args.backend == "cuda":
        results["gpu"] = gpu_line()
    if not root:
        print("not root: no distinct uids; every client is this user, one tenant", file=sys.stderr)

    directory = tempfile.mkdtemp(prefix="gms-tenants-")
    os.chmod(directory, 0o755)  # other uids reach the socket (mode 666) through it
    server_args = ["--socket-mode", "666"]
    if root:
        policy = os.path.join(directory, "policy.toml")
        with open(policy, "w") as f:
            f.write(policy_toml(max(counts)))
        server_args += ["--policy", policy]
    try:
        with Server(directory, args.backend, "tenants", *server_args) as server:
            for repeat in range(repeats):  # rounds: the VM's noise moves p99 between runs
                for n in counts:
                    spread = [UID_BASE + i for i in range(n)] if root else [None] * n
                    shared = [SHARED_UID] * n if root else [None] * n
                    tenants_layouts = [f"t{i}-kv" for i in range(n)]
                    shared_layouts = [f"s-{i}-kv" for i in range(n)]
                    for mode, uids, layouts, prefix, r in (
                        ("closed, tenants", spread, tenants_layouts, "t" if root else "d", 0.0),
                        ("closed, one tenant", shared, shared_layouts, "s" if root else "d", 0.0),
                        ("open, tenants", spread, tenants_layouts, "t" if root else "d", rate),
                        ("open, one tenant", shared, shared_layouts, "s" if root else "d", rate),
                    ):
                        row = run_load(server.socket, uids, layouts, size, duration, r,
                                       tenant_sessions(server.socket, prefix))
                        row["mode"] = mode
                        row["repeat"] = repeat
                        results["load"].append(row)
                        print(f"{n:3d} clients, {mode:18s}: alloc p50 {row['alloc_p50_us']:8.0f} µs  "
                              f"p99 {row['alloc_p99_us']:8.0f} µs  max {row['alloc_max_us']:8.0f} µs  "
                              f"{row['cycles_per_s']:7.0f}/s  (tenants seen {row['tenants_seen']})", flush=True)
                    write_results(args.out, name, results)
            for _ in range(args.kill_repeats):
                results["kill"].append(kill_once(server.socket, args.backend, VICTIM_UID if root else None,
                                                 args.kill_allocations, kill_size))
                k = results["kill"][-1]
                if args.backend == "host":  # the kernel's own share of it, same bytes, no gms
                    k["floor"] = kill_floor(args.kill_allocations, kill_size)
                print(f"kill: abort {k['server_abort_ms']:.2f} ms, session closed {k['session_closed_ms']:.2f} ms, "
                      f"probe saw 0 bytes {k['probe_saw_free_ms']:.2f} ms, handles left {k['handles_left']}", flush=True)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, "policy.toml"))
        with contextlib.suppress(OSError):
            os.rmdir(directory)

    # Per point, the median over the rounds (and the spread of p99).
    points: dict[tuple, list[dict]] = {}
    for r in results["load"]:
        points.setdefault((r["clients"], r["mode"]), []).append(r)
    by = {}
    for (clients, mode), rounds in points.items():
        by[(clients, mode)] = {
            "clients": clients, "mode": mode, "rounds": len(rounds), "tenants_seen": rounds[0]["tenants_seen"],
            **{key: statistics.median(r[key] for r in rounds)
               for key in ("alloc_p50_us", "alloc_p99_us", "alloc_max_us", "free_p50_us", "cycles_per_s")},
            "alloc_p99_us_range": [min(r["alloc_p99_us"] for r in rounds), max(r["alloc_p99_us"] for r in rounds)],
        }
    results["load_median"] = list(by.values())
    one = by.get((1, "open, tenants"))
    summary = {}
    for n in counts:
        t, s = by[(n, "open, tenants")], by[(n, "open, one tenant")]
        summary[n] = {
            "open_p99_vs_1_tenant": t["alloc_p99_us"] / one["alloc_p99_us"] if one else None,
            "open_p99_vs_one_tenant_same_clients": t["alloc_p99_us"] / s["alloc_p99_us"],
            "closed_p50_vs_one_tenant_same_clients": by[(n, "closed, tenants")]["alloc_p50_us"]
            / by[(n, "closed, one tenant")]["alloc_p50_us"],
        }
    results["summary"] = summary
    kills = results["kill"]
    if kills:
        results["kill_summary"] = {
            key: {"median": statistics.median(k[key] for k in kills), "max": max(k[key] for k in kills)}
            for key in ("server_abort_ms", "session_closed_ms", "probe_saw_free_ms")
        }
        results["kill_summary"]["handles_left_max"] = max(k["handles_left"] for k in kills)
        if all("floor" in k for k in kills):
            for key in ("exit_ms", "release_ms"):
                results["kill_summary"][f"floor_{key}"] = {"median": statistics.median(k["floor"][key] for k in kills)}

    print_table(
        f"allocate latency, µs, median of {repeats} rounds (open loop: {rate:.0f}/s split over the clients)",
        [(r["mode"], r["clients"], r["tenants_seen"], f"{r['alloc_p50_us']:.0f}", f"{r['alloc_p99_us']:.0f}",
          "{:.0f}-{:.0f}".format(*r["alloc_p99_us_range"]), f"{r['alloc_max_us']:.0f}", f"{r['free_p50_us']:.0f}",
          f"{r['cycles_per_s']:,.0f}") for r in results["load_median"]],
        header=("load", "clients", "tenants", "p50", "p99", "p99 range", "max", "free p50", "cycles/s"),
    )
    print_table(
        "a killed tenant (ms from SIGKILL)",
        [(k["allocations"], k["bytes"] >> 20, f"{k['server_abort_ms']:.2f}", f"{k['session_closed_ms']:.2f}",
          f"{k['probe_saw_free_ms']:.2f}", k["handles_left"],
          "-" if k["device_memory_back_ms"] is None else f"{k['device_memory_back_ms']:.1f}",
          f"{k['floor']['exit_ms']:.2f}" if "floor" in k else "-",
          f"{k['floor']['release_ms']:.2f}" if "floor" in k else "-") for k in kills],
        header=("allocations", "MiB", "abort", "session closed", "probe saw 0", "handles left", "device memory back",
                "floor: exit", "floor: release"),
    )
    write_results(args.out, name, results)


if __name__ == "__main__":
    main()
