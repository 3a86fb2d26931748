"""``gms status``, ``gms history`` and ``gms replay``: looking at a server, live or after the fact.

``gms history --json > log.jsonl`` saves the event log, one event per line;
``gms replay log.jsonl`` folds it offline with the same pure core the server
runs, checks every invariant and prints the table ``gms status`` prints.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import attrs

from ..errors import GMSError
from ..units import format_bytes
from ..wire import messages as m
from .common import client_error, socket_of, target_args

EXIT_REPLAY_FAILED = 2


def register(sub) -> None:
    status = sub.add_parser("status", help="the runtime state: layouts, tenants, budgets (takes no lock)")
    target_args(status)
    status.add_argument("--json", action="store_true", help="the runtime state as one JSON object")
    status.set_defaults(handler=cmd_status)

    snapshots = sub.add_parser(
        "snapshots", help="the persisted layouts: each snapshot on the disk tier (`gms delete` removes one)",
    )
    target_args(snapshots)
    snapshots.add_argument("--json", action="store_true", help="one JSON object per snapshot, one per line")
    snapshots.set_defaults(handler=cmd_snapshots)

    history = sub.add_parser("history", help="the event log (takes no lock)")
    target_args(history)
    history.add_argument("--layout", help="only this layout's events")
    history.add_argument("--since", type=int, default=0, help="events after this sequence number")
    history.add_argument("--limit", type=int, default=None, help="at most this many events after --since (default every one kept)")
    history.add_argument("--json", action="store_true", help="one JSON object per line (what replay reads)")
    history.set_defaults(handler=cmd_history)

    replay = sub.add_parser("replay", help="rebuild the state from a saved log, check it, print it")
    replay.add_argument("log", help="a file written by 'gms history --json' ('-': stdin)")
    replay.add_argument("--json", action="store_true", help="the rebuilt state as one JSON object")
    replay.set_defaults(handler=cmd_replay)


# -- tables -------------------------------------------------------------------------


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def _columns(header: tuple[str, ...], rows: list[tuple]) -> list[str]:
    cells = [header, *[tuple(str(c) for c in row) for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]


def keeper_line(state: m.GetRuntimeStateResponse) -> str:
    """What holds the node if this server dies (docs/operations.md, 'Restarts')."""
    words = {
        "attached": "attached: a crash loses nothing",
        "behind": f"behind: {format_bytes(state.keeper_backlog_bytes)} unread for {state.keeper_behind_s:.1f} s "
        "(answers to commits wait for it)",
        "gone": "GONE: a crash now loses every layout (until a keeper is back)",
        "starting": "starting",
        "none": "none (--no-keeper): a crash loses every layout",
    }
    line = words.get(state.keeper, state.keeper)
    pid = f"pid {state.keeper_pid}, " if state.keeper_pid else ""
    return pid + line + (f"; {state.keepers_lost} lost since start" if state.keepers_lost else "")


def server_line(state: m.GetRuntimeStateResponse) -> str:
    if not state.pid:
        return "-"
    line = f"pid {state.pid}, up {state.uptime_s:.0f} s"
    return line if state.keeper == "none" else line + "; `gms restart` starts the next one, every layout kept"


def stop_line(state: m.GetRuntimeStateResponse) -> str:
    """Which process to signal to stop the service (docs/operations.md, "Stopping and restarting")."""
    from .control import service_role

    if not state.service_pid:
        return "the keeper runs in another process (gms keeper): stop that" if state.pid else "-"
    return f"`gms stop` (SIGTERM to pid {state.service_pid}, {service_role(state)}): every layout released"


def _over(t: m.TenantStatus) -> str:
    from ..fsm.state import over_bounds

    over = over_bounds(t.used_bytes, t.quota_bytes, t.metadata_bytes, t.metadata_quota, t.layouts, t.max_layouts)
    return ", ".join(over) + " (cannot grow)" if over else "-"


def _saved(row: m.LayoutStatus) -> str:
    if row.unserved:
        return f"not served: {row.unserved}"
    if row.disk_bytes:
        return format_bytes(row.disk_bytes)
    if not (row.persist and row.committed):
        return "-"
    return f"waiting: {row.save_error}" if row.save_error else "saving"


def disk_line(state: m.GetRuntimeStateResponse) -> str:
    if state.disk_budget_bytes == 0:
        return "off (commits cannot persist)"
    free = f", {format_bytes(state.disk_free_bytes)} free on its disk" if state.disk_free_bytes is not None else ""
    loose = f", {format_bytes(state.disk_loose_bytes)} set aside or left" if state.disk_loose_bytes else ""
    return (f"{format_bytes(state.disk_used_bytes)} in snapshots{loose}, "
            f"{_budget(state.disk_budget_bytes, 'as the disk allows')}{free}" + (f", {state.disk_dir}" if state.disk_dir else ""))


def _budget(budget: int | None, whole: str) -> str:
    return f"budget {format_bytes(budget)}" if budget is not None else f"no budget ({whole})"


# What only a live server can say (``gms replay`` shows a log's state: none of it).
_LIVE_ONLY = frozenset({"copier", "keeper", "handles", "server", "stop"})


def status_table(path: str, state: m.GetRuntimeStateResponse, *, replayed: bool = False) -> str:
    """``gms status``'s table; ``replayed``: of a log's state (``path``: the log)."""
    host_backend = state.backend == "host"
    device = (
        f"host memory (memfd) standing in for a GPU: the host backend, device {state.device}, {state.device_uuid}"
        if host_backend else f"{state.backend}, device {state.device} ({state.device_name}) {state.device_uuid}"
    )
    rows = [
        ("log" if replayed else "socket", path),
        ("device", device),
        (
            "memory" if host_backend else "gpu",
            f"{format_bytes(state.used_bytes)} in layouts, "
            f"{_budget(state.budget_bytes, 'the whole capacity')}, "
            f"capacity {format_bytes(state.capacity_bytes)}, {format_bytes(state.device_free_bytes)} free",
        ),
        (
            "host tier",
            f"{format_bytes(state.host_used_bytes)}, {_budget(state.host_budget_bytes, 'as host memory allows')}"
            + (f", pool {format_bytes(state.host_pool_bytes)} made ahead" if state.host_pool_bytes else ""),
        ),
        ("disk tier", disk_line(state)),
        ("copier", state.copier + (f" (pid {state.copier_pid})" if state.copier_pid else "")),
        ("keeper", keeper_line(state)),
        ("metadata", f"{format_bytes(state.metadata_bytes)} of {format_bytes(state.max_metadata_bytes)} (server RAM)"),
        ("sessions", f"{state.sessions} ({state.waiting} waiting for a lock)"),
        (
            "handles",
            f"device {state.server_handle_count} "
            f"({format_bytes(state.server_handle_bytes)}), "
            f"host {state.host_handle_count} ({format_bytes(state.host_handle_bytes)}), "
            f"{state.allocations_cleared} cleared",
        ),
        ("events", f"{state.first_event_seq}..{state.last_event_seq} kept ({format_bytes(state.event_log_bytes)})"),
        ("server", server_line(state)),
        ("stop", stop_line(state)),
    ]
    if replayed:
        rows = [(k, v) for k, v in rows if k not in _LIVE_ONLY]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    layouts = [
        (
            r.name, r.state, r.residency, r.tier + (" (restoring)" if r.restoring else ""),
            format_bytes(r.bytes), _saved(r), r.allocation_count, r.readers, "yes" if r.writer else "-",
            f"{r.waiting_writers}/{r.waiting_readers}", r.owner or "-", _ago(r.last_use_s),
            r.loads, r.restores, r.evictions, r.memory_layout_hash[:12] or "-",
        )
        for r in state.layouts
    ]
    lines += ["", *_columns(
        ("LAYOUT", "STATE", "RESIDENCY", "TIER", "BYTES", "ON DISK", "ALLOCS", "READERS", "WRITER",
         "WAITING W/R", "OWNER", "LAST USE", "LOADS", "RESTORES", "EVICTIONS", "HASH"),
        layouts,
    )]
    if not layouts:
        lines.append("(no layouts)")
    tenants = [
        (
            t.name, format_bytes(t.used_bytes), format_bytes(t.quota_bytes), t.sessions,
            format_bytes(t.metadata_bytes), format_bytes(t.metadata_quota),
            f"{t.layouts}/{'-' if t.max_layouts is None else t.max_layouts}",
            format_bytes(t.disk_bytes), format_bytes(t.disk_quota), _over(t),
        )
        for t in state.tenants
    ]
    lines += ["", *_columns(
        ("TENANT", "USED", "QUOTA", "SESSIONS", "METADATA", "META QUOTA", "LAYOUTS", "DISK", "DISK QUOTA", "OVER"),
        tenants,
    )]
    return "\n".join(lines)


def _runtime_state(args: argparse.Namespace, verb: str) -> tuple[str, m.GetRuntimeStateResponse | None]:
    """The socket and its server's runtime state; None (said on stderr) where it cannot be had."""
    from ..client.probes import get_runtime_state

    path = socket_of(args)
    try:
        return path, get_runtime_state(path, timeout=args.timeout)
    except GMSError as exc:
        print(client_error(verb, exc), file=sys.stderr)
        return path, None


