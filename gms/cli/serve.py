"""``gms serve``: one GPU's server in this process, or a supervisor of one per GPU."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from functools import partial

from ..system import paths
from ..system.cyclegc import install as install_frozen_heap
from ..system.fds import reserve_fd_slots
from ..system.heap import keep_big_blocks, return_big_blocks
from ..system.launch import python_argv, safe_import_path
from ..wire.messages import MAX_FDS_PER_MESSAGE
from .common import BACKEND_HELP, byte_count, log_level_arg, pool_size

EXIT_FATAL = 70  # EX_SOFTWARE: a broken invariant or a CUDA failure
EXIT_CONFIG = 78  # EX_CONFIG: the policy file or an option cannot be used
EXIT_REFUSED = 75  # EX_TEMPFAIL: a take-over refused; the old server serves on


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def register(sub) -> None:
    # No abbreviations: ``--devices`` hands its children the words it was given (gms.operator.supervisor).
    serve = sub.add_parser("serve", help="run the per-GPU memory server", allow_abbrev=False)
    serve.add_argument("--socket", help="socket path (default: derived from --device)")
    serve.add_argument("--device", type=int, default=0, help="the device this server owns (default 0)")
    serve.add_argument("--backend", default="auto", choices=("auto", "cuda", "host"), help=BACKEND_HELP)
    serve.add_argument(
        "--devices",
        help="supervise one server process per GPU: 'all' or a list like 0,1 (each restarted on its own)",
    )
    serve.add_argument("--policy", metavar="FILE", help="tenants, quotas and rights (TOML); default: open")
    serve.add_argument(
        "--gpu-budget", metavar="BYTES|FRACTION",
        help="what layouts may hold on the GPU, e.g. 60GiB or 0.9; beyond it idle layouts are evicted",
    )
    serve.add_argument("--host-budget", metavar="BYTES", help="bytes for host copies of evictable layouts")
    serve.add_argument("--no-host-tier", action="store_true", help="keep no host copies (no residency system)")
    serve.add_argument(
        "--no-copier", action="store_true",
        help="start no copier process: clients copy to and from the host tier themselves",
    )
    serve.add_argument(
        "--disk-dir", metavar="DIR",
        help="the disk tier's folder: snapshots of layouts committed to persist, found again after a reboot "
        "(default: /var/lib/gms/<socket>.disk for root's default socket, else beside the state)",
    )
    serve.add_argument("--disk-budget", metavar="BYTES", help="bytes of snapshots on disk (default: what fits)")
    serve.add_argument("--no-disk-tier", action="store_true", help="keep no snapshots (commits cannot persist)")
    serve.add_argument(
        "--restore-at-start", action="store_true",
        help="after a reboot, restore the layouts found on disk onto the GPU before serving (those that fit; "
        "default: each one's first reader restores it)",
    )
    serve.add_argument(
        "--host-pool", type=pool_size, default=None, metavar="BYTES|auto",
        help="pinned host memory made ahead of need, so that a system publish does not wait for it "
        "(counts against --host-budget; needs the copier).  auto (the default): pinned while writers "
        "build, up to what they have allocated, and given back once they are done; 0: none",
    )
    serve.add_argument(
        "--host-chunk", type=byte_count, default=64 << 20, metavar="BYTES",
        help="the pool's unit: host copies the copier fills are made of such chunks (default 64MiB)",
    )
    serve.add_argument("--host-capacity", type=byte_count, help="host backend: the device's size")
    serve.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    serve.add_argument("--metrics-host", default="127.0.0.1", help="address for --metrics-port")
    serve.add_argument("--alloc-retry-interval", type=_positive_float, default=0.05, metavar="S",
                       help="an allocation the device has no room for is tried again, at most this long apart (default 0.05)")
    serve.add_argument("--alloc-retry-timeout", type=_positive_float, default=None, metavar="S",
                       help="and given up on after this long (default: never, while its client waits)")
    serve.add_argument(
        "--alloc-stock", type=byte_count, default=None, metavar="BYTES",
        help="small allocations made ahead of need, outside the budget (default 64MiB on CUDA, "
        "none on the host backend; 0: none)",
    )
    serve.add_argument(
        "--socket-mode", type=lambda s: int(s, 8), default=0o600, help="octal, e.g. 660 (default 600)"
    )
    serve.add_argument("--max-frame-bytes", type=byte_count, default=16 << 20,
                       help="the largest request a client may send (default 16MiB)")
    serve.add_argument("--max-metadata-value-bytes", type=byte_count, default=1 << 20,
                       help="the largest metadata value (default 1MiB)")
    serve.add_argument("--max-allocations", type=int, default=1 << 20, help="per layout")
    serve.add_argument("--max-metadata-keys", type=int, default=1 << 20, help="per layout")
    serve.add_argument("--max-layouts", type=int, default=4096, help="layouts on the server")
    serve.add_argument(
        "--max-metadata-bytes", type=byte_count, default=256 << 20,
        help="metadata of every layout, in the server's RAM: keys, values and --metadata-entry-bytes "
        "per entry (default 256MiB)",
    )
    serve.add_argument(
        "--metadata-entry-bytes", type=byte_count, default=256,
        help="what each metadata entry is charged beyond its key and value: its cost in the server's RAM "
        "(default 256)",
    )
    serve.add_argument(
        "--tenant-metadata-quota", type=byte_count, default=64 << 20,
        help="a policy tenant's metadata bytes where the policy sets no metadata_quota (default 64MiB)",
    )
    serve.add_argument(
        "--tenant-max-layouts", type=int, default=256,
        help="a policy tenant's layouts where the policy sets no max_layouts (default 256)",
    )
    serve.add_argument(
        "--scan-cache-bytes", type=byte_count, default=64 << 20,
        help="answers to metadata scans kept for other readers (default 64MiB)",
    )
    serve.add_argument(
        "--handshake-timeout", type=_positive_float, default=10.0, metavar="S",
        help="close a connection that sends no whole request within S seconds (default 10)",
    )
    serve.add_argument(
        "--max-connections-per-uid", type=int, default=256, metavar="N",
        help="open connections per peer uid, admins aside (default 256; 0: no cap)",
    )
    serve.add_argument(
        "--fd-reserve", type=int, default=None, metavar="N",
        help="fds kept for admins' connections (default: min(256, the fd limit / 8))",
    )
    serve.add_argument("--event-log-retain", type=int, default=1_000_000, help="events kept")
    serve.add_argument(
        "--event-log-bytes", type=byte_count, default=64 << 20,
        help="memory the kept events (and the snapshot) may hold (default 64MiB)",
    )
    log_level_arg(serve)
    restarts = serve.add_argument_group(
        "restarts and take-overs",
        "By default the server runs under a keeper, a small process without CUDA that holds every "
        "allocation's fd, the listening socket and the event log, and starts a new server with all of "
        "them if it dies (docs/operations.md, 'Restarts').",
    )
    restarts.add_argument(
        "--no-keeper", action="store_true", help="run the server alone: if it dies, every layout is lost",
    )
    restarts.add_argument(
        "--no-spare", action="store_true",
        help="no spare server standing by under the keeper: a restart starts a fresh process (docs/operations.md)",
    )
    restarts.add_argument(
        "--spare-after", type=_positive_float, default=None, metavar="SECONDS",
        help="start the spare this long after a server serves (default 2; sooner competes with the "
             "server's own start for the CPUs)",
    )
    restarts.add_argument(
        "--keeper-socket", metavar="PATH",
        help="use the keeper listening on PATH (`gms keeper`, another container of the pod) instead of one's own",
    )
    restarts.add_argument("--keeper-fd", type=int, help=argparse.SUPPRESS)  # a keeper's own child
    restarts.add_argument(
        "--take-over", action="store_true",
        help="take the place of the server live on this socket (its layouts, sessions and clients; none "
        "notices); start as usual if none is",
    )
    restarts.add_argument(
        "--handover-timeout", type=_positive_float, default=30.0, metavar="S",
        help="longest wait for a quiet point, or for the other server of a take-over (default 30)",
    )
    restarts.add_argument(
        "--state-dir", metavar="DIR",
        help="where a handed state that does not rebuild is saved for `gms replay` (default: the socket's folder)",
    )
    restarts.add_argument(
        "--ready-dir", metavar="DIR",
        help="the server writes DIR/device-N.ready once it serves and removes it when it stops (for probes)",
    )
    serve.set_defaults(handler=cmd_serve)


def server_config(args: argparse.Namespace):
    """The server's configuration; raises ValueError (a bad path or option) or PolicyError."""
    from ..fsm import Limits
    from ..operator.policy import OPEN_POLICY, load_policy
    from ..server import ServerConfig

    limits = Limits(
        max_allocations=args.max_allocations,
        max_metadata_keys=args.max_metadata_keys,
        max_metadata_value_bytes=args.max_metadata_value_bytes,
        max_layouts=args.max_layouts,
        max_metadata_bytes=args.max_metadata_bytes,
        metadata_entry_bytes=args.metadata_entry_bytes,
        tenant_metadata_quota=args.tenant_metadata_quota,
        tenant_max_layouts=args.tenant_max_layouts,
    )
    return ServerConfig(
        socket_path=args.socket or paths.socket_path(args.device, args.backend, serving=True),
        device=args.device,
        backend=args.backend,
        host_capacity=args.host_capacity,
        gpu_budget=args.gpu_budget,
        host_budget=args.host_budget,
        host_tier=not args.no_host_tier,
        copier=not args.no_copier,
        host_pool_bytes=args.host_pool,
        host_chunk_bytes=args.host_chunk,
        disk_tier=not args.no_disk_tier,
        disk_dir=args.disk_dir,
        disk_budget=args.disk_budget,
        restore_at_start=args.restore_at_start,
        policy=load_policy(args.policy) if args.policy else OPEN_POLICY,
        policy_file=args.policy,
        alloc_retry_interval=args.alloc_retry_interval,
        alloc_retry_timeout=args.alloc_retry_timeout,
        alloc_stock_bytes=args.alloc_stock,
        socket_mode=args.socket_mode,
        max_frame_bytes=args.max_frame_bytes,
        limits=limits,
        event_log_retain=args.event_log_retain,
        event_log_bytes=args.event_log_bytes,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        keeper_fd=args.keeper_fd,
        keeper_socket=args.keeper_socket,
        take_over=args.take_over,
        handover_timeout=args.handover_timeout,
        state_dir=args.state_dir,
        ready_file=None if args.ready_dir is None else f"{args.ready_dir}/device-{args.device}.ready",
        scan_cache_bytes=args.scan_cache_bytes,
        handshake_timeout=args.handshake_timeout,
        max_connections_per_uid=args.max_connections_per_uid or None,
        fd_reserve=args.fd_reserve,
    )


