"""Real servers in real processes, and raw protocol connections to them."""

from __future__ import annotations

import array
import contextlib
import itertools
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from gms.client.probes import get_event_history, get_runtime_state, iter_event_history
from gms.errors import GMSError
from gms.wire import FrameDecoder, decode, encode
from gms.wire import messages as m

MiB = 1 << 20
NODE_KINDS = ("SERVER_STARTED", "SESSION_OPENED", "SESSION_CLOSED")
_counter = itertools.count()


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.01, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class ServerProcess:
    """``python -m gms serve`` on a private socket; stderr goes to a log file."""

    def __init__(
        self, tmp_path: Path, *args: str, backend: str = "host", device: int = 0, socket_path: str | None = None,
        keeper: bool = False, preexec_fn=None,
    ) -> None:
        """``socket_path``: a path of its own (a new server in a dead one's place, say).
        ``keeper``: under its keeper, as ``gms serve`` runs by default (``proc`` is
        then the keeper; :meth:`server_pid` the server).  Without, the server alone
        (``--no-keeper``): what most tests are about.  ``preexec_fn``: run in the
        process before it starts (a lower fd limit, say)."""
        n = next(_counter)
        self.keeper = keeper
        self.tmp_path = tmp_path
        self.socket = socket_path or str(tmp_path / f"gms-{n}.sock")
        self.log_path = tmp_path / f"server-{n}.log"
        self.backend = backend
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gms", "serve", "--backend", backend, "--device", str(device),
             "--socket", self.socket, "--log-level", "warning", *([] if keeper else ["--no-keeper"]), *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec_fn,
        )
        wait_until(self._ready, timeout=30, what=f"server on {self.socket}\n{self.log}")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log}")
        try:
            get_runtime_state(self.socket, timeout=1)
        except GMSError:
            return False
        return True

    @property
    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def server_pid(self) -> int:
        """The serving process's pid (the keeper's child, under a keeper)."""
        return get_runtime_state(self.socket).pid

    def state(self) -> m.GetRuntimeStateResponse:
        return get_runtime_state(self.socket)

    def keeper_children(self) -> set[int]:
        """Under a keeper: its own children (the serving server, a spare standing by)."""
        found: set[int] = set()
        for task in os.listdir(f"/proc/{self.pid}/task"):
            try:
                with open(f"/proc/{self.pid}/task/{task}/children") as children:
                    found |= {int(c) for c in children.read().split()}
            except OSError:
                continue
        return found

    def wait_for_spare(self, timeout: float = 30) -> int:
        """Under a keeper: the spare beside the serving server, once it stands by
        (started, its hello said: it then waits in a read, using no CPU)."""
        serving = self.server_pid()
        spare = wait_until(lambda: next(iter(self.keeper_children() - {serving}), None), timeout=timeout,
                           what="a spare server beside the serving one")

        def cpu() -> tuple[str, int]:
            with open(f"/proc/{spare}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            return fields[0], int(fields[11]) + int(fields[12])  # state, utime + stime

        last = [cpu()]

        def idle() -> bool:
            now = cpu()
            still = now[0] == "S" and now[1] == last[0][1]
            last[0] = now
            return still

        wait_until(idle, timeout=timeout, interval=0.3, what="the spare standing by")
        return spare

    def layout(self, name: str = "weights") -> m.LayoutStatus:
        return self.state().layout(name)

    def events(self, since: int = 0) -> list:
        return list(iter_event_history(self.socket, since))

    def kinds(self, since: int = 0, *, sessions: bool = False) -> list[str]:
        """Kinds of the events after ``since``; without the start and session
        events (which bracket every connection) unless ``sessions``."""
        return [e.kind for e in self.events(since) if sessions or e.kind not in NODE_KINDS]

    def history(self, since=None, limit=None):
        return get_event_history(self.socket, since, limit)

    def open_fds(self, sockets: bool = True) -> int:
        """The serving process's (under a keeper: the server's, not the keeper's).
        ``sockets=False``: those that are no socket (memory, files), which a
        connection the server has yet to see end cannot move."""
        pid = self.server_pid() if self.keeper else self.pid
        folder = f"/proc/{pid}/fd"
        if sockets:
            return len(os.listdir(folder))
        count = 0
        for fd in os.listdir(folder):
            try:
                count += not os.readlink(f"{folder}/{fd}").startswith("socket:")
            except OSError:  # closed meanwhile
                pass
        return count

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        finally:
            self._log.close()
        return code

    def kill(self) -> None:
        """SIGKILL it, and under a keeper everything under it: each process is
        stopped first (a server whose keeper died starts another, a keeper
        whose server died starts another), then all are killed."""
        if self.keeper:
            kill_tree(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._log.close()


def state_or_none(path: str):
    """The server's runtime state on ``path``, or None while nothing answers there."""
    try:
        return get_runtime_state(path, timeout=1)
    except GMSError:
        return None


def kill_tree(pid: int) -> None:
    """Stop ``pid`` and every process under it (until no new one appears), then kill them all."""
    stopped: list[int] = []
    while True:
        new = [p for p in [pid, *descendants(pid)] if p not in stopped]
        if not new:
            break
        for p in new:
            try:
                os.kill(p, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        stopped += new
    for p in stopped:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (from /proc: children of each of its threads)."""
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as children:
                for child in children.read().split():
                    found += [int(child), *descendants(int(child))]
        except OSError:
            continue
    return found


def dropped(conn: "RawConn") -> bool:
    """The server closed the connection (a reset counts: it closed with our bytes unread)."""
    try:
        response, _ = conn.recv(5)
    except ConnectionResetError:
        return True
    return response is None


class RawConn:
    """A protocol connection with no client library in the way."""

    def __init__(self, path: str) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        self._adopt(sock)

    def _adopt(self, sock: socket.socket) -> None:
        self.sock = sock
        self.decoder = FrameDecoder(1 << 30)

    @classmethod
    def from_socket(cls, sock: socket.socket) -> RawConn:
        """A connection someone else opened (a child of another uid, say)."""
        conn = cls.__new__(cls)
        conn._adopt(sock)
        return conn

    def send(self, message) -> None:
        self.sock.sendall(encode(message))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def readable(self, timeout: float) -> bool:
        return bool(self.decoder.pending) or bool(select.select([self.sock], [], [], timeout)[0])

    def recv(self, timeout: float = 10.0):
        """The next message and the fds that came with it; None on EOF."""
        fds: list[int] = []
        deadline = time.monotonic() + timeout
        while True:
            body = self.decoder.next_frame()
            if body is not None:
                return decode(body), fds
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                raise TimeoutError("no response")
            data, anc, _, _ = self.sock.recvmsg(1 << 20, socket.CMSG_SPACE(253 * 4))
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(array.array("i", payload[: len(payload) - len(payload) % 4]))
            if not data:
                return None, fds
            self.decoder.feed(data)

    def call(self, message, timeout: float = 10.0):
        self.send(message)
        response, fds = self.recv(timeout)
        for fd in fds:
            os.close(fd)
        return response

    def closed_by_peer(self, timeout: float = 5.0) -> bool:
        """Did the server close the connection (after, at most, a SessionEnded notice)?"""
        try:
            response, _ = self.recv(timeout)
            if isinstance(response, m.SessionEnded):
                response, _ = self.recv(timeout)
        except (TimeoutError, ConnectionResetError):
            return False
        return response is None

    def handshake(self, lock_type: str, timeout_ms=None, layout: str = "weights", limit_bytes=None):
        return self.call(m.HandshakeRequest(lock_type, timeout_ms, layout, limit_bytes))

    def close(self) -> None:
        self.sock.close()


def connect_as(path: str, uid: int | None) -> RawConn:
    """A connection whose peer credentials are ``uid``'s (needs root): a forked
    child with that uid connects and hands the socket back over a socketpair.
    The server sees the child's credentials, as it would a pod's."""
    if uid is None:
        return RawConn(path)
    here, there = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the child: only system calls, then _exit
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            socket.send_fds(there, [b"x"], [sock.fileno()])
        finally:
            os._exit(0)
    there.close()
    try:
        _, fds, _, _ = socket.recv_fds(here, 1, 1)
    finally:
        here.close()
        os.waitpid(pid, 0)
    if not fds:
        raise PermissionError(f"uid {uid} could not connect to {path}")
    return RawConn.from_socket(socket.socket(fileno=fds[0]))


@contextlib.contextmanager
def shared_folder(prefix: str = "gms-"):
    """A folder other uids may enter (pytest's are private to their owner),
    removed with everything in it when the block ends."""
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        folder.chmod(0o755)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def build_layout(conn: RawConn, sizes=(3 * MiB, 5 * MiB), tag: str = "weights") -> list[m.AllocateResponse]:
    """Allocate and describe a small layout on a connection holding RW."""
    out = []
    for n, size in enumerate(sizes):
        allocation = conn.call(m.AllocateRequest(size, tag))
        assert isinstance(allocation, m.AllocateResponse), allocation
        put = conn.call(m.MetadataPutRequest(f"t{n}", allocation.allocation_id, n, b"meta%d" % n))
        assert put == m.MetadataPutResponse(True)
        out.append(allocation)
    return out


class LayoutCopy:
    """A committed layout read whole (structure and bytes) from one server, to
    publish on another: what a restarted server's keeper will bring back by
    itself.  The same structure hashes the same, so readers of the original
    ride through to the copy."""

    def __init__(self, socket_path: str, layout: str = "weights") -> None:
        from gms import GMSClientMemoryManager, RequestedLockType

        reader = GMSClientMemoryManager(socket_path, layout=layout)
        try:
            reader.connect(RequestedLockType.RO)
            self.layout = layout
            self.layout_hash = reader.get_memory_layout_hash()
            self.allocations = reader.list_handles()  # in slot order
            vas = reader.create_mappings([a.allocation_id for a in self.allocations])
            self.contents = [reader.read(va, a.size) for va, a in zip(vas, self.allocations)]
            self.metadata = reader.metadata_scan()
        finally:
            reader.close()

    def publish(self, socket_path: str) -> str:
        from gms import GMSClientMemoryManager, RequestedLockType

        writer = GMSClientMemoryManager(socket_path, layout=self.layout)
        try:
            writer.connect(RequestedLockType.RW)
            new_ids = {}
            for allocation, content in zip(self.allocations, self.contents):
                va = writer.create_mapping(size=allocation.size, tag=allocation.tag)
                writer.write(va, content)
                new_ids[allocation.allocation_id] = next(mp.allocation_id for mp in writer.mappings if mp.va == va)
            writer.metadata_put_many(
                (key, new_ids[old], offset, value) for key, (old, offset, value) in self.metadata.items()
            )
            writer.commit()
            assert writer.get_memory_layout_hash() == self.layout_hash, "the copy hashes as the original"
            return self.layout_hash
        finally:
            writer.close()


@contextlib.contextmanager
def served_from_store(tmp_path, store, *args: str, backend: str = "host"):
    """A ``gms serve --keeper-socket`` handed back what ``store`` (a keeper's
    ``Store``) holds, by this test standing in for the keeper: yields a
    :class:`Served` once the server is ready (its ``output`` is there after
    the block); the store keeps what the server reports, as a keeper would."""
    from gms.handover import frames

    keeper_path = str(tmp_path / "fake-keeper.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(keeper_path)
    listener.listen(1)
    served = Served(str(tmp_path / "gms.sock"))
    server = subprocess.Popen(
        [sys.executable, "-m", "gms", "serve", "--backend", backend, "--socket", served.path,
         "--keeper-socket", keeper_path, *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        conn, _ = listener.accept()
        with conn:
            reader = frames.FrameReader()
            hello = frames.recv_frame(conn, reader)
            assert hello.kind == "hello"
            served.hello = hello.body
            body, keyed = store.handback()
            frames.send_frame(conn, "handback", body)
            frames.send_fds(conn, "fds", keyed)
            frames.send_frame(conn, "end")
            while store.apply(frames.recv_frame(conn, reader)) != "ready":
                pass
            yield served
    finally:
        server.kill()
        served.output = server.communicate()[0]
        listener.close()


class Served:
    def __init__(self, path: str) -> None:
        self.path = path
        self.hello: dict = {}
        self.output = ""  # the server's, once it was killed
