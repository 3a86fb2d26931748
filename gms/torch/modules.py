"""Publish tensors and modules to gms, and materialize them in another process.

``publish_*`` (RW): every tensor ends up in gms memory, either where it
already is (tensors made under :func:`gms.torch.use_memory`) or copied into
packed allocations, and is described by one metadata entry.  All entries go
in one round trip.

``import_tensors`` / ``materialize_module``: one metadata scan, batched
exports and one view per tensor: the round trips do not grow with the number
of tensors.  Tied tensors (one storage, several names) come back as one
tensor object, so ties survive.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn

from ..client.manager import GMSClientMemoryManager
from ..fsm import GrantedLockType
from .encoding import TensorMeta, decode, encode
from .packing import DEFAULT_PACK_BYTES, plan_packs
from .views import Region, device_for

_PUT_BATCH = 4096  # entries per metadata_put_many, well under the frame cap


def _device(mgr: GMSClientMemoryManager) -> torch.device:
    if mgr.backend is None:
        raise RuntimeError("the manager has not connected yet")
    return device_for(mgr.backend, mgr.device)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Located:
    """Find which mapping of a manager holds an address."""

    def __init__(self, mgr: GMSClientMemoryManager) -> None:
        self._mappings = [mp for mp in mgr.mappings if mp.mapped]
        self._starts = [mp.va for mp in self._mappings]

    def find(self, ptr: int, nbytes: int):
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i >= 0:
            mp = self._mappings[i]
            if ptr + nbytes <= mp.va + mp.size and ptr - mp.va < mp.alloc_size:
                return mp
        return None


def publish_tensors(
    mgr: GMSClientMemoryManager,
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    *,
    prefix: str = "",
    tag: str = "weights",
    pack_bytes: int = DEFAULT_PACK_BYTES,
) -> int:
    """Describe (and where needed copy) tensors into the writer's layout; returns the count."""
    if mgr.granted_lock_type is not GrantedLockType.RW:
        raise RuntimeError("publishing needs the RW lock")
    items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
    device = _device(mgr)
    located = _Located(mgr)
    entries: dict[str, tuple[str, int, bytes]] = {}
    to_copy: dict[tuple, list[str]] = {}  # one copy per distinct storage view
    sources: dict[tuple, torch.Tensor] = {}
    for name, tensor in items:
        meta = TensorMeta.of(tensor)
        mp = None
        if tensor.device == device:
            mp = located.find(tensor.data_ptr(), meta.extent_bytes)
        if mp is not None:
            entries[name] = (mp.allocation_id, tensor.data_ptr() - mp.va, encode(meta))
        else:
            key = (tensor.data_ptr(), tensor.device, meta)
            to_copy.setdefault(key, []).append(name)
            sources[key] = tensor
    if to_copy:
        keys = list(to_copy)
        sizes = [sources[k].numel() * sources[k].element_size() for k in keys]
        plan = plan_packs(sizes, pack_bytes)
        packs = []
        for pack_size in plan.pack_sizes:
            va = mgr.create_mapping(size=pack_size, tag=tag)
            mapping = next(mp for mp in mgr.mappings if mp.va == va)
            packs.append((mapping, Region(va, mapping.size, device)))
        for key, placement in zip(keys, plan.placements):
            source = sources[key]
            mapping, pack = packs[placement.pack]
            meta = TensorMeta(source.dtype, tuple(source.shape), tuple(source.contiguous().stride()))
            pack.tensor(placement.offset, meta).copy_(source)
            for name in to_copy[key]:
                entries[name] = (mapping.allocation_id, placement.offset, encode(meta))
        _synchronize(device)
    rows = [(prefix + name, *entry) for name, entry in entries.items()]
    for start in range(0, len(rows), _PUT_BATCH):
        mgr.metadata_put_many(rows[start : start + _PUT_BATCH])
    return len(rows)


