"""The CUDA IPC baseline: ``python bench/ipc_handoff.py CHECKPOINT [--device cuda:0]``.

A producer process loads the checkpoint onto the device and puts the tensors
on a ``torch.multiprocessing`` queue (CUDA IPC handles); this process, the
consumer, times ``get()`` until every tensor is usable, and prints JSON.
(A file of its own: spawned children must be able to import the producer.)
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.multiprocessing as mp


def produce(path: str, device: str, queue, done) -> None:
    from safetensors.torch import load_file

    tensors = load_file(path, device=device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    queue.put(tensors)
    done.wait()


def main() -> None:
    path = sys.argv[1]
    device = sys.argv[3] if len(sys.argv) > 3 and sys.argv[2] == "--device" else "cuda:0"
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    producer = ctx.Process(target=produce, args=(path, device, queue, done))
    producer.start()
    if device.startswith("cuda"):
        torch.empty(1, device=device)  # the consumer's context, before the clock
    deadline = time.monotonic() + 600
    while queue.empty():  # the producer has loaded and pickled
        if not producer.is_alive() or time.monotonic() > deadline:
            raise SystemExit(f"producer failed (exit code {producer.exitcode})")
        time.sleep(0.01)
    start = time.perf_counter()
    tensors = queue.get()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    checksum = float(next(iter(tensors.values())).float().sum())
    del tensors
    done.set()
    producer.join(60)
    print(json.dumps({"total_s": elapsed, "tensors_checksum": checksum}))


if __name__ == "__main__":
    main()