def leaves(exc: BaseException):
    """The exceptions inside (nested) exception groups."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from leaves(inner)
    else:
        yield exc


def _raise_fd_limit() -> None:
    """Every allocation keeps one exported fd open: allow as many as the hard limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _warn_unsafe_paths(args: argparse.Namespace) -> None:
    """Say what root would import from folders others can write (docs/operations.md, "Running the daemon")."""
    import gms

    log = logging.getLogger("gms.serve")
    for path in getattr(args, "dropped_import_paths", ()):
        log.warning("not importing from %r: another user could put code there (run `gms serve`, "
                    "or `python3 -P -m gms serve`)", path or "the working folder")
    home = os.path.dirname(os.path.dirname(os.path.abspath(gms.__file__)))
    if os.geteuid() == 0 and not safe_import_path(home):
        log.warning("gms itself is installed in %s, which a user other than root can change: "
                    "that user can run code as root in every gms process", home)


def _keep(args: argparse.Namespace) -> int:
    """This process is the keeper; the server is its child, started with the same options."""
    import trio

    from ..keeper.run import keep_spawning

    argv = python_argv("gms", *getattr(args, "argv", ["serve"]))
    spare = {} if args.spare_after is None else {"spare_after": args.spare_after}
    return trio.run(partial(keep_spawning, argv, spare=not args.no_spare, **spare))


