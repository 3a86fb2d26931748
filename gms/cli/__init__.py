"""``gms``: the command line.  One module per family of commands:

    gms serve      run a GPU's server under its keeper (``serve``), or one per GPU (``--devices``)
    gms keeper     a keeper for servers in other containers (``keeper``)
    gms status     the runtime state: layouts, tenants, budgets (``inspect``)
    gms history    the event log (``inspect``)
    gms replay     rebuild the state from a saved log, offline (``inspect``)
    gms revoke | evict | pin LAYOUT    admin verbs (``admin``)
    gms failover   the shadow-engine failover coordinator (``failover``)
    gms ray-resources   this node's GPU memory as Ray resources (``ray``)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from . import admin, failover, inspect, keeper, ray, serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gms", description="GPU Memory Service")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (serve, keeper, inspect, admin, failover, ray):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = list(argv)  # a keeper starts its server with the same words
    try:
        return args.handler(args)
    except BrokenPipeError:
        # The reader went away (``gms status | head``): end quietly, as a Unix tool
        # killed by SIGPIPE would, and keep the flush at exit from raising again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
