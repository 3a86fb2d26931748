"""``gms``: serve, status, history.

    gms serve [--device N] [--tag weights --tag kv_cache] [--backend auto|cuda|host] ...
    gms status [--socket PATH | --device N --tag TAG] [--json]
    gms history [--socket PATH | ...] [--since SEQ] [--limit N] [--json]
    gms ray-resources [--devices all|0,1] [--backend auto|cuda|host]
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
import traceback

import attrs

from . import paths
from .errors import GMSError
from .fds import reserve_fd_slots
from .wire.messages import MAX_FDS_PER_MESSAGE

EXIT_FATAL = 70  # EX_SOFTWARE: a broken invariant or a CUDA failure

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """``1073741824``, ``1g``, ``1GiB``, ``512MiB``, ``64M``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def format_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def _device_list(text: str) -> list[int] | None:
    """``all`` (None) or ``0,1``."""
    if text == "all":
        return None
    try:
        devices = [int(d) for d in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not 'all' or a list of devices: {text!r}") from None
    if any(d < 0 for d in devices) or len(set(devices)) != len(devices):
        raise argparse.ArgumentTypeError(f"devices must be distinct and >= 0: {text!r}")
    return devices


def _target_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket", help="socket path (default: derived from --device and --tag)")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--tag", action="append", help="default: every standard tag")
    parser.add_argument("--backend", default="auto", choices=("auto", "cuda", "host"))


def _sockets(args: argparse.Namespace) -> list[str]:
    if args.socket:
        return [args.socket]
    tags = args.tag or list(paths.DEFAULT_TAGS)
    try:
        return [paths.socket_path(args.device, tag, args.backend) for tag in tags]
    except ValueError as exc:
        raise SystemExit(f"gms: {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gms", description="GPU Memory Service")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the per-GPU memory server")
    _target_args(serve)
    serve.add_argument(
        "--devices",
        help="supervise one server process per GPU: 'all' or a list like 0,1 (CUDA only)",
    )
    serve.add_argument("--host-capacity", type=parse_bytes, help="host backend: bytes per tag")
    serve.add_argument("--alloc-retry-interval", type=_positive_float, default=0.5, metavar="S")
    serve.add_argument("--alloc-retry-timeout", type=_positive_float, default=None, metavar="S")
    serve.add_argument(
        "--socket-mode", type=lambda s: int(s, 8), default=0o600, help="octal, e.g. 660 (default 600)"
    )
    serve.add_argument("--max-frame-bytes", type=parse_bytes, default=16 << 20)
    serve.add_argument("--max-metadata-value-bytes", type=parse_bytes, default=1 << 20)
    serve.add_argument("--max-allocations", type=int, default=1 << 20)
    serve.add_argument("--max-metadata-keys", type=int, default=1 << 20)
    serve.add_argument("--event-log-retain", type=int, default=1_000_000, help="events kept")
    serve.add_argument("--log-level", default="info")

    status = sub.add_parser("status", help="print the runtime state (a probe: takes no lock)")
    _target_args(status)
    status.add_argument("--json", action="store_true")

    history = sub.add_parser("history", help="print the event log (a probe: takes no lock)")
    _target_args(history)
    history.add_argument("--since", type=int, default=0, help="events after this sequence number")
    history.add_argument("--limit", type=int, default=None)
    history.add_argument("--json", action="store_true", help="one JSON object per line")

    ray_resources = sub.add_parser(
        "ray-resources",
        help="print this node's GPU memory as Ray resources (JSON for `ray start --resources`)",
    )
    ray_resources.add_argument(
        "--devices",
        type=_device_list,
        default=None,
        help="'all' (default: every CUDA GPU; device 0 on the host backend) or a list like 0,1",
    )
    ray_resources.add_argument("--backend", default="auto", choices=("auto", "cuda", "host"))
    return parser


# -- serve --------------------------------------------------------------------


def _server_configs(args: argparse.Namespace):
    from .fsm import Limits
    from .server import ServerConfig

    if args.socket and args.tag and len(args.tag) > 1:
        raise SystemExit("gms serve: --socket serves one tag; give at most one --tag")
    tags = args.tag or ([paths.DEFAULT_TAGS[0]] if args.socket else list(paths.DEFAULT_TAGS))
    limits = Limits(
        max_allocations=args.max_allocations,
        max_metadata_keys=args.max_metadata_keys,
        max_metadata_value_bytes=args.max_metadata_value_bytes,
    )
    return [
        ServerConfig(
            socket_path=args.socket or paths.socket_path(args.device, tag, args.backend),
            device=args.device,
            tag=tag,
            backend=args.backend,
            host_capacity=args.host_capacity,
            alloc_retry_interval=args.alloc_retry_interval,
            alloc_retry_timeout=args.alloc_retry_timeout,
            socket_mode=args.socket_mode,
            max_frame_bytes=args.max_frame_bytes,
            limits=limits,
            event_log_retain=args.event_log_retain,
        )
        for tag in tags
    ]


