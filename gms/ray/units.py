"""Bytes of GPU memory as Ray can hold them: parsing requests and rounding them.

Ray keeps every resource quantity as a fixed-point integer of 1/10,000 units
(``kResourceUnitScaling``), converted from a C ``double`` by truncation.  A
quantity of whole bytes therefore stays exact while ``bytes * 10_000`` fits a
double's 53-bit mantissa: up to :data:`EXACT_BYTES` (about 900 GB), far above
any GPU.  gms advertises one resource per GPU in bytes, so Ray's books for a
GPU are exact to the byte.

Requests round up as the seed describes: to the next 1/10,000 of the chosen
GPU, so that each request is also an exact fraction of a GPU in Ray's own
granularity (the ``num_gpus`` it is worth on that GPU).  10 MB on a 40 GB GPU
is 0.0003 of it, scheduled as 12 MB; on an 80 GB GPU 0.0002, 16 MB.
"""

from __future__ import annotations

import math
from fractions import Fraction

import attrs

from ..units import parse_bytes
from .errors import GPUMemoryRequestError

UNIT_SCALING = 10_000  # Ray's fixed point: a quantity is an integer of 1/10,000 units
EXACT_BYTES = 2**53 // UNIT_SCALING  # largest quantity whose units a double holds exactly

def parse_gpu_memory(value: int | str) -> int:
    """Bytes from ``20_000_000_000``, ``"20GB"`` (10^9), ``"20GiB"`` (2^30),
    ``"1.5 GiB"``, ``"512MiB"``, ``"300B"``.  A fractional byte rounds up.

    Raises :class:`GPUMemoryRequestError` (a ``ValueError``) for anything else,
    or for a request of zero or fewer bytes.
    """
    if isinstance(value, bool):  # bool is an int: True would be one byte
        raise GPUMemoryRequestError(f"gpu_memory must be bytes or a size string, not {value!r}")
    if isinstance(value, int):
        amount = Fraction(value)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise GPUMemoryRequestError(f"gpu_memory must be finite, not {value!r}")
        amount = Fraction(value)
    elif isinstance(value, str):
        try:
            amount = Fraction(parse_bytes(value))  # gms's one rule: GB is 10^9, GiB 2^30
        except ValueError as exc:
            raise GPUMemoryRequestError(f"gpu_memory: {exc}") from None
    else:
        raise GPUMemoryRequestError(
            f"gpu_memory must be bytes or a size string, not {type(value).__name__}"
        )
    nbytes = -(-amount.numerator // amount.denominator)  # ceil
    if nbytes <= 0:
        raise GPUMemoryRequestError(f"gpu_memory must be more than zero bytes, not {value!r}")
    return nbytes


@attrs.frozen
class Rounded:
    """A request rounded to the GPU it would land on."""

    asked_bytes: int
    capacity_bytes: int
    units: int  # ten-thousandths of the GPU

    @property
    def scheduled_bytes(self) -> int:
        # Floor, yet never below what was asked: units * capacity >= asked * 10_000.
        # Floors also never add up past the GPU: sum(floor) <= floor(sum) <= capacity.
        return self.units * self.capacity_bytes // UNIT_SCALING

    @property
    def fraction(self) -> float:
        """What the request is worth in ``num_gpus`` on this GPU."""
        return self.units / UNIT_SCALING

    @property
    def fits(self) -> bool:
        return self.units <= UNIT_SCALING


def round_to_gpu(asked_bytes: int, capacity_bytes: int) -> Rounded:
    """Round ``asked_bytes`` up to the next 1/10,000 of a GPU of ``capacity_bytes``."""
    if capacity_bytes <= 0:
        raise ValueError(f"a GPU's capacity must be positive, not {capacity_bytes}")
    units = -(-asked_bytes * UNIT_SCALING // capacity_bytes)
    return Rounded(asked_bytes, capacity_bytes, units)


def format_size(nbytes: float) -> str:
    """``40 GB`` / ``38.4 GiB``-style text for messages: both, since users write either."""
    nbytes = int(nbytes)
    if nbytes < 10**6:
        return f"{nbytes} B"
    return f"{nbytes / 1e9:.4g} GB ({nbytes / 2**30:.4g} GiB, {nbytes} bytes)"