def cmd_status(args: argparse.Namespace) -> int:
    path, state = _runtime_state(args, "status")
    if state is None:
        return 1
    if args.json:
        print(json.dumps({"socket": path, **attrs.asdict(state)}))
    else:
        print(status_table(path, state))
    return 0


def cmd_snapshots(args: argparse.Namespace) -> int:
    path, state = _runtime_state(args, "snapshots")
    if state is None:
        return 1
    rows = sorted((row for row in state.layouts if row.disk_bytes or row.kept_bytes), key=lambda row: row.name)
    if args.json:
        for row in rows:
            print(json.dumps({"layout": row.name, "owner": row.owner, "disk_bytes": row.disk_bytes,
                              "kept_bytes": row.kept_bytes, "tier": row.tier,
                              "memory_layout_hash": row.memory_layout_hash}))
        return 0
    if not state.disk_dir:
        print(f"{path}: no disk tier (gms serve --disk-dir)")
        return 0
    table = [(r.name, r.owner or "-", format_bytes(r.disk_bytes) if r.disk_bytes else "-",
              f"{format_bytes(r.kept_bytes)} (earlier commit)" if r.kept_bytes else "-", r.tier,
              r.memory_layout_hash[:16] or "-") for r in rows]
    print(f"{len(rows)} snapshots, {format_bytes(state.disk_used_bytes)} in {state.disk_dir}")
    if rows:
        print("\n".join(_columns(("LAYOUT", "OWNER", "ON DISK", "KEPT", "TIER NOW", "HASH"), table)))
    return 0


