"""Every endpoint that hands over fds or state checks who is on the other end (issue 32).

Each test puts a stranger (a process of another uid, as the kernel says) or a
forger where gms used to take whoever answered:

* a keeper socket bound first by another user: the server refuses it, and
  sends it nothing (it used to send every allocation's fd and every event);
* a "server" of another user on the path a ``--take-over`` asks: refused
  before anything is asked (root used to adopt its node);
* a handed-over image that breaks an invariant (a tenant charged -1 TiB),
  a malformed fd frame: refused with 75, the old server serving on (they
  were accepted, or exited 70);
* a socket of another user where a client looks: the client sends it nothing
  (``UntrustedServerError``) unless told to trust that uid; the default
  socket folder is one only the daemon's user can create files in.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from gms import GMSClientMemoryManager, RequestedLockType, UntrustedServerError
from gms.errors import GMSConnectionError
from gms.handover import frames
from gms.handover.image import decode_image, encode_image
from gms.system import paths
from gms.wire import encode
from gms.wire import messages as m

from .handover_fixtures import FIXTURE
from .test_restart import _kill_servers, kept, publish_raw  # noqa: F401 - the autouse fixture
from .test_takeover import OldServer

AS_ROOT = os.geteuid() == 0
STRANGER = 27999
needs_root = pytest.mark.skipif(not AS_ROOT, reason="needs root to run a stranger as another uid")


class Squatter:
    """A process of another uid listening on ``path`` (a folder others may write):
    it counts the bytes and fds each connection sends it, and answers nothing."""

    def __init__(self, path: str, uid: int = STRANGER) -> None:
        self.path = path
        ready_r, ready_w = os.pipe()
        self.report_r, report_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: plain system calls, then _exit
            try:
                os.close(ready_r)
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                listener = socket.socket(socket.AF_UNIX)
                listener.bind(path)
                listener.listen(8)
                os.write(ready_w, b"1")
                got = 0
                while True:
                    conn, _ = listener.accept()
                    conn.settimeout(2.0)
                    try:
                        while True:
                            data, ancillary, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(253 * 4))
                            got += len(data) + sum(len(a[2]) for a in ancillary)
                            os.write(report_w, f"{got}\n".encode())
                            if not data:
                                break
                    except OSError:
                        pass
                    conn.close()
            finally:
                os._exit(0)
        os.close(ready_w)
        os.close(report_w)
        self.pid = pid
        assert os.read(ready_r, 1) == b"1"
        os.close(ready_r)

    def received(self) -> int:
        """Bytes (and fd payloads) received so far."""
        os.set_blocking(self.report_r, False)
        last = 0
        try:
            while chunk := os.read(self.report_r, 4096):
                last = int(chunk.split()[-1])
        except BlockingIOError:
            pass
        return last

    def stop(self) -> None:
        os.kill(self.pid, 9)
        os.waitpid(self.pid, 0)


@pytest.fixture
def open_folder():
    """A folder under /tmp where anyone may create a file (as in /tmp itself;
    pytest's own folders are closed to other users)."""
    folder = Path(tempfile.mkdtemp(prefix="gms-trust-", dir="/tmp"))
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@needs_root
def test_a_keeper_socket_bound_by_a_stranger_is_refused_and_sent_nothing(tmp_path, open_folder):
    folder = open_folder
    squatter = Squatter(str(folder / "keeper.sock"))
    try:
        out = subprocess.run(
            [sys.executable, "-m", "gms", "serve", "--backend", "host", "--socket", str(tmp_path / "gms.sock"),
             "--keeper-socket", squatter.path], capture_output=True, text=True, timeout=60,
        )
        time.sleep(0.3)
        assert out.returncode == 1, out.stderr
        assert f"run by uid {STRANGER}" in out.stderr and "Traceback" not in out.stderr
        assert squatter.received() == 0, "not a byte, not an fd"
    finally:
        squatter.stop()


@needs_root
def test_a_take_over_of_a_stranger_s_server_is_refused_before_a_word(open_folder):
    folder = open_folder
    squatter = Squatter(str(folder / "gms.sock"))
    try:
        out = subprocess.run(
            [sys.executable, "-m", "gms", "serve", "--backend", "host", "--socket", squatter.path, "--take-over",
             "--no-keeper"], capture_output=True, text=True, timeout=60,
        )
        assert out.returncode == 75, out.stderr
        assert f"run by uid {STRANGER}" in out.stderr
        assert squatter.received() == 0
    finally:
        squatter.stop()


def _forged_tenant_image() -> bytes:
    """The fixture's image with a tenant charged -1 TiB (to slip past its quota)."""
    import attrs

    image = decode_image(FIXTURE.read_bytes())
    state = image.state
    name, tenant = next(iter(state.tenants.items()))
    forged = attrs.evolve(state, tenants=state.tenants.set(name, attrs.evolve(tenant, used_bytes=-(1 << 40))))
    return encode_image(attrs.evolve(image, state=forged, version=2))


def take_over_from(old: OldServer) -> subprocess.CompletedProcess:
    """``gms serve --take-over`` (no keeper) of the stand-in ``old``, run to its end."""
    out = subprocess.run(
        [sys.executable, "-m", "gms", "serve", "--no-keeper", "--backend", "host", "--socket", old.path,
         "--take-over"], capture_output=True, text=True, timeout=60,
    )
    old.thread.join(10)
    return out


def test_a_handed_image_that_breaks_an_invariant_is_refused_and_the_old_server_serves_on(tmp_path):
    old = OldServer(str(tmp_path / "old.sock"), _forged_tenant_image())
    try:
        out = take_over_from(old)
        assert out.returncode == 75, out.stderr
        assert "not one to serve" in out.stderr and "charged" in out.stderr
        assert old.verdict.startswith("abort: ")
    finally:
        old.close()


def test_a_malformed_fd_frame_is_refused_with_75_not_70(tmp_path):
    class Garbled(OldServer):
        def _serve(self) -> None:
            conn = self.asked()
            conn.sendall(encode(m.TakeOverResponse(1, 4242)))
            frames.send_frame(conn, "image", {"image": self.image})
            fd = next(iter(self.memory.values()))
            frames.send_frame(conn, "fds", {"keys": 7}, [fd])  # keys: not a list
            frames.send_frame(conn, "end")
            try:
                frame = frames.recv_frame(conn, frames.FrameReader())
                self.verdict = f"{frame.kind}: {frame.body.get('reason', '')}"
            except frames.FrameError:
                self.verdict = "silence"
            conn.close()

    old = Garbled(str(tmp_path / "old.sock"), FIXTURE.read_bytes())
    try:
        out = take_over_from(old)
        assert out.returncode == 75, out.stderr
        assert "broke off" in out.stderr and "Traceback" not in out.stderr
        assert old.verdict.startswith("abort: ")
    finally:
        old.close()


@pytest.mark.parametrize("listener", ["a file", "a socket that does not listen"])
def test_a_handed_listener_that_is_not_a_listening_socket_is_refused_with_75(tmp_path, listener):
    """Was (issue 48): exit 1, the take-over neither done nor refused as the docs say."""

    class WrongListener(OldServer):
        def handed_listener(self) -> int:
            if listener == "a file":
                return os.open(str(tmp_path / "not-a-socket"), os.O_RDWR | os.O_CREAT)
            return socket.socket(socket.AF_UNIX).detach()

    old = WrongListener(str(tmp_path / "old.sock"), FIXTURE.read_bytes())
    try:
        out = take_over_from(old)
        assert out.returncode == 75, out.stderr
        assert "listener" in out.stderr and "Traceback" not in out.stderr
        assert old.verdict.startswith("abort: ")
    finally:
        old.close()


@needs_root
def test_a_client_sends_nothing_to_a_stranger_on_its_socket_unless_told_to_trust_it(open_folder, monkeypatch):
    folder = open_folder
    squatter = Squatter(str(folder / "gms.sock"))
    try:
        with pytest.raises(UntrustedServerError, match=f"uid {STRANGER}"):
            GMSClientMemoryManager(squatter.path).connect(RequestedLockType.RO)
        assert squatter.received() == 0
        monkeypatch.setenv("GMS_SERVER_UIDS", str(STRANGER))  # a daemon run as a user of its own
        with pytest.raises(GMSConnectionError) as told:
            GMSClientMemoryManager(squatter.path, call_timeout_s=0.5).connect(RequestedLockType.RO)
        assert not isinstance(told.value, UntrustedServerError)
        assert squatter.received() > 0
    finally:
        squatter.stop()


def test_the_default_socket_folder_is_one_only_the_daemon_s_user_creates_files_in(tmp_path, monkeypatch):
    monkeypatch.delenv("GMS_SOCKET_DIR", raising=False)
    monkeypatch.setenv("GMS_BACKEND", "host")
    if AS_ROOT:
        assert paths.socket_path(0, serving=True) == "/run/gms/gms_host-0.sock"
        assert paths.socket_path(0) == "/run/gms/gms_host-0.sock"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert paths.user_dir() == str(tmp_path / "gms")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert paths.user_dir() == f"/tmp/gms-{os.getuid()}"


@needs_root
def test_a_server_will_not_serve_in_a_folder_another_user_owns(tmp_path):
    folder = tmp_path / "theirs"
    folder.mkdir()
    os.chown(folder, STRANGER, STRANGER)
    out = subprocess.run(
        [sys.executable, "-m", "gms", "serve", "--no-keeper", "--backend", "host", "--socket",
         str(folder / "gms.sock")], capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 1 and f"belongs to uid {STRANGER}" in out.stderr, out.stderr


# -- files root writes in folders others may write (issue 48) ---------------------------------


def test_the_ready_file_is_never_written_through_a_planted_link(tmp_path, open_folder):
    victim = tmp_path / "victim"
    victim.write_text("root's own file\n")
    (open_folder / "device-0.ready").symlink_to(victim)  # a local user's link where the ready file goes
    out = subprocess.Popen(
        [sys.executable, "-m", "gms", "serve", "--backend", "host", "--no-keeper", "--socket",
         str(tmp_path / "gms.sock"), "--ready-dir", str(open_folder)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        ready = open_folder / "device-0.ready"
        deadline = time.monotonic() + 30
        while ready.is_symlink() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not ready.is_symlink() and ready.read_text() == f"{out.pid}\n"
        assert victim.read_text() == "root's own file\n", "the link was not followed"
    finally:
        out.terminate()
        out.wait(30)
    assert not (open_folder / "device-0.ready").exists() and victim.exists()


def test_files_the_daemon_writes_follow_no_link_and_keep_their_mode(tmp_path, open_folder):
    from gms.system import files

    victim = tmp_path / "victim"
    victim.write_text("untouched\n")
    os.umask(old := os.umask(0o022))
    (open_folder / "journal.jsonl").symlink_to(victim)
    (open_folder / f".journal.jsonl.{os.getpid()}.new").symlink_to(victim)  # its temporary name too
    with pytest.raises(FileExistsError):  # the temporary name is taken: nothing is written through it
        with files.write_new(str(open_folder), "journal.jsonl") as out:
            out.write("secrets\n")
    os.unlink(open_folder / f".journal.jsonl.{os.getpid()}.new")
    with files.write_new(str(open_folder), "journal.jsonl") as out:
        out.write("secrets\n")
    written = open_folder / "journal.jsonl"
    assert not written.is_symlink() and written.read_text() == "secrets\n"
    assert os.stat(written).st_mode & 0o777 == 0o600 and victim.read_text() == "untouched\n"
    link = tmp_path / "folder-link"
    link.symlink_to(open_folder)
    with pytest.raises(OSError):  # a folder that is a link is not written in
        with files.write_new(str(link), "other.jsonl") as out:
            out.write("x")
    files.remove(str(open_folder), "journal.jsonl")
    assert not written.exists() and victim.exists()
    assert old == os.umask(old)