def module_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer, under every name (ties included)."""
    yield from ((n, p.detach()) for n, p in model.named_parameters(remove_duplicate=False))
    yield from model.named_buffers(remove_duplicate=False)


def publish_module(
    model: nn.Module,
    mgr: GMSClientMemoryManager,
    *,
    prefix: str = "",
    tag: str = "weights",
    pack_bytes: int = DEFAULT_PACK_BYTES,
) -> int:
    """Register every parameter and buffer of ``model``; returns the entry count."""
    return publish_tensors(mgr, module_tensors(model), prefix=prefix, tag=tag, pack_bytes=pack_bytes)


def import_tensors(mgr: GMSClientMemoryManager, prefix: str = "") -> dict[str, torch.Tensor]:
    """Zero-copy tensors for every entry under ``prefix`` (names without the prefix)."""
    entries = mgr.metadata_scan(prefix)
    device = _device(mgr)
    mapped = {mp.allocation_id: mp for mp in mgr.mappings if mp.mapped}
    missing = sorted({alloc for alloc, _, _ in entries.values()} - mapped.keys())
    if missing:
        mgr.create_mappings(missing)
        mapped = {mp.allocation_id: mp for mp in mgr.mappings if mp.mapped}
    regions = {alloc: Region(mp.va, mp.size, device) for alloc, mp in mapped.items()}
    made: dict[tuple[str, int, bytes], torch.Tensor] = {}
    metas: dict[bytes, TensorMeta] = {}  # a model repeats a dozen shapes many times
    out: dict[str, torch.Tensor] = {}
    for key, entry in entries.items():
        tensor = made.get(entry)
        if tensor is None:
            alloc, offset, value = entry
            meta = metas.get(value)
            if meta is None:
                meta = metas[value] = decode(value)
            tensor = made[entry] = regions[alloc].tensor(offset, meta)
        out[key[len(prefix) :]] = tensor
    return out


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (model.get_submodule(path) if path else model), leaf


def materialize_module(
    model: nn.Module,
    mgr: GMSClientMemoryManager,
    *,
    prefix: str = "",
    share_buffers: bool = False,
    strict: bool = True,
) -> list[str]:
    """Point ``model``'s parameters and buffers at the published tensors.

    Parameters stay on the shared (for readers: read-only) mapping.  Buffers
    get a private copy unless ``share_buffers``: a model may write them.
    Tied parameters need one of their names published.  Buffers that were
    not published and are real tensors (e.g. non-persistent ones the skeleton
    computed) move to the device.  Returns the names not found; with
    ``strict``, a missing parameter or meta buffer raises.
    """
    tensors = import_tensors(mgr, prefix)
    device = _device(mgr)
    unusable: list[str] = []  # missing, and nothing to fall back on
    skipped: list[str] = []  # missing, but the skeleton's own tensor is kept
    parameters: dict[int, nn.Parameter] = {}
    named = list(model.named_parameters(remove_duplicate=False))
    # A tie (one parameter under several names) needs only one name published:
    # checkpoints drop the duplicates.
    ties: dict[int, torch.Tensor] = {}
    for name, param in named:
        if name in tensors:
            ties.setdefault(id(param), tensors[name])
    for name, param in named:
        tensor = tensors.get(name, ties.get(id(param)))
        if tensor is None:
            unusable.append(name)
            continue
        if tuple(tensor.shape) != tuple(param.shape) or tensor.dtype != param.dtype:
            raise ValueError(
                f"{name}: published {tensor.dtype}{tuple(tensor.shape)}, model wants "
                f"{param.dtype}{tuple(param.shape)}"
            )
        module, leaf = _owner(model, name)
        if id(tensor) not in parameters:
            parameters[id(tensor)] = nn.Parameter(tensor, requires_grad=False)
        module._parameters[leaf] = parameters[id(tensor)]
    for name, buffer in list(model.named_buffers(remove_duplicate=False)):
        module, leaf = _owner(model, name)
        tensor = tensors.get(name)
        if tensor is not None:
            module._buffers[leaf] = tensor if share_buffers else tensor.clone()
        elif buffer.is_meta:
            unusable.append(name)
        else:
            skipped.append(name)
            module._buffers[leaf] = buffer.to(device)
    if strict and unusable:
        shown = ", ".join(unusable[:10]) + (f" and {len(unusable) - 10} more" if len(unusable) > 10 else "")
        raise KeyError(f"not published under {prefix!r}: {shown}")
    return unusable + skipped


@contextlib.contextmanager
def empty_parameters() -> Iterator[None]:
    """Build a model skeleton whose parameters are on ``meta`` (no memory, no init),
    while buffers are computed normally: then ``materialize_module`` fills it."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original
