"""Big buffers from the heap, not from fresh mappings (glibc's malloc).

glibc serves a block past its mmap threshold (128 KiB at first, raised as
such blocks are freed, within limits) from a new mapping, and gives heap
memory past its trim threshold back to the kernel.  A server that reads a
1 MiB request then pays page faults twice on its one thread: for the frame's
buffer and again for the decoded value; ``bench/frame_decode.py`` measured
it at most of the step that decodes the frame, and each such step is one
that every other client waits behind.  So a server process raises both:
blocks up to 32 MiB (a 16 MiB frame and its value) come from the heap, and
up to 64 MiB freed at its top is kept for the next request rather than
unmapped.  What is kept is what the process used at its peak, no more.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest on 64-bit hosts
TRIM_THRESHOLD_BYTES = 64 << 20


def keep_big_blocks() -> bool:
    """Raise glibc's thresholds for this process; False where there is no glibc
    (another allocator keeps its own rules)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
