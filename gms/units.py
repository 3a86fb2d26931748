"""Byte counts as people write them: ``1073741824``, ``512MiB``, ``20GiB``, ``20GB``, ``8Gi``.

One rule everywhere in gms (quotas, budgets, options, ``gms.ray`` requests),
the one Kubernetes quantities and the SI follow: ``KiB/MiB/GiB/TiB`` (or
``Ki/Mi/Gi/Ti``) are powers of 1024, ``KB/MB/GB/TB`` (or ``K/M/G/T``) powers
of 1000.  ``20GB`` is 20e9 bytes, as the Ray design writes it; a device's
"80 GB" is 80 GiB-ish, so write GiB where you mean the binary size.
"""

from __future__ import annotations

import re

_BINARY = {"ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}
_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BYTES = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*")


def parse_bytes(text: str | int) -> int:
    """Raises ValueError for anything that is not a non-negative byte count."""
    if isinstance(text, bool):
        raise ValueError(f"not a byte count: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a byte count cannot be negative: {text}")
        return text
    match = _BYTES.fullmatch(str(text).lower())
    if not match:
        raise ValueError(f"not a byte count: {text!r} (say 512MiB, 20GiB or 20GB)")
    unit = match.group(2) or ""
    return int(float(match.group(1)) * (_BINARY.get(unit) or _DECIMAL[unit]))


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
