"""``gms``: the command line.  One module per family of commands:

    gms serve      run a GPU's server under its keeper (``serve``), or one per GPU (``--devices``)
    gms keeper     a keeper for servers in other containers (``keeper``)
    gms stop | restart   stop the service, or start its next server keeping every layout (``control``)
    gms status     the runtime state: layouts, tenants, budgets (``inspect``)
    gms snapshots  the persisted layouts on the disk tier (``inspect``)
    gms history    the event log (``inspect``)
    gms replay     rebuild the state from a saved log, offline (``inspect``)
    gms revoke | evict | delete | pin LAYOUT    admin verbs (``admin``)
    gms failover   the shadow-engine failover coordinator (``failover``)
    gms ray-resources   this node's GPU memory as Ray resources (``ray``)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from ..system.launch import drop_unsafe_import_paths
from . import admin, control, failover, inspect, keeper, ray, serve


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(prog="gms", description="GPU Memory Service")
    parser.add_argument("--version", action="version", version=f"gms {__version__} (Python {sys.version.split()[0]})")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (serve, control, keeper, inspect, admin, failover, ray):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    dropped = drop_unsafe_import_paths()  # (`python -m gms` put the working folder there)
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = list(argv)  # a keeper starts its server with the same words
    args.dropped_import_paths = dropped
    try:
        code = args.handler(args)
        sys.stdout.flush()  # (a pipe buffers: its reader's going would otherwise raise at exit)
        return code
    except BrokenPipeError:
        # The reader went away (``gms status | head``): end quietly, as a Unix tool
        # killed by SIGPIPE would, and keep the flush at exit from raising again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
