"""The listener: one Unix socket per GPU, one nursery, one task per connection.

``Server.serve`` binds, reports itself started, and accepts (Trio's own
accept loop) until cancelled; on the way out every connection task is
cancelled (each unwinds its lock), the memory is released on its lanes and
the socket file removed.  ``run_server`` is the
process entry, stopped by SIGTERM or SIGINT.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import stat

import attrs
import trio

from ..cuda import MemoryBackend, open_backend, open_host_tier
from ..store import EventLog
from ..units import parse_budget
from . import ratelimit
from .admission import LISTEN_BACKLOG, Admission, Ticket, open_admission
from .admission import serve as serve_admitted
from .config import DEFAULT_STOCK_BYTES, ServerConfig
from .copier_link import CopierLink
from .core import ServiceCore
from .host_memory import HostMemory
from .lanes import Lane
from .memory import Memory
from .memory_signal import MemorySignal
from .metrics import Metrics
from .netio import Channel
from .peer import Peer
from .session import Session

log = logging.getLogger("gms.server")


class SocketPathError(Exception):
    """The socket path is taken by a live server or by something not a socket."""


def clear_stale_socket(path: str) -> None:
    """Remove a dead server's socket file; refuse a live one or a non-socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketPathError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        log.info("replacing stale socket %s", path)
        os.unlink(path)
        return
    except OSError as exc:
        raise SocketPathError(f"cannot tell whether {path} is live: {exc}") from exc
    finally:
        probe.close()
    raise SocketPathError(f"a gms server is already listening on {path}")


def make_socket_dir(directory: str) -> None:
    """Create the socket's folder (and its parents) writable by us alone, whatever
    the umask: whoever can write the folder can replace the socket with their own."""
    old_umask = os.umask(0o022)
    os.umask(old_umask | 0o022)
    try:
        os.makedirs(directory, exist_ok=True)
    finally:
        os.umask(old_umask)
    mode = os.stat(directory).st_mode
    if mode & 0o022 and not mode & stat.S_ISVTX:
        log.warning(
            "socket folder %s is writable by others (mode %o) without the sticky bit: "
            "anyone who can write it can replace the socket", directory, stat.S_IMODE(mode),
        )


async def bind_listener(path: str, mode: int) -> tuple[trio.socket.SocketType, int]:
    """Bind with no window in which the socket is more open than ``mode``."""
    make_socket_dir(os.path.dirname(os.path.abspath(path)))
    clear_stale_socket(path)
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        await sock.bind(path)
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(old_umask)
    os.chmod(path, mode)
    sock.listen(LISTEN_BACKLOG)
    return sock, os.stat(path).st_ino


def _remove_if_ours(path: str, inode: int) -> None:
    try:
        if os.stat(path).st_ino == inode:
            os.unlink(path)
    except FileNotFoundError:
        pass


def effective_limits(config: ServerConfig, total_bytes: int | None):
    """Cap single allocations at the device's size unless configured."""
    limits = config.limits
    if limits.max_allocation_bytes is None and total_bytes is not None:
        limits = attrs.evolve(limits, max_allocation_bytes=total_bytes)
    return limits


class Server:
    """One GPU's server.  The backends are opened here; the lanes, the memory
    tables and the core are made when serving starts (they live in Trio)."""

    def __init__(
        self,
        config: ServerConfig,
        backend: MemoryBackend | None = None,
        host_tier: MemoryBackend | None = None,
    ) -> None:
        self.config = config
        self.backend = backend or open_backend(config.backend, config.device, config.host_capacity)
        if host_tier is None and config.host_tier:
            host_tier = open_host_tier(config.backend, config.device)
        self.host_tier = host_tier
        self.metrics = Metrics()
        self.metrics_port: int | None = None
        self.core: ServiceCore | None = None
        self.admission: Admission | None = None
        self.log_limit: ratelimit.RateLimit | None = None

    async def _open_core(self) -> ServiceCore:
        config = self.config
        stock = config.alloc_stock_bytes
        if stock is None:
            stock = DEFAULT_STOCK_BYTES if self.backend.name == "cuda" else 0
        gpu = Memory(self.backend, Lane("gpu"), stock)
        host = copier = None
        if self.host_tier is not None:
            if config.copier:
                level = logging.getLevelName(log.getEffectiveLevel()).lower()
                copier = CopierLink(self.backend.name, config.device, log_level=level)
            host = HostMemory(
                Memory(self.host_tier, Lane("host")), link=copier,
                pool_bytes=config.host_pool_bytes, chunk_bytes=config.host_chunk_bytes,
            )
        device = await gpu.device_info()  # on the lane, like every call into a backend
        capacity = device.total_bytes
        self.core = ServiceCore(
            gpu,
            host,
            device=device,
            signal=MemorySignal(),
            on_event=self.metrics.observe,
            policy=config.policy,
            limits=effective_limits(config, capacity),
            log=EventLog(retain=config.event_log_retain, max_bytes=config.event_log_bytes),
            budget_bytes=None if config.gpu_budget is None else parse_budget(config.gpu_budget, capacity),
            host_budget_bytes=None if config.host_budget is None else parse_budget(config.host_budget, None),
            history_max_events=config.history_max_events,
            history_max_bytes=config.history_max_bytes,
            server_uid=os.getuid(),
            alloc_retry_interval=config.alloc_retry_interval,
            alloc_retry_timeout=config.alloc_retry_timeout,
            copier=copier,
            scan_cache_bytes=config.scan_cache_bytes,
        )
        self.metrics.watch(self.core)
        self.admission = open_admission(self.core, config)
        return self.core

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        path = self.config.socket_path
        core = None
        try:
            listener, inode = await bind_listener(path, self.config.socket_mode)
        except BaseException:
            self._close_backends()
            raise
        self.log_limit = ratelimit.install()  # repeated warnings: one summary line per interval
        try:
            core = await self._open_core()
            if self.config.metrics_port is not None:
                self.metrics_port = self.metrics.serve(self.config.metrics_port, self.config.metrics_host)
            async with trio.open_nursery() as nursery:
                for tier in core.ledger.tiers.values():
                    nursery.start_soon(tier.lane.watch)  # a failed release stops the server
                for task in core.background():  # the copier, the host pool: never fatal
                    nursery.start_soon(task)
                nursery.start_soon(ratelimit.flush_every, self.log_limit)
                log.info(
                    "serving device %d on %s (backend %s, policy %s)",
                    self.config.device, path, self.backend.name, self.config.policy.source,
                )
                task_status.started(self)
                # Each connection judged as it is accepted (gms.server.admission); only the admitted get a task.
                await serve_admitted(self.admission, listener, self._handle, nursery, self.metrics.refused_one)
        finally:
            listener.close()
            _remove_if_ours(path, inode)
            if core is not None:
                with trio.CancelScope(shield=True):
                    await core.aclose()
            self.metrics.close()
            self._close_backends()
            ratelimit.uninstall(self.log_limit)

    def _close_backends(self) -> None:
        for backend in (self.backend, self.host_tier):
            if backend is not None:
                backend.close()

    async def _handle(self, sock: trio.socket.SocketType, peer: Peer, ticket: Ticket) -> None:
        try:
            await Session(self.core, self.config, Channel.adopt(sock, peer), self.metrics).run()
        finally:
            self.admission.leave(ticket)


async def run_server(config: ServerConfig) -> None:
    """Serve until SIGTERM or SIGINT; then stop cleanly."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(Server(config).serve)

            async def stop_on_signal() -> None:
                async for signum in signals:
                    log.info("%s: shutting down", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(stop_on_signal)
