"""What every client command shares: finding the server's socket."""

from __future__ import annotations

import argparse

from .. import paths


def target_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket", help="socket path (default: derived from --device)")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--backend", default="auto", choices=("auto", "cuda", "host"))


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
