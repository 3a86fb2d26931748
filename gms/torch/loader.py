"""The cold-start writer path: a safetensors checkpoint straight into gms.

The files' headers are read (no tensor is built on the host), the tensors are
packed into few large allocations, and bytes stream from the files into the
mapped memory: on the host backend ``readinto`` the mapping itself, on CUDA
through two pinned staging buffers so that reading the next chunk overlaps
copying the last one to the device.  Then every tensor is described in one
metadata round trip (per 4096 tensors).  The caller commits.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import attrs
import torch

from ..client.manager import GMSClientMemoryManager
from ..fsm import GrantedLockType
from .encoding import TensorMeta, encode
from .packing import DEFAULT_PACK_BYTES, plan_packs
from .views import device_for, region

SAFETENSORS_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
STAGING_BYTES = 64 << 20
_PUT_BATCH = 4096


class CheckpointError(ValueError):
    pass


@attrs.frozen
class StoredTensor:
    path: str
    name: str
    meta: TensorMeta
    start: int  # absolute byte offset in the file
    nbytes: int


def read_header(path: str | os.PathLike) -> list[StoredTensor]:
    """The tensors a safetensors file holds, in file order."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointError(f"{path}: too short for a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > 100 << 20:
            raise CheckpointError(f"{path}: header of {length} bytes is not believable")
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise CheckpointError(f"{path}: bad header: {exc}") from exc
    data_start = 8 + length
    size = os.path.getsize(path)
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"{path}: {name} has unsupported dtype {info.get('dtype')!r}")
        shape = tuple(info["shape"])
        begin, end = info["data_offsets"]
        stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
        meta = TensorMeta(dtype, shape, stride)
        numel = math.prod(shape)
        if end - begin != numel * dtype.itemsize or data_start + end > size:
            raise CheckpointError(f"{path}: {name} has inconsistent offsets")
        out.append(StoredTensor(path, name, meta, data_start + begin, end - begin))
    return sorted(out, key=lambda t: t.start)


class _Progress:
    def __init__(self, total: int, enabled: bool | None) -> None:
        self.total = total
        self.done = 0
        self.enabled = (total >= 1 << 30 and sys.stderr.isatty()) if enabled is None else enabled
        self.started = self.last = time.monotonic()

    def advance(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self.last > 0.5 or self.done == self.total):
            self.last = now
            rate = self.done / max(now - self.started, 1e-9) / (1 << 30)
            pct = 100 * self.done / max(self.total, 1)
            end = "\n" if self.done == self.total else ""
            sys.stderr.write(
                f"\rgms: loading {self.done / (1 << 30):.2f}/{self.total / (1 << 30):.2f} GiB "
                f"({pct:.0f}%) {rate:.2f} GiB/s{end}"
            )
            sys.stderr.flush()


def _host_view(va: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_uint8 * nbytes).from_address(va)).cast("B")


def _copy_to_host(stored: Sequence[StoredTensor], targets: Sequence[int], progress: _Progress) -> None:
    """Host backend: read each tensor's bytes directly into the mapping."""
    for path, group in _by_file(stored, targets):
        with open(path, "rb", buffering=0) as f:
            for tensor, va in group:
                f.seek(tensor.start)
                view_ = _host_view(va, tensor.nbytes) if tensor.nbytes else memoryview(b"")
                got = 0
                while got < tensor.nbytes:
                    n = f.readinto(view_[got:])
                    if not n:
                        raise CheckpointError(f"{path}: truncated inside {tensor.name}")
                    got += n
                progress.advance(tensor.nbytes)


def _copy_to_cuda(stored, targets, device: torch.device, progress: _Progress) -> None:
    """CUDA: file -> pinned staging -> device, reads overlapping copies."""
    staging = [torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    host = [_host_view(s.data_ptr(), STAGING_BYTES) for s in staging]
    done = [torch.cuda.Event() for _ in staging]
    stream = torch.cuda.Stream(device)
    turn = 0
    for path, group in _by_file(stored, targets):
        with open(path, "rb", buffering=0) as f:
            for tensor, va in group:
                f.seek(tensor.start)
                dst = region(va, max(tensor.nbytes, 1), device)
                copied = 0
                while copied < tensor.nbytes:
                    n = min(STAGING_BYTES, tensor.nbytes - copied)
                    done[turn].synchronize()  # the copy that last used this buffer is over
                    got = 0
                    while got < n:
                        k = f.readinto(host[turn][got:n])
                        if not k:
                            raise CheckpointError(f"{path}: truncated inside {tensor.name}")
                        got += k
                    with torch.cuda.stream(stream):
                        dst[copied : copied + n].copy_(staging[turn][:n], non_blocking=True)
                        done[turn].record(stream)
                    copied += n
                    turn ^= 1
                progress.advance(tensor.nbytes)
    stream.synchronize()


def _by_file(stored, targets):
    group: list = []
    for tensor, va in zip(stored, targets):
        if group and group[-1][0].path != tensor.path:
            yield group[0][0].path, group
            group = []
        group.append((tensor, va))
    if group:
        yield group[0][0].path, group


def load_safetensors(
    mgr: GMSClientMemoryManager,
    paths: str | os.PathLike | Iterable[str | os.PathLike],
    *,
    prefix: str = "",
    tag: str = "weights",
    pack_bytes: int = DEFAULT_PACK_BYTES,
    progress: bool | None = None,
) -> dict[str, TensorMeta]:
    """Stream checkpoint files into packed gms allocations and describe every tensor.

    Needs the RW lock; the caller commits.  ``paths`` may be files or a folder
    (its ``*.safetensors``).  ``progress``: None shows a bar for 1 GiB or more
    on a terminal.  Returns the tensors loaded.
    """
    if mgr.granted_lock_type is not GrantedLockType.RW:
        raise RuntimeError("loading a checkpoint needs the RW lock")
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    files: list[str] = []
    for p in map(Path, paths):
        files += sorted(map(str, p.glob("*.safetensors"))) if p.is_dir() else [str(p)]
    stored = [t for f in files for t in read_header(f)]
    names = [t.name for t in stored]
    if len(set(names)) != len(names):
        raise CheckpointError("a tensor name appears in more than one file")
    plan = plan_packs([t.nbytes for t in stored], pack_bytes)
    vas = [mgr.create_mapping(size=size, tag=tag) for size in plan.pack_sizes]
    allocation_of = {mp.va: mp.allocation_id for mp in mgr.mappings}
    targets = [vas[p.pack] + p.offset for p in plan.placements]
    bar = _Progress(sum(t.nbytes for t in stored), progress)
    device = device_for(mgr.backend, mgr.device)
    if device.type == "cuda":
        _copy_to_cuda(stored, targets, device, bar)
    else:
        _copy_to_host(stored, targets, bar)
    rows = [
        (prefix + t.name, allocation_of[vas[p.pack]], p.offset, encode(t.meta))
        for t, p in zip(stored, plan.placements)
    ]
    for start in range(0, len(rows), _PUT_BATCH):
        mgr.metadata_put_many(rows[start : start + _PUT_BATCH])
    return {t.name: t.meta for t in stored}
