"""Tensor metadata on the wire: a compact, versioned encoding (never pickle).

A value is the msgpack array ``[1, dtype, shape, stride]``: version 1, the
dtype's name as torch spells it without ``torch.`` (``"bfloat16"``), and the
shape and stride in elements.  The metadata entry's ``offset_bytes`` is where
the tensor's first element lives inside its allocation.
"""

from __future__ import annotations

import functools

import attrs
import msgpack
import torch

VERSION = 1


class TensorMetaError(ValueError):
    """A metadata value that is not a tensor description this version reads."""


@attrs.frozen
class TensorMeta:
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorMeta:
        return cls(tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @functools.cached_property
    def extent_bytes(self) -> int:
        """Bytes from the first element to one past the farthest one (0 if empty)."""
        if any(n == 0 for n in self.shape):
            return 0
        return (sum((n - 1) * s for n, s in zip(self.shape, self.stride)) + 1) * self.itemsize


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Every dtype torch has, by name: a name from the wire is looked up here, never
# with getattr on the module (any attribute, of any type, could be named).
_DTYPES = {dtype_name(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)}


def dtype_from_name(name: object) -> torch.dtype:
    dtype = _DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise TensorMetaError(f"unknown dtype {name!r}")
    return dtype


def encode(meta: TensorMeta) -> bytes:
    return msgpack.packb([VERSION, dtype_name(meta.dtype), list(meta.shape), list(meta.stride)])


def decode(value: bytes) -> TensorMeta:
    try:
        version, name, shape, stride = msgpack.unpackb(value)
    except Exception as exc:  # any malformed value is the same error to a caller
        raise TensorMetaError(f"not a tensor description: {exc}") from exc
    if version != VERSION:
        raise TensorMetaError(f"tensor description version {version}; this gms reads {VERSION}")
    if not (isinstance(shape, list) and isinstance(stride, list) and len(shape) == len(stride)):
        raise TensorMetaError("shape and stride must be lists of one length")
    if not all(type(n) is int and n >= 0 for n in shape) or not all(type(s) is int and s >= 0 for s in stride):
        raise TensorMetaError("shape and stride must be non-negative integers")
    return TensorMeta(dtype_from_name(name), tuple(shape), tuple(stride))
