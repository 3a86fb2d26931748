"""The keeper's cost per plain round trip: the same requests against ``gms serve``
as shipped (under its keeper) and with ``--no-keeper``, interleaved, medians of
the rounds' p50s, one client process (the server's own, blocking calls).

Rows: allocate 2 MiB (a writer), metadata put, metadata get (a reader of the
committed layout), RO handshake through the client (connect + abort) and over a
raw socket.

    python bench/keeper_cost.py [--backend host|cuda] [--rounds 3] [--n 1000] [--json PATH] [--quick]

To compare two trees, run it with ``PYTHONPATH=<other tree>`` (the server
and client both come from it) and diff the JSON.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "peers"))
from _common import Server, cpu_name, write_json
from harness import frame, measure, raw_handshake, stats

CONFIGS = {"keeper": [], "no keeper": ["--no-keeper"]}
ROWS = ("allocate", "metadata_put", "metadata_get", "handshake", "raw_handshake")


def one_round(backend: str, flags: list[str], n: int) -> dict[str, float]:
    import msgpack

    from gms import GMSClientMemoryManager

    p50 = {}
    with Server(tempfile.mkdtemp(), backend, "keeper-cost", *flags) as server:
        writer = GMSClientMemoryManager(server.socket)
        writer.connect("RW")
        p50["allocate"] = stats(measure(lambda: writer.allocate_handle(2 << 20, "w"), n, 50))["p50_us"]
        allocation_id = writer.allocate_handle(2 << 20, "w")[0]
        keys = iter(range(1 << 30))
        p50["metadata_put"] = stats(measure(
            lambda: writer.metadata_put(f"k{next(keys) % 200}", allocation_id, 0, b"v" * 64), 2 * n, 50))["p50_us"]
        writer.commit()
        writer.close()
        reader = GMSClientMemoryManager(server.socket)
        reader.connect("RO")
        p50["metadata_get"] = stats(measure(lambda: reader.metadata_get("k5"), 3 * n, 50))["p50_us"]
        reader.close()
        shaker = GMSClientMemoryManager(server.socket)

        def handshake() -> None:
            shaker.connect("RO")
            shaker.abort()

        p50["handshake"] = stats(measure(handshake, n, 50))["p50_us"]
        op = raw_handshake(server.socket, frame(msgpack.packb({"type": "HandshakeRequest", "lock_type": "RO"})))
        p50["raw_handshake"] = stats(measure(op, n, 50))["p50_us"]
    return p50


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="host", choices=("host", "cuda"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--json", default="bench/results/keeper_cost.json")
    parser.add_argument("--quick", action="store_true", help="one round of 300")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.n = 1, 300
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for _ in range(args.rounds):
        for name, flags in CONFIGS.items():
            runs[name].append(one_round(args.backend, flags, args.n))
    medians = {name: {row: round(statistics.median(r[row] for r in rs), 1) for row in ROWS} for name, rs in runs.items()}
    print(f"p50 µs, medians of {args.rounds} rounds ({args.backend} backend, {cpu_name()}, {os.cpu_count()} CPUs)")
    print("  " + "".join(f"{row:>15}" for row in ("", *ROWS)))
    for name, row in medians.items():
        print("  " + f"{name:>15}" + "".join(f"{row[r]:>15}" for r in ROWS))
    write_json(args.json, {"cpu": cpu_name(), "cores": os.cpu_count(), "backend": args.backend, "n": args.n,
                           "rounds": args.rounds, "p50_us": medians, "runs": runs})


if __name__ == "__main__":
    main()