def cmd_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    from ..operator.policy import PolicyError

    _warn_unsafe_paths(args)
    try:
        config = None if args.devices else server_config(args)
        if args.devices and args.policy:
            from ..operator.policy import load_policy

            load_policy(args.policy)  # refuse a bad policy before starting any child
    except PolicyError as exc:
        print(f"gms serve: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except ValueError as exc:  # a socket path that cannot exist, an unknown backend
        print(f"gms serve: {exc}", file=sys.stderr)
        return 1
    _raise_fd_limit()
    if args.devices:
        from ..operator.supervisor import supervise

        return supervise(args)
    if not (args.no_keeper or args.keeper_fd is not None or args.keeper_socket):
        return_big_blocks()  # this process is the keeper (gms.system.heap)
        return _keep(args)
    keep_big_blocks()
    install_frozen_heap()  # full collections walk what is new, not the whole log (gms.system.cyclegc)
    reserve_fd_slots(2 * MAX_FDS_PER_MESSAGE)  # an export dups up to 253 fds at once

    import trio

    from ..server import SocketPathError, run_server
    from ..server.restart.freshness import StaleCode
    from ..server.restart.resume import TakeOverRefused, Unresumable

    try:
        trio.run(run_server, config)
    except BaseException as exc:  # noqa: BLE001 - sorted into exit codes below
        found = list(leaves(exc))
        if all(isinstance(e, TakeOverRefused) for e in found):
            for e in found:
                print(f"gms serve: the take-over did not happen (the old server serves on): {e}", file=sys.stderr)
            return EXIT_REFUSED
        if all(isinstance(e, StaleCode) for e in found):
            for e in found:
                print(f"gms serve: stepping aside for a server with the code in force: {e}", file=sys.stderr)
            return 0
        if all(isinstance(e, Unresumable) for e in found):
            for e in found:
                print(f"gms serve: the kept node cannot be served (its keeper keeps it): {e}", file=sys.stderr)
            return EXIT_CONFIG
        if all(isinstance(e, SocketPathError | OSError | ValueError) for e in found):
            for e in found:
                print(f"gms serve: {e}", file=sys.stderr)
            return 1
        for e in found:
            print(f"gms serve: FATAL: {type(e).__name__}: {e}", file=sys.stderr)
            traceback.print_exception(e, file=sys.stderr)
        return EXIT_FATAL
    return 0
