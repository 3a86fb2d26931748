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

A keeper wants the opposite (:func:`return_big_blocks`): it is on no
request's path, and its big blocks (frames of events and of the state's
parts, a megabyte each when a tenant stores values that big) come and go
in sizes that never quite match: from the heap they left holes the next
ones did not fit, and a keeper holding 63 MiB of a tenant's values grew to
two and a half times that.  Given back to the kernel each time, they cost
a page fault per page, which nobody waits for.
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
    return _set(MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES)


def return_big_blocks() -> bool:
    """Blocks past 128 KiB from mappings of their own, always (setting the
    threshold stops glibc from raising it as such blocks are freed), and freed
    heap past 1 MiB given back: for a process whose memory should follow what
    it holds (the keeper)."""
    return _set(RETURN_MMAP_THRESHOLD_BYTES, RETURN_TRIM_THRESHOLD_BYTES)


RETURN_MMAP_THRESHOLD_BYTES = 128 << 10
RETURN_TRIM_THRESHOLD_BYTES = 1 << 20


def _set(mmap_threshold: int, trim_threshold: int) -> bool:
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(M_TRIM_THRESHOLD, trim_threshold))


def give_back_free_memory() -> bool:
    """Return the free pages inside the heap to the kernel (glibc's
    ``malloc_trim(0)``): the holes big blocks of slightly different sizes leave
    as they come and go, which the heap's top alone never gives back.  A few
    milliseconds for a heap of hundreds of MiB; False where there is no glibc."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = (ctypes.c_size_t,)
    return bool(trim(0))

