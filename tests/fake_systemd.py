"""A stand-in for systemd's service manager: its notify socket and its file-descriptor store.

No systemd runs here, so the keeper's systemd path is tested against this,
built to the documented semantics (sd_notify(3), sd_listen_fds(3),
systemd.service(5), https://systemd.io/FILE_DESCRIPTOR_STORE/), not to
systemd's code:

* a datagram socket at ``$NOTIFY_SOCKET``; it reads the sender's credentials
  (``SO_PASSCRED``) and, as with ``NotifyAccess=main``, takes messages from the
  main process only (others' fds are closed);
* ``READY=1``, ``STATUS=``, ``STOPPING=1`` recorded; ``FDSTORE=1`` keeps the
  message's fds under ``FDNAME=`` (default ``stored``), at most
  ``FileDescriptorStoreMax`` (passed as ``$FDSTORE``), refusing (closing) the
  rest; ``FDSTOREREMOVE=1`` closes every fd stored under ``FDNAME=``;
* starting the service: a fork that puts the stored fds at 3, 4, ... in the
  order they were stored, sets ``LISTEN_FDS``, ``LISTEN_PID`` (the child's own
  pid) and ``LISTEN_FDNAMES``, then execs; the store keeps its copies across
  restarts, as the manager does until the unit is stopped;
* killing the service kills its main process and every descendant (the
  control group).
"""

from __future__ import annotations

import array
import os
import signal
import socket
import struct
import threading

from .helpers import descendants, kill_tree

_UCRED = struct.Struct("3i")


class FakeSystemd:
    def __init__(self, folder, store_max: int = 4096) -> None:
        self.path = str(folder / "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(self.path)
        self.store_max = store_max
        self.store: list[tuple[str, int]] = []
        self.states: list[str] = []
        self.refused = 0
        self.main_pid: int | None = None
        self.ready = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    # -- the notify socket -------------------------------------------------------

    def _read(self) -> None:
        while True:
            try:
                data, ancillary, _, _ = self.sock.recvmsg(
                    4096, socket.CMSG_SPACE(253 * 4) + socket.CMSG_SPACE(_UCRED.size)
                )
            except OSError:
                return
            fds, pid = [], None
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(array.array("i", payload[: len(payload) - len(payload) % 4]))
                elif level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = _UCRED.unpack(payload[: _UCRED.size])[0]
            self._take(data.decode(), fds, pid)

    def _take(self, text: str, fds: list[int], pid: int | None) -> None:
        with self._lock:
            if pid is None or pid != self.main_pid:
                for fd in fds:
                    os.close(fd)
                return
            fields = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
            self.states.append(text)
            name = fields.get("FDNAME", "stored")
            if fields.get("FDSTORE") == "1":
                for fd in fds:
                    if len(self.store) >= self.store_max:
                        self.refused += 1
                        os.close(fd)
                    else:
                        self.store.append((name, fd))
                fds = []
            if fields.get("FDSTOREREMOVE") == "1":
                for stored, fd in [entry for entry in self.store if entry[0] == name]:
                    os.close(fd)
                self.store = [entry for entry in self.store if entry[0] != name]
            for fd in fds:  # fds with no FDSTORE=1 are not kept
                os.close(fd)
            if fields.get("READY") == "1":
                self.ready.set()

    def names(self) -> list[str]:
        with self._lock:
            return [name for name, _ in self.store]

    # -- the service ---------------------------------------------------------------

    def start(self, argv: list[str], env: dict[str, str]) -> int:
        """Start the service with the stored fds at 3.. (as after a restart); returns its pid."""
        self.ready.clear()
        with self._lock:
            stored = list(self.store)
        env = {**env, "NOTIFY_SOCKET": self.path, "FDSTORE": str(self.store_max)}
        if stored:
            env["LISTEN_FDS"] = str(len(stored))
            env["LISTEN_FDNAMES"] = ":".join(name for name, _ in stored)
        pid = os.fork()
        if pid == 0:  # the child: only system calls, then exec
            try:
                # Out of the way of 3.., then into place (they may already sit there).
                moved = [os.dup(fd) for _, fd in stored]
                for n, fd in enumerate(moved):
                    os.dup2(fd, 3 + n, inheritable=True)
                os.closerange(3 + len(moved), 4096)
                if stored:
                    env["LISTEN_PID"] = str(os.getpid())
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)
        self.main_pid = pid
        return pid

    def kill(self) -> None:
        """SIGKILL the main process and every process under it (the control group:
        frozen first, as a cgroup is, so that none starts another meanwhile)."""
        pids = descendants(self.main_pid) + [self.main_pid]
        kill_tree(self.main_pid)
        for pid in pids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass

    def stop(self, timeout: float = 30) -> int | None:
        """SIGTERM the main process; its exit status (None if it had to be killed)."""
        import time

        os.kill(self.main_pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.main_pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        self.kill()
        return None

    def close(self) -> None:
        self.sock.close()
        with self._lock:
            for _, fd in self.store:
                os.close(fd)
            self.store = []
