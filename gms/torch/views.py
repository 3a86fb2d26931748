"""Zero-copy tensors over mapped memory.

One uint8 *region* tensor covers a whole mapping; every tensor in it is a
view of the region's storage, so making 500 tensors costs 500 cheap views,
not 500 imports.  Mappings are multiples of the allocation granularity, so
the region can be viewed as any dtype.  On the CUDA backend regions are built through
``__cuda_array_interface__``; on the host backend through ``frombuffer``, so
the same code yields CPU tensors on a machine without a GPU.
"""

from __future__ import annotations

import ctypes

import torch

from .encoding import TensorMeta


class _CudaRegion:
    """Just enough of the CUDA array interface for torch.as_tensor."""

    def __init__(self, va: int, size: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (va, False),
            "version": 3,
            "strides": None,
            "stream": None,  # mapping is synchronous: nothing to wait for
        }


def region(va: int, size: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over ``size`` mapped bytes at ``va``."""
    if device.type == "cuda":
        return torch.as_tensor(_CudaRegion(va, size), device=device)
    return torch.frombuffer((ctypes.c_uint8 * size).from_address(va), dtype=torch.uint8)


class Region:
    """A mapping seen as tensors: a uint8 base, and one typed view per dtype,
    from which each tensor is one ``as_strided`` (about a microsecond)."""

    def __init__(self, va: int, size: int, device: torch.device) -> None:
        self.base = region(va, size, device)
        self.size = size
        self._typed: dict[torch.dtype, torch.Tensor] = {}

    def tensor(self, offset: int, meta: TensorMeta) -> torch.Tensor:
        """The tensor ``meta`` describes, starting ``offset`` bytes into the region."""
        itemsize = meta.itemsize
        if offset % itemsize or offset < 0 or offset + meta.extent_bytes > self.size:
            raise ValueError(
                f"a {meta.dtype} tensor of shape {meta.shape} at offset {offset} is misaligned "
                f"or does not fit in {self.size} bytes"
            )
        typed = self._typed.get(meta.dtype)
        if typed is None:
            typed = self._typed[meta.dtype] = self.base.view(meta.dtype)
        return typed.as_strided(meta.shape, meta.stride, offset // itemsize)


def device_for(backend: str, device: int) -> torch.device:
    return torch.device("cuda", device) if backend == "cuda" else torch.device("cpu")
