"""A server process takes big buffers from its heap (gms/system/heap.py), in a process of its own."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = r"""
import ctypes, sys
from gms.system.heap import keep_big_blocks
if sys.argv[1] == "kept":
    assert keep_big_blocks()
def in_heap(buffer):
    address = ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer))
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return True
    return False
print(in_heap(bytearray(8 << 20)))
"""


def where_8_mib_goes(heap: str) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE, heap], capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_a_big_buffer_comes_from_the_heap_once_the_thresholds_are_raised():
    if where_8_mib_goes("default") != "False":
        pytest.skip("this allocator serves 8 MiB from its heap already")
    assert where_8_mib_goes("kept") == "True", "8 MiB still came from a mapping of its own"
