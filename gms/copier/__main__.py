"""``python -m gms.copier --fd N --backend B --device D``: the copier, on a link the server made.

Started by the server (``gms.server.tiers.copier_link``), never by hand; ``--selftest``
checks the engine alone (``gms.copier.selftest``).
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys


def main(argv: list[str] | None = None) -> int:
    from ..system.launch import drop_unsafe_import_paths

    drop_unsafe_import_paths()  # (the server starts it with -P: nothing of the working folder is on it)
    parser = argparse.ArgumentParser(prog="python -m gms.copier", description=__doc__.splitlines()[0])
    parser.add_argument("--fd", type=int, help="the copier's end of the server's socketpair")
    parser.add_argument("--backend", default="cuda", choices=("cuda", "host"))
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--selftest", action="store_true", help="check the engine in this process and exit")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s gms.copier %(levelname)s %(message)s")
    if args.selftest:
        from .selftest import selftest

        return selftest(args.backend, args.device)
    if args.fd is None:
        parser.error("--fd is required (the server starts the copier)")
    from .engines import open_engine
    from .process import Copier

    # A file past RLIMIT_FSIZE is an error to answer (EFBIG: the save fails), not a signal that kills.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    sock = socket.socket(fileno=args.fd)
    engine = open_engine(args.backend, args.device)
    Copier(engine, sock).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
