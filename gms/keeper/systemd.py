"""The keeper under systemd: what it holds, also held by systemd's fd store.

Where ``$NOTIFY_SOCKET`` is set the keeper pushes every fd it keeps to the
service manager (``FDSTORE=1``, ``FDPOLL=0``) under a name that says what it
is, and removes it when it lets go (``FDSTOREREMOVE=1``):

* ``gms-listener``: the listening socket;
* ``gms-gpu-<id>``, ``gms-host-<id>``: an allocation's memory, a host copy (one
  chunk of a copy of several: ``gms-host-<id>/<offset>/<length>``);
* ``gms-journal-<n>``: a memfd holding the journal as records (a kind byte,
  an 8-byte big-endian length, the bytes): one base (an image, or its parts
  as one msgpack map), then each batch of log entries appended as it comes;
  each base starts a new memfd (the next ``n``), stored before the old one is
  removed.

So if the keeper itself dies (and systemd, ``Restart=``, starts the unit
again), the new keeper gets everything back from ``$LISTEN_FDS`` and
``$LISTEN_FDNAMES`` (:func:`restore`) and hands it to its first server
exactly as it would after a server's crash.  A journal cut short by a crash
mid-write ends at its last whole record.
"""

from __future__ import annotations

import logging
import os
import socket
import struct

import msgpack

from ..system import sdnotify
from .store import LISTENER, Store

log = logging.getLogger("gms.keeper")

_RECORD = struct.Struct(">BQ")
_BASE, _EVENTS, _PARTS = 1, 2, 3
JOURNAL_PREFIX = "gms-journal-"


def fdname(key: str) -> str:
    """A store key as an FDNAME (no ':' allowed there)."""
    return "gms-listener" if key == LISTENER else "gms-" + key.replace(":", "-", 1)


def key_of(name: str) -> str | None:
    if name == "gms-listener":
        return LISTENER
    for tier in ("gpu", "host"):
        if name.startswith(f"gms-{tier}-"):
            return f"{tier}:{name[len(tier) + 5:]}"
    return None


class SystemdMirror:
    """Told of every change of a Store; mirrors it into the service manager."""

    def __init__(self, generation: int = 0, journal: int | None = None) -> None:
        """``journal``: the newest journal memfd the manager handed back (appended to)."""
        self.generation = generation
        self.journal = journal

    def on_fd(self, key: str, fd: int | None) -> None:
        try:
            if fd is None:
                sdnotify.remove_fds(fdname(key))
            else:
                sdnotify.store_fds(fdname(key), [fd])
        except OSError as exc:
            log.error("the service manager did not take %s: %s", key, exc)

    def on_journal(self, kind: str, data: bytes) -> None:
        if kind == "base":
            self._new_journal(data)
        else:
            if self.journal is None:
                self._new_journal(None)
            _write_all(self.journal, _RECORD.pack(_EVENTS, len(data)) + data)

    def _new_journal(self, base: bytes | dict | None) -> None:
        fd = os.memfd_create("gms-journal", os.MFD_CLOEXEC)
        if isinstance(base, dict):
            data = msgpack.packb(base, use_bin_type=True)
            _write_all(fd, _RECORD.pack(_PARTS, len(data)) + data)
        elif base:
            _write_all(fd, _RECORD.pack(_BASE, len(base)) + base)
        old, old_generation = self.journal, self.generation
        self.generation += 1
        try:
            sdnotify.store_fds(f"{JOURNAL_PREFIX}{self.generation}", [fd])
            if old is not None:
                sdnotify.remove_fds(f"{JOURNAL_PREFIX}{old_generation}")
        except OSError as exc:
            log.error("the service manager did not take the journal: %s", exc)
        if old is not None:
            os.close(old)
        self.journal = fd

    def attach(self, store: Store) -> None:
        store.on_fd = self.on_fd
        store.on_journal = self.on_journal

def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def read_journal(fd: int) -> tuple[bytes | dict | None, list[bytes]]:
    """(base, tails) from a journal memfd; a torn last record is left out."""
    data = b""
    offset = 0
    while True:
        chunk = os.pread(fd, 1 << 20, offset)
        if not chunk:
            break
        data += chunk
        offset += len(chunk)
    base, tails, at = None, [], 0
    while at + _RECORD.size <= len(data):
        kind, length = _RECORD.unpack_from(data, at)
        start, end = at + _RECORD.size, at + _RECORD.size + length
        if end > len(data):
            break  # torn: the keeper died writing it
        if kind == _BASE:
            base, tails = data[start:end], []
        elif kind == _PARTS:
            base, tails = msgpack.unpackb(data[start:end], raw=False), []
        elif kind == _EVENTS:
            tails.append(data[start:end])
        at = end
    return base, tails


def restore(passed: list[tuple[int, str]]) -> tuple[Store, SystemdMirror]:
    """A Store from what the manager handed back (it keeps its copies: nothing is
    pushed again), and the mirror that goes on from the newest journal."""
    store = Store()
    journals = []
    for fd, name in passed:
        key = key_of(name)
        if key is not None:
            store.fds[key] = fd
        elif name.startswith(JOURNAL_PREFIX) and name[len(JOURNAL_PREFIX):].isdigit():
            journals.append((int(name[len(JOURNAL_PREFIX):]), fd))
        elif LISTENER not in store.fds and _is_listening_socket(fd):
            store.fds[LISTENER] = fd  # socket activation (a .socket unit)
        else:
            log.warning("closing fd %d (%s) the service manager passed: not the keeper's", fd, name)
            os.close(fd)
    mirror = SystemdMirror()
    if journals:
        journals.sort()
        generation, newest = journals.pop()
        store.base, store.tails = read_journal(newest)
        for older, fd in journals:  # a keeper that died between storing a new one and removing these
            sdnotify.remove_fds(f"{JOURNAL_PREFIX}{older}")
            os.close(fd)
        mirror = SystemdMirror(generation, newest)
        if store.base is not None:
            store.reason = "the keeper was restarted (systemd's fd store kept the node)"
    return store, mirror


def _is_listening_socket(fd: int) -> bool:
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        return sock.family == socket.AF_UNIX and bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
    except OSError:
        return False
    finally:
        sock.close()
