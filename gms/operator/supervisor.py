"""``gms serve --devices all|0,1,...``: one isolated server process per GPU.

Each child is a plain ``gms serve --device N`` with the same options, so a
failure on one GPU (a CUDA error stops its server) cannot touch another.  A
child that exits on its own is restarted on its own, after a backoff that
doubles from half a second to 30 s (reset once a child has run for a
minute); the other GPUs' servers, layouts and clients are not touched.  A
child that exits with the configuration error code (78) is not restarted:
the same options would fail again.  SIGTERM/SIGINT stops every child and
then the supervisor, which exits 0; SIGHUP is passed on to every child (each
keeper restarts its server, reading the policy again).  Its children know it by
``$GMS_SUPERVISOR_PID``: their servers name it as the process that stops the
service (``gms status``, ``gms stop``).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal

import trio

from ..cuda import cuda_device_count
from ..keeper.conversation import SUPERVISOR_ENV
from ..system.launch import child_env, python_argv, without_options

log = logging.getLogger("gms.operator.supervisor")
STOP_GRACE_S = 30
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
HEALTHY_AFTER_S = 60.0
EXIT_CONFIG = 78


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


# What differs between the devices' servers: each one's own (``--socket`` and
# ``--metrics-port`` are derived per device); every other word of ``gms serve``
# reaches every child as the user wrote it.
PER_DEVICE = ("--devices", "--device", "--socket", "--metrics-port")


def child_argv(args: argparse.Namespace, device: int) -> list[str]:
    """One device's ``gms serve``: the supervisor's own words, every option of them
    (the serve parser takes no abbreviations, so a word is its option), its device's."""
    words = without_options(list(getattr(args, "argv", None) or ["serve"]), PER_DEVICE)
    words += ["--device", str(device)]
    if args.metrics_port is not None:
        # One port per GPU: the first GPU's server gets the given one, the next the one after.
        words += ["--metrics-port", str(args.metrics_port + device)]
    return python_argv("gms", *words)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


class _Child:
    """One device's server: started, watched, restarted until the supervisor stops."""

    def __init__(self, device: int, argv: list[str]) -> None:
        self.device = device
        self.argv = argv
        self.proc: trio.Process | None = None
        self.restarts = 0

    async def run(self, stopping: trio.Event) -> None:
        backoff = FIRST_BACKOFF_S
        while not stopping.is_set():
            started = trio.current_time()
            self.proc = await trio.lowlevel.open_process(
                self.argv, env={**child_env(), SUPERVISOR_ENV: str(os.getpid())}
            )
            code = await self.proc.wait()
            if stopping.is_set():
                return
            if code == EXIT_CONFIG:
                log.error("server for device %d exited with a configuration error; not restarting it", self.device)
                return
            if trio.current_time() - started >= HEALTHY_AFTER_S:
                backoff = FIRST_BACKOFF_S
            log.error(
                "server for device %d (pid %d) exited with %s; restarting it in %.1f s "
                "(the other devices' servers are untouched)",
                self.device, self.proc.pid, _describe(code), backoff,
            )
            with trio.move_on_after(backoff):
                await stopping.wait()
            backoff = min(backoff * 2, MAX_BACKOFF_S)
            self.restarts += 1

    async def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        proc.send_signal(signal.SIGTERM)
        with trio.move_on_after(STOP_GRACE_S):
            await proc.wait()
        if proc.returncode is None:
            log.error("server for device %d ignored SIGTERM; killing it", self.device)
            proc.kill()
            await proc.wait()


async def _supervise(commands: dict[int, list[str]]) -> int:
    children = [_Child(device, argv) for device, argv in commands.items()]
    stopping = trio.Event()
    given_up = 0
    # Listen before starting anything: a signal must never orphan a child.
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as received:
        async with trio.open_nursery() as nursery:

            async def watch(child: _Child) -> None:
                nonlocal given_up
                await child.run(stopping)
                if not stopping.is_set():
                    given_up += 1
                    if given_up == len(children):
                        log.error("no server can run; stopping")
                        nursery.cancel_scope.cancel()

            for child in children:
                nursery.start_soon(watch, child)

            async def on_signal() -> None:
                async for signum in received:
                    if signum == signal.SIGHUP:
                        kept = [c for c in children if "--no-keeper" not in c.argv]
                        log.info("SIGHUP: restarting %d servers (each keeper starts the next)", len(kept))
                        for child in kept:  # (a server without a keeper would die of it, its layouts lost)
                            if child.proc is not None and child.proc.returncode is None:
                                child.proc.send_signal(signal.SIGHUP)
                        continue
                    log.info("%s: stopping %d servers", signal.Signals(signum).name, len(children))
                    stopping.set()
                    async with trio.open_nursery() as stoppers:
                        for child in children:
                            stoppers.start_soon(child.stop)
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(on_signal)
    return EXIT_CONFIG if given_up == len(children) else 0


def supervise(args: argparse.Namespace) -> int:
    if args.socket:
        raise SystemExit("gms serve: --socket names one server; it cannot go with --devices")
    devices = parse_devices(args.devices)
    commands = {device: child_argv(args, device) for device in devices}
    log.info("supervising servers for devices %s", devices)
    return trio.run(_supervise, commands)
