"""``gms failover --config FILE``: run the failover coordinator (docs/failover.md).

Exit codes: 0 stopped by a signal, 1 a bad configuration, 3 the serving lock
was taken by someone else (this coordinator then stops acting).
"""

from __future__ import annotations

import argparse
import logging
import sys

from .common import log_level_arg
from .serve import leaves as _leaves

EXIT_LOST_LOCK = 3


def register(sub) -> None:
    parser = sub.add_parser("failover", help="run the shadow-engine failover coordinator")
    parser.add_argument("--config", required=True, help="a TOML file (docs/failover.md)")
    log_level_arg(parser)
    parser.set_defaults(handler=cmd_failover)


def cmd_failover(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s.%(msecs)03d %(name)s %(levelname)s %(message)s",
                        datefmt="%Y-%m-%dT%H:%M:%S", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per probe otherwise
    import trio

    from ..failover import config as config_mod
    from ..failover.coordinator import LostServingLock, run

    try:
        config = config_mod.load(args.config)
    except (OSError, config_mod.ConfigError) as exc:
        print(f"gms failover: {exc}", file=sys.stderr)
        return 1
    try:
        trio.run(run, config)
    except BaseException as exc:  # noqa: BLE001 - sorted into exit codes
        leaves = list(_leaves(exc))
        if leaves and all(isinstance(e, LostServingLock) for e in leaves):
            print(f"gms failover: {leaves[0]}", file=sys.stderr)
            return EXIT_LOST_LOCK
        if leaves and all(isinstance(e, KeyboardInterrupt) for e in leaves):
            return 0
        raise
    return 0
