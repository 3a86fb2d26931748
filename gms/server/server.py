"""The listener: one Unix socket, one nursery, one task per connection.

``Server.serve`` binds, reports itself started, and accepts until cancelled;
on the way out every connection task is cancelled (each unwinds its lock),
the memory is released and the socket file removed.  ``run_servers`` is the
process entry: several servers (one per tag) under one nursery, stopped by
SIGTERM or SIGINT.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import stat

import attrs
import trio

from ..cuda import MemoryBackend, open_backend
from ..store import EventLog
from .config import ServerConfig
from .core import ServiceCore
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


async def bind_listener(path: str, mode: int) -> tuple[trio.socket.SocketType, int]:
    """Bind with no window in which the socket is more open than ``mode``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
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
    sock.listen(1024)
    return sock, os.stat(path).st_ino


def _remove_if_ours(path: str, inode: int) -> None:
    try:
        if os.stat(path).st_ino == inode:
            os.unlink(path)
    except FileNotFoundError:
        pass


def effective_limits(config: ServerConfig, backend: MemoryBackend):
    """Cap single allocations at the device's size unless configured."""
    limits = config.limits
    if limits.max_allocation_bytes is None:
        total = backend.device_info().total_bytes
        if total is not None:
            limits = attrs.evolve(limits, max_allocation_bytes=total)
    return limits


class Server:
    def __init__(self, config: ServerConfig, backend: MemoryBackend | None = None) -> None:
        self.config = config
        self.backend = backend or open_backend(config.backend, config.device, config.host_capacity)
        self.core = ServiceCore(
            self.backend,
            tag=config.tag,
            limits=effective_limits(config, self.backend),
            log=EventLog(retain=config.event_log_retain),
            history_max_events=config.history_max_events,
            history_max_bytes=config.history_max_bytes,
        )
        self.device_uuid = self.backend.device_info().uuid

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        path = self.config.socket_path
        try:
            listener, inode = await bind_listener(path, self.config.socket_mode)
        except BaseException:
            self.backend.close()
            raise
        try:
            async with trio.open_nursery() as nursery:
                log.info(
                    "serving tag %r on %s (backend %s, device %d)",
                    self.config.tag,
                    path,
                    self.backend.name,
                    self.config.device,
                )
                task_status.started(self)
                while True:
                    try:
                        sock, _ = await listener.accept()
                    except OSError as exc:
                        if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                            log.warning("accept failed (%s); backing off", exc)
                            await trio.sleep(0.1)
                            continue
                        raise
                    session = Session(self.core, self.config, sock, self.device_uuid)
                    nursery.start_soon(session.run)
        finally:
            listener.close()
            _remove_if_ours(path, inode)
            self.backend.close()


async def run_servers(configs: list[ServerConfig]) -> None:
    """Serve every config until SIGTERM or SIGINT; then stop cleanly."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            for config in configs:
                await nursery.start(Server(config).serve)

            async def stop_on_signal() -> None:
                async for signum in signals:
                    log.info("%s: shutting down", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(stop_on_signal)
