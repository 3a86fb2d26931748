"""What one big request costs the server's event loop: reading it and decoding it.

A writer's 1 MiB metadata put is read off a real socket (a sender process
writes frames as fast as they are read) and decoded, the way the server's
session does it, in four ways: the bytes fed into the decoder as they come
(before: the buffer grows, and the body is copied out of it twice) or read
straight into a buffer of the frame's size (``FrameDecoder.body_space``);
each with glibc's default heap rules, or with the thresholds the server sets
(``gms.heap.keep_big_blocks``).  Each way runs in a process of its own (the
heap's rules are per process).  Timed: the whole frame (every read, and the
decode), and the last step alone (the step that completes the frame and
decodes it, during which no other client is served).

    python bench/frame_decode.py [--frames 300] [--value-bytes 1048576]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import cpu_name, percentile, print_table, write_json  # noqa: E402

READ_BYTES = 256 << 10  # what the server's channel reads at once
WAYS = [("fed", "default"), ("fed", "kept"), ("direct", "default"), ("direct", "kept")]


def measure(way: str, heap: str, frames: int, value_bytes: int) -> dict:
    from gms.heap import keep_big_blocks
    from gms.wire import FrameDecoder, decode, encode
    from gms.wire import messages as m

    if heap == "kept" and not keep_big_blocks():
        raise SystemExit("no glibc here: the heap's thresholds cannot be set")
    frame = encode(m.MetadataPutRequest("key", "0" * 32, 0, b"v" * value_bytes))
    reader, writer = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the client: frames, as fast as the socket takes them
        reader.close()
        try:
            for _ in range(frames):
                writer.sendall(frame)
        finally:
            os._exit(0)
    writer.close()
    scratch = bytearray(READ_BYTES)
    whole, last = [], []
    decoder = FrameDecoder()
    for _ in range(frames):
        started = time.perf_counter()
        while True:
            step = time.perf_counter()
            space = decoder.body_space() if way == "direct" else None
            if space is not None:
                decoder.wrote(reader.recv_into(space[:READ_BYTES]))
            else:
                n = reader.recv_into(scratch, min(READ_BYTES, max(decoder.wanted, 1)))
                decoder.feed(memoryview(scratch)[:n])
            body = decoder.next_frame()
            if body is not None:
                decode(body)
                break
        done = time.perf_counter()
        whole.append(done - started)
        last.append(done - step)
    os.waitpid(pid, 0)
    return {
        "whole_p50_us": percentile(whole, 0.5) * 1e6, "last_step_p50_us": percentile(last, 0.5) * 1e6,
        "last_step_p99_us": percentile(last, 0.99) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=300)
    parser.add_argument("--value-bytes", type=int, default=1 << 20)
    parser.add_argument("--way", help=argparse.SUPPRESS)  # "read,heap": one way, in this process
    parser.add_argument("--json", default="bench/results/frame_decode.json")
    args = parser.parse_args()
    if args.way:
        print(json.dumps(measure(*args.way.split(","), args.frames, args.value_bytes)))
        return
    results = {"cpu": cpu_name(), "cores": os.cpu_count(), "value_bytes": args.value_bytes, "ways": {}}
    for way, heap in WAYS:
        out = subprocess.run(
            [sys.executable, __file__, "--way", f"{way},{heap}", "--frames", str(args.frames),
             "--value-bytes", str(args.value_bytes)], capture_output=True, text=True, check=True,
        )
        results["ways"][f"{way}, heap {heap}"] = json.loads(out.stdout.strip().splitlines()[-1])
    print_table(
        f"one {args.value_bytes >> 10} KiB metadata put read off a socket and decoded (µs, {cpu_name()})",
        [(name, f"{r['whole_p50_us']:.0f}", f"{r['last_step_p50_us']:.0f}", f"{r['last_step_p99_us']:.0f}")
         for name, r in results["ways"].items()],
        header=("way", "whole frame p50", "last step p50", "last step p99"),
    )
    write_json(args.json, results)


if __name__ == "__main__":
    main()
