"""Byte counts as people write them: ``1073741824``, ``512MiB``, ``20GiB``, ``20GB``, ``8Gi``.

One rule everywhere in gms (quotas, budgets, options, ``gms.ray`` requests),
the SI's and Kubernetes': ``KiB/MiB/GiB/TiB`` (or ``Ki/Mi/Gi/Ti``) are
powers of 1024, ``KB/MB/GB/TB`` powers of 1000: ``20GB`` is 20e9 bytes, as
the Ray design writes it.  A bare ``G`` or ``M`` is refused: a service that
promises bytes must not guess which was meant.
"""

from __future__ import annotations

import re
from fractions import Fraction

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_BYTES = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*")


def parse_bytes(text: str | int) -> int:
    """Raises ValueError for anything that is not a non-negative byte count.
    A fractional byte rounds up."""
    if isinstance(text, bool):
        raise ValueError(f"not a byte count: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a byte count cannot be negative: {text}")
        return text
    match = _BYTES.fullmatch(str(text).lower())
    if not match or match.group(2) not in _UNITS:
        raise ValueError(
            f"not a byte count: {text!r} (bytes, or a number with B, KB, MB, GB, TB "
            "(powers of 10) or KiB, MiB, GiB, TiB (powers of 2))"
        )
    amount = Fraction(match.group(1)) * _UNITS[match.group(2)]
    return -(-amount.numerator // amount.denominator)


def parse_budget(text: str, capacity: int | None) -> int:
    """Bytes (``60GiB``) or a fraction of ``capacity`` (``0.9``)."""
    value = text.strip()
    if re.fullmatch(r"0?\.\d+|1(\.0*)?|0", value):
        if capacity is None:
            raise ValueError(f"a fractional budget ({value}) needs a device of known size")
        return int(float(value) * capacity)
    return parse_bytes(value)


def format_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
