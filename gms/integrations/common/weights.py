"""What both engines' gms loaders do with a model once their engine built it:
publish it (the first engine) and check what was published (every later one).
Engine-free: the model is a torch module, the engine's name a string."""

from __future__ import annotations

import logging
import os
import time

import torch
from torch import nn

from ... import torch as gms_torch
from ...fsm import RequestedLockType
from .errors import LayoutMismatchError, UnsupportedModelError
from .memory import WEIGHTS, EngineMemory
from .names import ModelIdentity, identity_key, tensor_prefix

log = logging.getLogger("gms.integrations")


def identity(engine: str, engine_version: str, model: str, revision: str | None, dtype, architecture: str,
             tp: tuple[int, int], pp) -> ModelIdentity:
    """This rank's identity: ``tp`` its (rank, size), ``pp`` the engine's pipeline
    group (``rank_in_group``, ``world_size``: vLLM's and SGLang's alike)."""
    if os.path.isdir(model):  # two engines may name one folder differently
        model = os.path.realpath(model)
    return ModelIdentity(engine=engine, engine_version=engine_version, model=model, revision=revision,
                         dtype=str(dtype).removeprefix("torch."), architecture=architecture,
                         tp_rank=tp[0], tp_size=tp[1], pp_rank=pp.rank_in_group, pp_size=pp.world_size)


def publish(memory: EngineMemory, model: nn.Module, engine: str, residency: str, lock_timeout_ms: int | None,
            loaded_at: float) -> None:
    """Describe every tensor of ``model`` on this GPU (made in the weights layout,
    RW), add the identity, commit; then read the weights back as a reader at
    the same addresses, buffers copied out (an engine may write them)."""
    mgr = memory.weights
    device = torch.device("cuda", memory.device)
    # Tensors a model keeps on the host stay out: a reader computes those itself.
    tensors = [(name, t) for name, t in gms_torch.module_tensors(model) if t.device == device]
    count = gms_torch.publish_tensors(mgr, tensors, prefix=tensor_prefix(engine), tag=WEIGHTS)
    if not mgr.mappings:
        raise UnsupportedModelError("the model has no tensors on the GPU to publish")
    mgr.metadata_put(identity_key(engine), mgr.mappings[0].allocation_id, 0, memory.identity.to_json())
    mgr.commit(residency=residency)
    # From here on this engine reads its weights like every other one.
    mgr.connect(RequestedLockType.RO, lock_timeout_ms)
    mgr.remap_all_vas()
    copied = private_buffers(model, mgr)
    memory.timings["publish_s"] = time.perf_counter() - loaded_at
    tensor_bytes = sum(t.numel() * t.element_size() for t in _distinct(tensors))
    log.info("gms: published %d tensors (%.2f GiB of tensors in %.2f GiB of gms memory), "
             "%d buffers copied out, commit took %.3f s", count, tensor_bytes / (1 << 30),
             mgr.total_bytes / (1 << 30), copied, memory.timings["publish_s"])


def check_published(memory: EngineMemory, engine: str) -> None:
    """The committed layout holds weights published for this very identity."""
    mgr = memory.weights
    entry = mgr.metadata_get(identity_key(engine))
    if entry is None:
        raise LayoutMismatchError(f"layout {mgr.layout!r} holds no weights published by {engine}")
    differences = memory.identity.differences(ModelIdentity.from_json(entry[2]))
    if differences:
        raise LayoutMismatchError(f"layout {mgr.layout!r} was published for another engine: "
                                  + "; ".join(differences))


def private_buffers(model: nn.Module, mgr) -> int:
    """Buffers lying in the (now read-only) gms memory get a private copy."""
    spans = [(mp.va, mp.va + mp.size) for mp in mgr.mappings]
    copied = 0
    for module in model.modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is None or buffer.device.type != "cuda":
                continue
            if any(lo <= buffer.data_ptr() < hi for lo, hi in spans):
                module._buffers[name] = buffer.clone()
                copied += 1
    return copied


def _distinct(tensors):
    """Each tensor once, whatever the names it is published under (ties)."""
    seen = set()
    for _, tensor in tensors:
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            yield tensor
