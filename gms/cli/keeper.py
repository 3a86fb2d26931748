"""``gms keeper``: a keeper for gms servers that run in another container (or process).

``gms serve`` runs its own keeper by default; this is for a Kubernetes pod
whose keeper and server are separate containers, so the server can restart
alone: servers started with ``--keeper-socket PATH`` connect here, one per
device at a time, and whatever they held is handed to the next.
"""

from __future__ import annotations

import argparse
import logging


def register(sub) -> None:
    keeper = sub.add_parser("keeper", help="hold the memory of servers in other containers across their restarts")
    keeper.add_argument("--keeper-socket", required=True, metavar="PATH", help="where servers connect (mode 0600)")
    keeper.add_argument("--log-level", default="info")
    keeper.set_defaults(handler=cmd_keeper)


def cmd_keeper(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    import trio

    from ..heap import keep_big_blocks
    from ..keeper.run import keep_listening
    from .serve import _raise_fd_limit

    # It holds an fd for every fd its servers' memory tables hold: as many as they may.
    _raise_fd_limit()
    keep_big_blocks()
    return trio.run(keep_listening, args.keeper_socket)
