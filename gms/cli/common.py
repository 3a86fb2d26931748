"""What every client command shares: finding the server's socket, and a deadline."""

from __future__ import annotations

import argparse

from ..system import paths

BACKEND_HELP = "the memory: cuda (a GPU's), host (host memory standing in for one), auto (cuda where a GPU is; default)"
LOG_LEVELS = ("debug", "info", "warning", "error")


def log_level_arg(parser: argparse.ArgumentParser, default: str = "info") -> None:
    parser.add_argument("--log-level", default=default, type=str.lower, choices=LOG_LEVELS,
                        help=f"what is logged, on stderr (default {default})")


def target_args(parser: argparse.ArgumentParser) -> None:
    from ..client.probes import DEFAULT_TIMEOUT_S

    parser.add_argument("--socket", help="socket path (default: derived from --device)")
    parser.add_argument("--device", type=int, default=0, help="the device whose server (default 0)")
    parser.add_argument("--backend", default="auto", choices=("auto", "cuda", "host"), help=BACKEND_HELP)
    parser.add_argument(
        "--timeout", type=positive_seconds, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
        help=f"give up on a server that does not answer in this long (default {DEFAULT_TIMEOUT_S:g})",
    )


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError("the timeout must be more than 0 seconds")
    return value


def socket_of(args: argparse.Namespace) -> str:
    if args.socket:
        return args.socket
    try:
        return paths.socket_path(args.device, args.backend)
    except ValueError as exc:
        raise SystemExit(f"gms: {exc}") from None


def byte_count(text: str) -> int:
    from ..units import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def pool_size(text: str) -> int | None:
    """``--host-pool``: bytes, or ``auto`` (None: sized by the builds)."""
    return None if text.strip().lower() == "auto" else byte_count(text)


def client_error(command: str, exc: Exception) -> str:
    """The line a client command prints when the server call failed."""
    from ..errors import ResponseTimeoutError

    hint = " (is the server hung? --timeout waits longer)" if isinstance(exc, ResponseTimeoutError) else ""
    return f"gms {command}: {exc}{hint}"
