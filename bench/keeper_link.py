"""The keeper link's own share of a request, in process: the event log with and without its mirror.

RO handshakes as the core records them (a session and its lock, then their
two ends: two batches of two events, each ending with the ledger's flush),
appended to a plain ``EventLog`` and to the server's ``MirroredLog`` whose
``KeeperLink`` writes to a real socket pair (a thread drains the keeper's
end; the link's run task hands on every ``SOON_S``).  Best of ``--rounds``
runs of 20,000 handshakes each; the difference is what the link costs the
event loop per handshake (encoding the events, queueing, handing on).

    python bench/keeper_link.py [--rounds 3] [--json PATH]
    PYTHONPATH=<another tree> python bench/keeper_link.py   # that tree's link
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.append(str(HERE.parent))  # tests.fsm_events; a PYTHONPATH tree comes first
from _common import cpu_name, print_table, write_json  # noqa: E402

HANDSHAKES = 20_000


def _drain(sock: socket.socket) -> None:
    while True:
        try:
            if not sock.recv(1 << 20):
                return
        except OSError:
            return


async def one_round() -> dict[str, float]:
    import trio

    from gms.handover.image import STATE_VERSION, ServerInfo, StateImage
    from gms.server.restart.mirror import KeeperLink, MirroredLog
    from gms.store import EventLog
    from tests.fsm_events import closed_reader, committed, reader, started, writer

    ours, keepers = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    threading.Thread(target=_drain, args=(keepers,), daemon=True).start()
    link = KeeperLink(ours)
    out = {}
    for label, log in (("plain", EventLog()), ("mirrored", MirroredLog(link=link))):
        log.extend([started(), *writer(1, "w")])
        log.extend(committed(log.state, 1, "w"))
        if label == "mirrored":
            info = ServerInfo(os.getpid(), "host", 0, "uuid", False)
            link.attach(lambda log=log, info=info: StateImage(STATE_VERSION, info, log.last_seq, 1, log.state), list)
        async with trio.open_nursery() as nursery:
            if label == "mirrored":
                nursery.start_soon(link.run)
            started_at = time.perf_counter()
            for conn in range(10, 10 + HANDSHAKES):
                log.extend(reader(conn, "w"))
                log.flush()
                log.extend(closed_reader(conn, "w"))
                log.flush()
                if conn % 50 == 0:
                    await trio.lowlevel.checkpoint()  # the loop's other tasks (the link's run task) get their turn
            out[label] = (time.perf_counter() - started_at) / HANDSHAKES * 1e6
            nursery.cancel_scope.cancel()
    ours.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default="bench/results/keeper_link.json")
    parser.add_argument("--quick", action="store_true", help="one round")
    args = parser.parse_args()
    import trio

    import gms

    runs = [trio.run(one_round) for _ in range(1 if args.quick else args.rounds)]
    best = {label: min(run[label] for run in runs) for label in runs[0]}
    best["link_share"] = best["mirrored"] - best["plain"]
    print_table(f"µs per RO handshake (4 events, 2 flushes), best of {len(runs)}, {cpu_name()}, "
                f"gms from {Path(gms.__file__).parent.parent}",
                [(label, f"{value:.1f}") for label, value in best.items()])
    write_json(args.json, {"cpu": cpu_name(), "cores": os.cpu_count(), "tree": str(Path(gms.__file__).parent.parent),
                           "best_us": best, "runs": runs})


if __name__ == "__main__":
    main()
