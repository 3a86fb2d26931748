"""The crc32 the disk tier checks its files with.

zlib-ng's where it is installed (a dependency of gms): it folds with carry-less
multiplies, 0.034 s a GiB on one thread against the standard library's 0.27 s on
the 2-core host (bench/restore_costs.py,
docs/results/restore_costs_2core_1gib_session27.json), where a restore had spent
about as long checksumming as reading (docs/performance.md).  The polynomial is
the same, so a file saved with either is checked by the other.  The standard library's is the fallback where zlib-ng is not
installed (a GPU image with gms on PYTHONPATH): slower, never different.
"""

from __future__ import annotations

try:
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover - zlib-ng is a dependency; the fallback is for bare images
    from zlib import crc32

IMPLEMENTATION = "zlib-ng" if crc32.__module__.startswith("zlib_ng") else "zlib"

__all__ = ["IMPLEMENTATION", "crc32"]
