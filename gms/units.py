"""Byte counts as people write them: ``1073741824``, ``1g``, ``1GiB``, ``512MiB``, ``20GB``.

Binary multiples throughout (``GB`` reads as GiB, as ``nvidia-smi`` and
most tools print memory), so a quota and a device size compare directly.
"""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_BYTES = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*")


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
        raise ValueError(f"not a byte count: {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


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
