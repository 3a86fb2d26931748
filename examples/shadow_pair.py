"""A primary and a shadow engine sharing one GPU's weights (the seed's shadow pattern).

    gms serve &                       # one server for the GPU: layouts 'weights' and 'kv_cache'
    python examples/llm_writer.py --socket "$(python -c 'import gms; print(gms.socket_path(0))')" --workdir /tmp/tiny-llama
    python examples/shadow_pair.py demo

The primary imports the weights read-only and takes the KV-cache lock (RW on
the kv_cache layout) for its KV cache.  The shadow imports the same weights,
then sleeps: it unmaps them and drops its lock, holding no GPU memory, and
waits for the KV-cache lock; that lock is the primary's liveness.  When the
primary exits, the shadow is granted the lock, wakes its weights at the same
addresses and allocates its KV cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

import gms
import gms.torch
from gms import GMSClientMemoryManager, RequestedLockType
from llm_reader import PROMPT, import_model

KV_BYTES = 256 << 20


def generate(model, tokens: int = 12) -> list[int]:
    device = next(model.parameters()).device
    prompt = torch.tensor(PROMPT, device=device)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=tokens, do_sample=False)
    return out[0, len(PROMPT[0]):].tolist()


def take_kv_cache(kv: GMSClientMemoryManager) -> torch.Tensor:
    """Stands in for an engine's KV cache: one big tensor in kv_cache memory."""
    with gms.torch.use_memory(kv, tag="kv_cache"):
        return torch.zeros(KV_BYTES // 2, dtype=torch.bfloat16, device=f"cuda:{kv.device}")


def primary(args) -> None:
    weights = GMSClientMemoryManager(args.socket, layout="weights")
    weights.connect(RequestedLockType.RO)
    model = import_model(weights)
    kv = GMSClientMemoryManager(args.socket, layout="kv_cache")
    kv.connect(RequestedLockType.RW)
    cache = take_kv_cache(kv)
    print(json.dumps({"role": "primary", "serving": True}), flush=True)
    if args.hold:
        sys.stdin.readline()  # the demo lets us go once the shadow waits
    for _ in range(args.steps):
        tokens = generate(model)
        cache.add_(1)
    print(json.dumps({"role": "primary", "tokens": tokens, "exiting_at": time.time()}), flush=True)
    os._exit(0)  # no cleanup, as a crash would: the kernel closes the sockets


def shadow(args) -> None:
    weights = GMSClientMemoryManager(args.socket, layout="weights")
    weights.connect(RequestedLockType.RO)
    model = import_model(weights)
    started = time.perf_counter()
    gms.torch.sleep(weights)  # no GPU memory held from here on
    print(json.dumps({"role": "shadow", "asleep": True, "sleep_ms": (time.perf_counter() - started) * 1e3}),
          flush=True)
    kv = GMSClientMemoryManager(args.socket, layout="kv_cache")
    kv.connect(RequestedLockType.RW)  # blocks while the primary lives
    woke = time.time()
    started = time.perf_counter()
    gms.torch.wake_weights(weights)
    take_kv_cache(kv)
    wake_ms = (time.perf_counter() - started) * 1e3
    tokens = generate(model)
    print(json.dumps({"role": "shadow", "tokens": tokens, "woke_at": woke, "wake_ms": wake_ms}), flush=True)


def demo(args) -> None:
    base = [sys.executable, __file__]
    common = ["--socket", args.socket]
    first = subprocess.Popen(base + ["primary", *common, "--steps", str(args.steps), "--hold"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert json.loads(first.stdout.readline())["serving"]
    second = subprocess.Popen(base + ["shadow", *common], stdout=subprocess.PIPE, text=True)
    print(second.stdout.readline().strip())
    while gms.get_runtime_state(args.socket).layout("kv_cache").waiting_writers == 0:  # the shadow waits on the lock
        time.sleep(0.01)
    first.stdin.write("go\n")
    first.stdin.flush()
    p = json.loads(first.stdout.readline())
    first.wait()
    exited = time.time()
    s = json.loads(second.stdout.readline())
    second.wait()
    print(json.dumps({
        "same_tokens": p["tokens"] == s["tokens"],
        "failover_ms": (s["woke_at"] - p["exiting_at"]) * 1e3,
        "primary_exit_ms": (exited - p["exiting_at"]) * 1e3,
        "woke_at": s["woke_at"],
        "wake_ms": s["wake_ms"],
        "returncodes": [first.returncode, second.returncode],
    }))
    sys.exit(0 if p["tokens"] == s["tokens"] and first.returncode == 0 and second.returncode == 0 else 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["primary", "shadow", "demo"])
    parser.add_argument("--socket", default=None, help="the GPU's server (default: gms.socket_path(0))")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hold", action="store_true", help="primary: wait for a line on stdin before serving")
    args = parser.parse_args()
    args.socket = args.socket or gms.socket_path(0)
    {"primary": primary, "shadow": shadow, "demo": demo}[args.role](args)


if __name__ == "__main__":
    main()
