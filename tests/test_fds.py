"""Room in the fd table is made before a batch of fds arrives."""

from __future__ import annotations

import os
import threading

import pytest

from gms.system.fds import _table, reserve_fd_slots

pytestmark = pytest.mark.skipif(_table() is None, reason="needs /proc/self/status")


def test_reserving_slots_grows_the_table_once_and_clobbers_nothing(tmp_path):
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait)  # a second thread, as torch and CUDA make
    worker.start()
    try:
        opened = [os.open(tmp_path, os.O_RDONLY) for _ in range(10)]
        size, used = _table()
        reserve_fd_slots(size)  # more than fit now
        grown, used_after = _table()
        assert grown > used + size - 1 and used_after == used
        inode = os.stat(tmp_path).st_ino
        assert all(os.fstat(fd).st_ino == inode for fd in opened)  # every fd still open, still ours
        reserve_fd_slots(10)
        assert _table() == (grown, used)
    finally:
        stop.set()
        worker.join()
        for fd in opened:
            os.close(fd)