# -- history --------------------------------------------------------------------------


def cmd_history(args: argparse.Namespace) -> int:
    from ..client.probes import get_event_history, iter_event_history
    from ..operator.postmortem import event_row

    path = socket_of(args)
    try:
        if args.limit is None:
            events = list(iter_event_history(path, args.since, layout=args.layout, timeout=args.timeout))
        else:
            page = get_event_history(path, args.since, args.limit, layout=args.layout, timeout=args.timeout)
            events = page.events
    except GMSError as exc:
        print(client_error("history", exc), file=sys.stderr)
        return 1
    for e in events:
        if args.json:
            print(json.dumps(event_row(e.seq, e.time, e.to_event())))
        else:
            stamp = time.strftime("%H:%M:%S", time.localtime(e.time)) + f".{int(e.time * 1000) % 1000:03d}"
            fields = {k: v.hex() if isinstance(v, bytes) else v for k, v in e.fields.items() if k != "layout"}
            detail = " ".join(f"{k}={v}" for k, v in fields.items())
            print(f"{e.seq:>8}  {stamp}  conn {e.conn:<5} {e.layout or '-':<16} {e.kind:<22} {detail}")
    return 0


# -- replay ---------------------------------------------------------------------------


def cmd_replay(args: argparse.Namespace) -> int:
    from ..fsm import InvariantViolation
    from ..operator.postmortem import LogFileError, replay_rows

    try:
        stream = sys.stdin if args.log == "-" else open(args.log, encoding="utf-8")
    except OSError as exc:
        print(f"gms replay: {exc}", file=sys.stderr)
        return 1
    try:
        with stream:
            result = replay_rows(stream)
    except LogFileError as exc:
        print(f"gms replay: {exc}", file=sys.stderr)
        return EXIT_REPLAY_FAILED
    except InvariantViolation as exc:
        print(f"gms replay: the log breaks an invariant: {exc}", file=sys.stderr)
        return EXIT_REPLAY_FAILED
    state = result.runtime_state()
    if args.json:
        print(json.dumps({"replayed": result.count, "last_seq": result.last_seq, **attrs.asdict(state)}))
    else:
        print(status_table(args.log, state, replayed=True))
        print(f"\nreplayed {result.count} events (1..{result.last_seq}); every invariant holds")
    return 0
