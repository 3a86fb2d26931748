"""``gms serve --devices all|0,1,...``: one isolated server process per GPU.

Each child is a plain ``gms serve --device N`` with the same options, so a
failure on one GPU (a CUDA error stops its server) cannot touch another.
SIGTERM/SIGINT is passed to every child; if a child exits on its own, the
others are stopped too and the supervisor exits with the child's code.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

import trio

from .cuda import cuda_device_count

log = logging.getLogger("gms.supervisor")
STOP_GRACE_S = 30


def parse_devices(text: str) -> list[int]:
    if text == "all":
        devices = list(range(cuda_device_count()))
        if not devices:
            raise SystemExit("gms serve --devices all: no CUDA device found")
        return devices
    try:
        return sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise SystemExit(f"gms serve --devices: expected 'all' or a list like 0,1, got {text!r}") from None


def child_argv(args: argparse.Namespace, device: int) -> list[str]:
    argv = [sys.executable, "-m", "gms", "serve", "--device", str(device), "--backend", args.backend]
    for tag in args.tag or ():
        argv += ["--tag", tag]
    options = {
        "--host-capacity": args.host_capacity,
        "--alloc-retry-interval": args.alloc_retry_interval,
        "--alloc-retry-timeout": args.alloc_retry_timeout,
        "--socket-mode": format(args.socket_mode, "o"),
        "--max-frame-bytes": args.max_frame_bytes,
        "--max-metadata-value-bytes": args.max_metadata_value_bytes,
        "--max-allocations": args.max_allocations,
        "--max-metadata-keys": args.max_metadata_keys,
        "--event-log-retain": args.event_log_retain,
        "--log-level": args.log_level,
    }
    for flag, value in options.items():
        if value is not None:
            argv += [flag, str(value)]
    return argv


async def _supervise(commands: dict[int, list[str]]) -> int:
    exit_code = 0
    stopping = False
    # Listen before starting anything: a signal must never orphan a child.
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
        async with trio.open_nursery() as nursery:
            procs = {device: await trio.lowlevel.open_process(cmd) for device, cmd in commands.items()}

            async def stop_all() -> None:
                nonlocal stopping
                if stopping:
                    return
                stopping = True
                for proc in procs.values():
                    if proc.returncode is None:
                        proc.send_signal(signal.SIGTERM)
                with trio.move_on_after(STOP_GRACE_S):
                    for proc in procs.values():
                        await proc.wait()
                for device, proc in procs.items():
                    if proc.returncode is None:
                        log.error("server for device %d ignored SIGTERM; killing it", device)
                        proc.kill()
                        await proc.wait()
                nursery.cancel_scope.cancel()

            async def watch(device: int, proc) -> None:
                nonlocal exit_code
                code = await proc.wait()
                if not stopping:
                    log.error("server for device %d exited with code %d; stopping the others", device, code)
                    exit_code = code or 1
                    await stop_all()

            async def on_signal() -> None:
                async for signum in received:
                    log.info("%s: stopping %d servers", signal.Signals(signum).name, len(procs))
                    await stop_all()
                    return

            for device, proc in procs.items():
                nursery.start_soon(watch, device, proc)
            nursery.start_soon(on_signal)
    return exit_code


def supervise(args: argparse.Namespace) -> int:
    if args.socket:
        raise SystemExit("gms serve: --socket names one server; it cannot go with --devices")
    devices = parse_devices(args.devices)
    commands = {device: child_argv(args, device) for device in devices}
    log.info("supervising servers for devices %s", devices)
    return trio.run(_supervise, commands)
