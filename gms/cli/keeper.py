"""``gms keeper``: a keeper for gms servers that run in another container (or process).

``gms serve`` runs its own keeper by default; this is for a Kubernetes pod
whose keeper and server are separate containers, so the server can restart
alone: servers started with ``--keeper-socket PATH`` connect here, one per
device at a time, and whatever they held is handed to the next.
"""

from __future__ import annotations

import argparse
import logging

from .common import log_level_arg


def register(sub) -> None:
    keeper = sub.add_parser("keeper", help="hold the memory of servers in other containers across their restarts")
    where = keeper.add_mutually_exclusive_group(required=True)
    where.add_argument("--keeper-socket", metavar="PATH", help="where servers connect (mode 0600)")
    # A server whose own keeper died starts one in its place: this channel is that
    # server's, and the words after "--" start the next server when it dies.
    where.add_argument("--adopt-fd", type=int, help=argparse.SUPPRESS)
    log_level_arg(keeper)
    keeper.add_argument("server_argv", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    keeper.set_defaults(handler=cmd_keeper)


def cmd_keeper(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    import trio

    from ..keeper.run import keep_listening
    from ..system.heap import return_big_blocks
    from .serve import _raise_fd_limit

    # It holds an fd for every fd its servers' memory tables hold: as many as they may.
    _raise_fd_limit()
    return_big_blocks()
    if args.adopt_fd is not None:
        import socket

        from ..keeper.run import keep_spawning

        argv = [word for word in args.server_argv if word != "--"]
        adopted = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=args.adopt_fd)
        return trio.run(keep_spawning, argv, adopted)
    return trio.run(keep_listening, args.keeper_socket)
