"""The engine's options: command line, with ``GMS_MODE`` for the mode."""

from __future__ import annotations

import argparse
import os

import attrs

MODES = ("primary", "shadow")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """``1073741824``, ``512M``, ``4GiB``, ``1.5g``."""
    value = text.strip().lower().removesuffix("b").removesuffix("i")
    unit = value[-1] if value and value[-1] in _UNITS else ""
    try:
        return int(float(value[: len(value) - len(unit)]) * _UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r}") from None


@attrs.frozen
class EngineOptions:
    model: str  # folder with config.json (+ *.safetensors for the engine that loads)
    gms_socket: str  # this rank's gms server (one per GPU)
    mode: str = "primary"  # primary: serve at once; shadow: import weights, then sleep
    rank: int = 0
    world_size: int = 1
    device: int = 0  # this rank's GPU (CUDA backend)
    host: str = "127.0.0.1"
    port: int = 8000
    max_seq_len: int = 512  # tokens the static KV cache holds (prompt + completion)
    kv_bytes: int | None = None  # bytes of the kv_cache layout (None: what max_seq_len needs)
    kv_chunk_bytes: int = 1 << 30  # allocation size for the part beyond the static cache
    dtype: str | None = None  # default: the checkpoint config's dtype
    served_model_name: str | None = None
    canary_timeout_s: float = 10.0
    lock_timeout_s: float | None = None  # waiting for the weights or KV lock; None: forever
    # For drills and tests: while this file exists the model stops between steps, as a
    # hung kernel would, and the HTTP server goes on answering.
    stall_file: str | None = None

    @property
    def name(self) -> str:
        return self.served_model_name or os.path.basename(os.path.normpath(self.model))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python examples/engine",
        description="A small serving engine over transformers whose weights and KV cache live in gms.",
    )
    p.add_argument("--model", required=True, help="folder with config.json and, for the loader, safetensors")
    p.add_argument("--gms-socket", help="this rank's gms server socket (default: the device's)")
    p.add_argument("--mode", choices=MODES, help="default: $GMS_MODE, else primary")
    p.add_argument("--rank", type=int, default=int(os.environ.get("RANK", "0")))
    p.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    p.add_argument("--device", type=int, default=int(os.environ.get("LOCAL_RANK", "0")))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--kv-bytes", type=parse_bytes, help="size of the KV cache layout (>= what --max-seq-len needs)")
    p.add_argument("--kv-chunk-bytes", type=parse_bytes, default=1 << 30)
    p.add_argument("--dtype", help="e.g. bfloat16 (default: the config's)")
    p.add_argument("--served-model-name")
    p.add_argument("--canary-timeout-s", type=float, default=10.0)
    p.add_argument("--lock-timeout-s", type=float, default=None)
    p.add_argument("--stall-file", help="drills: while this file exists the model stops between steps "
                   "(a hung kernel), the HTTP server answering on")
    p.add_argument("--backend", default="auto", choices=("auto", "cuda", "host"),
                   help="which backend's default socket to use when --gms-socket is not given")
    return p


def parse(argv: list[str] | None = None) -> EngineOptions:
    args = build_parser().parse_args(argv)
    mode = args.mode or os.environ.get("GMS_MODE", "primary")
    if mode not in MODES:
        raise SystemExit(f"engine: GMS_MODE must be one of {MODES}, not {mode!r}")
    if not 0 <= args.rank < args.world_size:
        raise SystemExit(f"engine: rank {args.rank} is outside a world of {args.world_size}")
    socket = args.gms_socket
    if socket is None:
        from gms import socket_path

        socket = socket_path(args.device, args.backend)
    return EngineOptions(
        model=args.model, gms_socket=socket, mode=mode, rank=args.rank, world_size=args.world_size,
        device=args.device, host=args.host, port=args.port, max_seq_len=args.max_seq_len,
        kv_bytes=args.kv_bytes, kv_chunk_bytes=args.kv_chunk_bytes, dtype=args.dtype,
        served_model_name=args.served_model_name, canary_timeout_s=args.canary_timeout_s,
        lock_timeout_s=args.lock_timeout_s, stall_file=args.stall_file,
    )