def _leaves(exc: BaseException):
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


def _raise_fd_limit() -> None:
    """Every allocation keeps one exported fd open: allow as many as the hard limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def cmd_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    _raise_fd_limit()
    if args.devices:
        from .supervisor import supervise

        return supervise(args)
    reserve_fd_slots(2 * MAX_FDS_PER_MESSAGE)  # an export dups up to 253 fds at once

    import trio

    from .server import SocketPathError, run_servers

    try:
        configs = _server_configs(args)
    except ValueError as exc:  # a socket path that cannot exist, an unknown backend
        print(f"gms serve: {exc}", file=sys.stderr)
        return 1
    try:
        trio.run(run_servers, configs)
    except BaseException as exc:  # noqa: BLE001 - sorted into exit codes below
        leaves = list(_leaves(exc))
        if all(isinstance(e, SocketPathError | OSError) for e in leaves):
            for e in leaves:
                print(f"gms serve: {e}", file=sys.stderr)
            return 1
        for e in leaves:
            print(f"gms serve: FATAL: {type(e).__name__}: {e}", file=sys.stderr)
            traceback.print_exception(e, file=sys.stderr)
        return EXIT_FATAL
    return 0


# -- probes -------------------------------------------------------------------


def _state_table(path: str, state) -> str:
    rows = [
        ("socket", path),
        ("tag", state.tag),
        ("state", state.state),
        ("backend", f"{state.backend}, device {state.device} ({state.device_name})"),
        ("device memory", f"{format_bytes(state.device_free_bytes)} free of {format_bytes(state.device_total_bytes)}"),
        ("writer", "connected" if state.has_rw_session else "-"),
        ("readers", str(state.ro_session_count)),
        ("waiting", f"{state.waiting_writers} writers, {state.waiting_readers} others"),
        ("committed", "yes" if state.committed else "no"),
        ("layout", f"{state.allocation_count} allocations, {format_bytes(state.total_bytes)}"),
        ("layout hash", state.memory_layout_hash or "-"),
        ("server handles", f"{state.server_handle_count} ({format_bytes(state.server_handle_bytes)}), {state.allocations_cleared} cleared"),
        ("events", f"{state.last_event_seq} logged"),
        ("server", f"pid {state.pid}, up {state.uptime_s:.0f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def cmd_status(args: argparse.Namespace) -> int:
    from .client.probes import get_runtime_state

    failed = 0
    for n, path in enumerate(_sockets(args)):
        try:
            state = get_runtime_state(path)
        except GMSError as exc:
            print(f"gms status: {exc}", file=sys.stderr)
            failed += 1
            continue
        if args.json:
            print(json.dumps({"socket": path, **attrs.asdict(state)}))
        else:
            print(("\n" if n else "") + _state_table(path, state))
    return 1 if failed else 0


def _printable(value):
    return value.hex() if isinstance(value, bytes) else value


def cmd_history(args: argparse.Namespace) -> int:
    from .client.probes import get_event_history, iter_event_history

    (path, *rest) = _sockets(args)
    if rest:
        print("gms history: name one --tag or --socket", file=sys.stderr)
        return 2
    try:
        if args.limit is None:
            events = list(iter_event_history(path, args.since))
        else:
            events = get_event_history(path, args.since, args.limit).events
    except GMSError as exc:
        print(f"gms history: {exc}", file=sys.stderr)
        return 1
    for e in events:
        fields = {k: _printable(v) for k, v in e.fields.items()}
        if args.json:
            print(json.dumps({"seq": e.seq, "kind": e.kind, "time": e.time, "conn": e.conn, **fields}))
        else:
            stamp = time.strftime("%H:%M:%S", time.localtime(e.time)) + f".{int(e.time * 1000) % 1000:03d}"
            detail = " ".join(f"{k}={v}" for k, v in fields.items())
            print(f"{e.seq:>8}  {stamp}  conn {e.conn:<5} {e.kind:<24} {detail}")
    return 0


def cmd_ray_resources(args: argparse.Namespace) -> int:
    from .ray.node import node_resources  # gms.ray's node side: Ray itself is not needed here

    try:
        resources = node_resources(args.devices, args.backend)
    except GMSError as exc:
        print(f"gms ray-resources: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(resources))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = {
        "serve": cmd_serve,
        "status": cmd_status,
        "history": cmd_history,
        "ray-resources": cmd_ray_resources,
    }[args.command]
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
